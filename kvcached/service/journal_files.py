"""Which files beside its journal the ledger service may touch, and keeping the previous runs.

The journal path is a setting (``KVCACHED_LEDGER_JOURNAL``), often in a shared directory, and a
wrong or hostile value must not cost anyone a file. So the service only ever renames or deletes a
file it can tell it wrote (:func:`not_ours`). At start (:func:`claim`) the previous run's files
are renamed aside as a journal of their own, and the files of runs beyond the newest
``keep_runs`` are deleted (:func:`prune`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from typing import IO, Final, Literal

from kvcached.errors import JournalError, JournalWriteError
from kvcached.ledger.files import FileId, NotRegularFileError, install, kind, lstat, open_regular
from kvcached.ledger.journal import JournalReader
from kvcached.ledger.segments import SEGMENT_KEY, read_snapshot, segment_number, segment_path, snapshot_path

RUN_INFIX: Final = ".run"

# What a name in the folder is to the journal at P: segment k (P itself is 0) or the snapshot.
Member = tuple[Literal["segment"], int] | tuple[Literal["snapshot"], None]


def lock(file: IO[bytes]) -> None:
    """Marks a segment as being written by this process; released when the file is closed.

    Two engines given the same journal path (data-parallel ranks, a second server by mistake)
    would otherwise each take the other's files for a finished run's. The lock is advisory and
    does not stop kvreplay from reading the segment.
    """
    fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def _in_use(path: str) -> bool:
    try:
        f, _ = open_regular(path, follow=False)
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False


def members(entries: list[str], name: str) -> dict[str, Member]:
    """The entries of a folder that belong to the journal named ``name``: ``name``, ``name.<n>``
    and ``name.snap``. A temporary file of the service has a name of its own and is none."""
    found: dict[str, Member] = {}
    for entry in entries:
        if entry == name:
            found[entry] = ("segment", 0)
        elif entry == snapshot_path(name):
            found[entry] = ("snapshot", None)
        elif (k := segment_number(entry, name)) is not None:
            found[entry] = ("segment", k)
    return found


def not_ours(path: str, member: Member) -> str | None:
    """None when ``path`` is a file the service wrote as ``member``; else why not, in words.

    NOTE: a file the service wrote is a regular file (not a link), owned by the service's user,
    that is a journal segment whose header carries the number its name says (the service writes
    ``segment`` into every header it writes), or a snapshot that decodes as one. A service that
    went by the name alone would replace ``/dev/full`` with a regular file, or delete
    ``syslog.1`` for a journal named ``syslog``."""
    st = lstat(path)
    if st is None:
        return "gone"
    if not stat.S_ISREG(st.st_mode):
        return kind(st.st_mode)
    if st.st_uid != os.geteuid():
        return f"a file of another user (uid {st.st_uid})"
    if member[0] == "snapshot":
        try:
            read_snapshot(path)
        except JournalError:
            return "a regular file that is not a ledger snapshot"
        return None
    k = member[1]
    try:
        f, opened = open_regular(path, follow=False)
    except (NotRegularFileError, OSError):
        return "a file that cannot be opened to be checked"
    try:
        if FileId.of(opened) != FileId.of(st):
            return "a file that changed while it was checked"
        with JournalReader(path, file=f) as reader:
            number = reader.header.meta.get(SEGMENT_KEY)
    except JournalError:
        return "a regular file that is not a kvcached journal"
    finally:
        f.close()
    if number != str(k):
        return "a kvcached journal the service did not write" if number is None else f"segment {number}, not {k}"
    return None


def _target(archive: str, member: Member) -> str:
    return snapshot_path(archive) if member[0] == "snapshot" else segment_path(archive, member[1])


_RUN: Final = r"\.run([1-9][0-9]{0,8})(?:\.([1-9][0-9]{0,8})|(\.snap))?"


def runs(entries: list[str], name: str) -> dict[int, dict[str, Member]]:
    """The kept runs of the journal ``name``: run number -> its files in the folder."""
    pattern = re.compile(re.escape(name) + _RUN)
    found: dict[int, dict[str, Member]] = {}
    for entry in entries:
        m = pattern.fullmatch(entry)
        if m is None:
            continue
        member: Member = ("snapshot", None) if m[3] else ("segment", int(m[2] or 0))
        found.setdefault(int(m[1]), {})[entry] = member
    return found


def claim(base: str, keep_runs: int) -> tuple[str | None, int]:
    """Readies the names of a new run at ``base``; returns (where the previous run now lies or
    None, runs deleted). Raises ``JournalWriteError`` (one line, nothing touched) when a name the
    run will write is held by a file the service did not write, or by a running service.

    NOTE: a name the new run will write (``P``, ``P.<n>``, ``P.snap``) held by anything but a
    file the service wrote stops journaling with one line, before anything is written; so does a
    journal another running service holds (an exclusive ``flock`` on its current segment, see
    :func:`lock`).

    NOTE: the previous run's files are renamed, never copied or deleted (it is the journal an
    operator needs after a crash), to ``P.run<N>``, ``P.run<N>.<n>``, ``P.run<N>.snap``. That is
    a journal of its own that ``kvreplay check P.run<N>`` reads, ``N`` one more than any run
    number in the folder. Of those runs, the newest ``keep_runs`` are kept and the files of
    older ones that the service wrote are deleted (:func:`prune`)."""
    folder = os.path.dirname(base) or "."
    name = os.path.basename(base)
    entries = os.listdir(folder)
    previous = members(entries, name)
    for entry, member in sorted(previous.items()):
        path = os.path.join(folder, entry)
        why = not_ours(path, member)
        if why is not None:
            raise JournalWriteError(
                f"{path}: {why}, not a file this journal service wrote; it neither replaces nor deletes such a "
                f"file, so journaling is off (give the journal a free path, or move the file away)"
            )
        if _in_use(path):
            raise JournalWriteError(
                f"{base}: another running ledger service is writing this journal ({path} is locked); "
                f"journaling is off (give each engine its own journal path)"
            )
    archive = None
    if previous:
        number = 1 + max(runs(entries, name), default=0)
        archive = os.path.join(folder, f"{name}{RUN_INFIX}{number}")
        for entry, member in sorted(previous.items(), key=lambda e: (e[1][0], e[1][1] or 0)):
            try:
                install(os.path.join(folder, entry), _target(archive, member))
            except FileExistsError as exc:
                what = "exists already: not replacing it with the previous run's file"
                raise JournalWriteError(f"{exc.filename}: {what}") from None
    return archive, prune(folder, name, keep_runs)


def prune(folder: str, name: str, keep_runs: int) -> int:
    """Deletes the files the service wrote of all but the newest ``keep_runs`` runs; returns how
    many runs lost files. Files in a run's names that the service did not write stay."""
    by_run = runs(os.listdir(folder), name)
    ours: list[tuple[int, list[str]]] = []
    for number, files in sorted(by_run.items(), reverse=True):
        mine = [e for e, m in files.items() if not_ours(os.path.join(folder, e), m) is None]
        if mine:
            ours.append((number, mine))
    for _, doomed in ours[keep_runs:]:
        for entry in doomed:
            try:
                os.unlink(os.path.join(folder, entry))
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.EACCES):
                    raise
    return len(ours[keep_runs:])
