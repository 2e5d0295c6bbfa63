"""The flight recorder: the last events of a served engine, kept in memory, saved as a trace.

A journal is off by default (it costs disk and an operator must ask for it), so without this a
violation seen in production leaves nothing to replay. The ledger service keeps, beside its
replica, the encoded batches it already makes for the journal and ``kvctl tail`` (no second
encoding, no copy of an event), and a snapshot of the replica at the start of what it keeps.
"""

from __future__ import annotations

import io
import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable
from typing import Final

import msgspec

from kvcached.ledger.events import Header
from kvcached.ledger.files import FileId, kind, lstat, write_whole
from kvcached.ledger.journal import JournalWriter
from kvcached.ledger.segments import segment_header, snapshot_path
from kvcached.ledger.state import LedgerSnapshot
from kvcached.service.messages import DumpReply

REASON_KEY: Final = "flight_recorder"  # header meta: why the dump was written
DUMP_SUFFIX: Final = ".kvj"


class FlightRecorder:
    """The latest ``capacity`` to ``2 * capacity`` events of one ledger service (on its loop)."""

    def __init__(self, header: Header, capacity: int, start: LedgerSnapshot | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"a flight recorder keeps at least 1 event, not {capacity}")
        self.header, self.capacity = header, capacity
        self._frames: deque[tuple[int, int, bytes]] = deque()  # (first index, count, encoded batch)
        self._base = start  # None: the ring starts at event 0, from a fresh ledger
        self._base_index = start.index if start is not None else 0
        self._next: LedgerSnapshot | None = None
        self._end = self._base_index

    @property
    def first_event(self) -> int:
        return self._base_index

    @property
    def events(self) -> int:
        return self._end - self._base_index

    def add(self, first: int, count: int, payload: bytes, snapshot: Callable[[], LedgerSnapshot] | None) -> None:
        """One batch the service applied; ``snapshot`` gives the replica's state after it (None:
        there is no replica, and the ring keeps growing from its start up to twice its size).

        NOTE: two generations bound the memory: once ``capacity`` events follow the base
        snapshot, a second snapshot is taken; once ``capacity`` more follow that one, it becomes
        the base and the batches before it are dropped. So between ``capacity`` and ``2 *
        capacity`` of the latest events are kept, and each snapshot costs one ``Ledger.snapshot``
        per ``capacity`` events on the service's thread, never on the scheduler's. Snapshots fall
        between batches, so a dump is whole frames."""
        self._frames.append((first, count, payload))
        self._end = first + count
        if snapshot is None:
            while self._end - self._frames[0][0] > 2 * self.capacity and len(self._frames) > 1:
                self._frames.popleft()  # no snapshot to start from: the dump is unreplayable anyway
            return
        if self._next is None:
            if self._end - self._base_index >= self.capacity:
                self._next = snapshot()
        elif self._end - self._next.index >= self.capacity:
            turn = self._next.index
            while self._frames and self._frames[0][0] < turn:
                self._frames.popleft()
            self._base, self._base_index = self._next, turn
            self._next = snapshot()

    def dump(self, reason: str) -> DumpReply:
        """The kept events as a trace (the bytes of a journal file, and of its snapshot).

        NOTE: a dump (``messages.DumpReply``, as ``kvctl dump`` receives it) is a valid rotated
        journal of one segment whose header says where it starts (``first_event``). The base
        snapshot goes beside it as ``P.snap`` (docs/trace-format.md, "journals written by the
        ledger service"), which ``kvreplay check P`` picks up by itself. A dump of an engine that
        has not yet turned the ring over starts at event 0 and needs no snapshot."""
        header = segment_header(self.header, 0, self._base_index)
        header = msgspec.structs.replace(header, meta={**header.meta, REASON_KEY: reason}, created_unix=time.time())
        buf = io.BytesIO()
        writer = JournalWriter(buf, "<flight recorder>", header)
        for _, count, payload in self._frames:
            writer.append_encoded(payload, count)
        snap = None
        if self._base is not None and self._base_index > 0:
            snap = msgspec.msgpack.encode(self._base)
        return DumpReply(first_event=self._base_index, events=self.events, journal=buf.getvalue(), snapshot=snap)


# --- writing a dump -----------------------------------------------------------------------------


def default_dump_dir() -> str:
    """``$XDG_STATE_HOME/kvcached``, else ``~/.local/state/kvcached``: kept across reboots, unlike
    the runtime directory, since a dump is what goes into a bug report."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state, "kvcached")


def dump_name(folder: str, pid: int, reason: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    tag = re.sub(r"[^A-Za-z0-9]+", "-", reason).strip("-")[:32] or "dump"
    return os.path.join(folder, f"flight-{pid}-{stamp}-{tag}{DUMP_SUFFIX}")


def _write_file(path: str, body: bytes, *, replace: bool) -> FileId:
    """``body`` at ``path``, on disk when this returns; a regular file already there is replaced
    only if ``replace`` (kvctl's ``-o``), anything else is refused. Returns the file's id."""
    st = lstat(path)
    if st is not None and not replace:
        raise FileExistsError(f"{path}: exists already; not replacing it")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise IsADirectoryError(f"{path}: {kind(st.st_mode)}, not a regular file; not writing there")
    return write_whole(path, body, sync=True, replacing=None if st is None else FileId.of(st))


def write_dump_files(dump: DumpReply, path: str, *, replace: bool = False) -> list[tuple[str, FileId]]:
    """Writes ``dump`` as ``path`` (and ``path.snap``); returns the files written with their ids
    (what the service later checks before it deletes an old dump). The snapshot goes first, so
    that a journal that needs one is never there without it."""
    written = []
    if dump.snapshot is not None:
        written.append((snapshot_path(path), _write_file(snapshot_path(path), dump.snapshot, replace=replace)))
    written.append((path, _write_file(path, dump.journal, replace=replace)))
    return written


def write_dump(dump: DumpReply, path: str, *, replace: bool = False) -> list[str]:
    """:func:`write_dump_files`, the names alone."""
    return [name for name, _ in write_dump_files(dump, path, replace=replace)]


def make_dump_dir(folder: str) -> None:
    os.makedirs(folder, mode=0o700, exist_ok=True)
