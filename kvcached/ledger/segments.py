"""Rotated journals and snapshots: the one reader and the one snapshot writer that the journal
service and kvreplay share.

The journal service writes the journal at ``P`` as segments ``P``, ``P.1``, ``P.2`` ..., each a
complete journal whose header ``meta`` gives its ``segment`` number and the global index of its
``first_event``, and its latest snapshot as ``P.snap`` (docs/trace-format.md). A reader that
stops at ``P`` calls a twelve-segment run clean after reading a twelfth of it. So everything a
reader must know lives here once (``RotatedJournal``), beside the snapshot's reader and writer
(``read_snapshot``, ``write_snapshot``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Iterator, Sequence
from typing import Final

import msgspec

from kvcached.errors import ConfigError, JournalError

from .events import INT64_MAX, Event, Header, misfit
from .files import FileId, NotRegularFileError, read_regular, write_whole
from .journal import PREAMBLE_SIZE, JournalReader, TornTail
from .ledger import Ledger
from .state import LedgerSnapshot

SEGMENT_KEY: Final = "segment"  # header meta: the segment's number, as a decimal string
FIRST_EVENT_KEY: Final = "first_event"  # header meta: global index of the segment's first event
# header meta: the journal's size bound deleted every segment below this number (its snapshot
# starts in this one or later); the newest segment's header carries the latest value
PRUNED_KEY: Final = "pruned_below"
SNAPSHOT_SUFFIX: Final = ".snap"
# More digits than any event count can have: a longer "number" is damage, not an index.
_MAX_DIGITS: Final = 19


def segment_path(base: str, k: int) -> str:
    """The name of segment ``k`` of the journal at ``base``: ``base`` itself, then ``base.k``."""
    return base if k == 0 else f"{base}.{k}"


def snapshot_path(base: str) -> str:
    return base + SNAPSHOT_SUFFIX


def segment_header(header: Header, k: int, first_event: int, pruned_below: int = 0) -> Header:
    """The header of segment ``k``: ``header`` with the segment's meta and a creation time."""
    meta = {**header.meta, SEGMENT_KEY: str(k), FIRST_EVENT_KEY: str(first_event)}
    if pruned_below:
        meta[PRUNED_KEY] = str(pruned_below)
    return msgspec.structs.replace(header, meta=meta, created_unix=header.created_unix or time.time())


def segment_number(name: str, base_name: str) -> int | None:
    """``k`` when the file name ``name`` is ``base_name.k`` (k >= 1, written as segment_path does)."""
    if not name.startswith(base_name + "."):
        return None
    rest = name[len(base_name) + 1 :]
    if not (rest.isascii() and rest.isdigit()) or len(rest) > 9 or rest[0] == "0":
        return None
    return int(rest)


def _meta_int(path: str, header: Header, key: str) -> int | None:
    raw = header.meta.get(key)
    if raw is None:
        return None
    if not (raw.isascii() and raw.isdigit()) or len(raw) > _MAX_DIGITS or int(raw) > INT64_MAX:
        raise JournalError(path, PREAMBLE_SIZE, f"header meta {key}={raw[:40]!r} is not a number in 0..2^63-1")
    return int(raw)


def _same_run(a: Header, b: Header) -> bool:
    return (a.format_version, a.page_bytes, a.pools, a.workers, a.policy) == (
        b.format_version,
        b.page_bytes,
        b.pools,
        b.workers,
        b.policy,
    )


class Segment(msgspec.Struct, frozen=True):
    """One file of a journal: its number, path and the global index of its first event."""

    number: int
    path: str
    first_event: int


def read_header(path: str) -> Header:
    with JournalReader(path) as reader:
        return reader.header


def names(segments: list[Segment], most: int = 4) -> str:
    """The segments' paths for a message: all of them, or the first and last few."""
    paths = [s.path for s in segments]
    if len(paths) <= most:
        return ", ".join(paths)
    return f"{', '.join(paths[:2])} ... {', '.join(paths[-2:])}"


class RotatedJournal:
    """The journal that ``path`` belongs to, read in order as one trace of global event indices.

    ``segments`` are its files in order; ``given`` is the segment number of ``path`` (None for a
    file with no segment meta, which is read alone); ``base`` is the journal's ``P``. After
    reading, ``read`` holds the segments read with their event counts, ``events_read`` the global
    index after the last event, and ``torn_tail``/``torn_segment`` a torn last frame. Problems
    are ``JournalError`` naming the file: a missing segment, one that does not start where the
    one before ended, one from another run, a torn frame anywhere but at the very end.

    NOTE: what a reader must know: which files make up the journal (the numbered siblings of
    ``P``, contiguous), that each segment starts where the one before it ended, that only the
    last may end in a torn frame, and that a journal starting mid-run (a service started from a
    snapshot) can only be replayed from a snapshot. A file whose header has no ``segment`` (a
    recorder's or kvreplay's trace) is a journal of one file: nothing beside it is read.

    NOTE: given a segment ``P.k`` the reader reads the journal it belongs to, from ``P``. The
    events of a segment that starts mid-run mean nothing to a fresh ledger, so reading it alone
    would report false violations.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.base = self.path
        self.standalone = False  # a segment whose siblings are not named after it (copied, renamed)
        self.pruned_below = 0  # segments below this one were deleted by the writer's size bound
        self.given: int | None
        self.segments: list[Segment]
        pruned = self._pruned_start() if not os.path.lexists(self.path) else None
        if pruned is not None:  # P itself was pruned: the journal starts at the segment the note names
            self.given = 0
            self.segments = self._discover(*pruned)
            self._finish()
            return
        header = read_header(self.path)
        self.given = _meta_int(self.path, header, SEGMENT_KEY)
        first = _meta_int(self.path, header, FIRST_EVENT_KEY) or 0
        if self.given is None:
            self.segments = [Segment(0, self.path, 0)]
        else:
            suffix = f".{self.given}"
            if self.given and not (self.path.endswith(suffix) and len(self.path) > len(suffix)):
                self.standalone = True
                self.segments = [Segment(self.given, self.path, first)]
            else:
                self.base = self.path[: -len(suffix)] if self.given else self.path
                self.segments = self._discover(Segment(self.given, self.path, first), header)
        self._finish(header)

    def _finish(self, header: Header | None = None) -> None:
        self.header = (
            header
            if header is not None and self.segments[0].path == self.path
            else (read_header(self.segments[0].path))
        )
        self.first_event = self.segments[0].first_event
        self.read: list[tuple[Segment, int]] = []
        self.events_read = self.first_event
        self.torn_tail: TornTail | None = None
        self.torn_segment: str | None = None

    @property
    def paths(self) -> list[str]:
        return [s.path for s in self.segments]

    @property
    def size(self) -> int:
        """Bytes in all segments (for a progress bar)."""
        total = 0
        for s in self.segments:
            with contextlib.suppress(OSError):
                total += os.path.getsize(s.path)
        return total

    def _numbers(self, given: int | None) -> set[int]:
        folder, name = os.path.split(self.base)
        found = set() if given is None else {given}
        try:
            entries = os.listdir(folder or ".")
        except OSError:  # a folder that may be searched but not listed: probe the names in turn
            k = 1
            while os.path.exists(segment_path(self.base, k)):
                found.add(k)
                k += 1
            entries = [name] if os.path.exists(self.base) else []
        for entry in entries:
            if entry == name:
                found.add(0)
            elif (number := segment_number(entry, name)) is not None:
                found.add(number)
        return found

    def _pruned_start(self) -> tuple[Segment, Header] | None:
        """The first segment of a journal whose ``P`` is gone, when its newest segment says that the
        writer's size bound deleted the segments before that one; None when ``P`` has no numbered
        siblings (then ``P`` is simply missing). Without the note the head is lost: an error."""
        numbers = sorted(self._numbers(None))
        if not numbers:
            return None
        top = segment_path(self.base, numbers[-1])
        pruned = _meta_int(top, read_header(top), PRUNED_KEY)
        if not pruned:
            have = ", ".join(segment_path(self.base, n) for n in numbers[:3]) + (" ..." if len(numbers) > 3 else "")
            what = f"missing, and no segment says the journal's size bound deleted it (there are {have}): events lost"
            raise JournalError(self.path, 0, what)
        path = segment_path(self.base, pruned)
        if pruned not in numbers:
            what = (
                f"segment {pruned} of the rotated journal {self.base} is missing (its size bound deleted the "
                f"segments before it, not it): events lost"
            )
            raise JournalError(path, 0, what)
        header = read_header(path)
        return Segment(pruned, path, _meta_int(path, header, FIRST_EVENT_KEY) or 0), header

    def _discover(self, given: Segment, header: Header) -> list[Segment]:
        """NOTE: a service with a size bound deletes the segments before its snapshot's and says so
        in the header of every segment it writes after (``pruned_below``). Only that note lets a
        journal start at a segment other than ``P`` when ``P`` is named. The segments below it
        that a pruning cut short left behind are no part of the journal; a segment missing
        without the note is lost events."""
        numbers = sorted(self._numbers(given.number))
        top = segment_path(self.base, numbers[-1])
        pruned = _meta_int(top, header if numbers[-1] == given.number else read_header(top), PRUNED_KEY) or 0
        if pruned > numbers[-1]:
            raise JournalError(top, PREAMBLE_SIZE, f"its header says segments below {pruned} were deleted, past itself")
        if pruned:
            if given.number < pruned:
                what = (
                    f"the journal's size bound deleted segments below {pruned} of {self.base} (its newest segment "
                    f"says so): this one is left over; read {segment_path(self.base, pruned)}"
                )
                raise JournalError(given.path, PREAMBLE_SIZE, what)
            # Segments below the note are what a pruning cut short left: no part of the journal.
            numbers = [n for n in numbers if n >= pruned]
            if numbers[0] != pruned:
                what = (
                    f"segment {pruned} of the rotated journal {self.base} is missing (its size bound deleted the "
                    f"segments before it, not it): events lost"
                )
                raise JournalError(segment_path(self.base, pruned), 0, what)
            self.pruned_below = pruned
        segments: list[Segment] = []
        for k in range(numbers[0], numbers[-1] + 1):
            path = segment_path(self.base, k)
            if k not in numbers:
                have = ", ".join(segment_path(self.base, n) for n in numbers[:3]) + (" ..." if len(numbers) > 3 else "")
                what = f"segment {k} of the rotated journal {self.base} is missing (there are {have}): events lost"
                raise JournalError(path, 0, what)
            if k == given.number:
                segments.append(given)
                continue
            other = read_header(path)
            number = _meta_int(path, other, SEGMENT_KEY)
            if number != k:
                what = "no segment number" if number is None else f"segment number {number}"
                what = f"its header says {what}, not {k}: not a segment of {self.base}"
                raise JournalError(path, PREAMBLE_SIZE, what)
            if not _same_run(other, header):
                what = f"its geometry or policy differ from {given.path}'s: a segment of another run"
                raise JournalError(path, PREAMBLE_SIZE, what)
            segments.append(Segment(k, path, _meta_int(path, other, FIRST_EVENT_KEY) or 0))
        for a, b in itertools.pairwise(segments):
            if b.first_event < a.first_event:
                what = f"segment {b.number} starts at event {b.first_event}, before segment {a.number} does"
                raise JournalError(b.path, PREAMBLE_SIZE, what)
        return segments

    def batches(self, start: int | None = None) -> Iterator[tuple[int, int, list[Event]]]:
        """``(global index of the first event, bytes before this frame in all segments, events)``
        per frame, for the events with global index >= ``start`` (None: all the journal holds;
        below its first event: an error, since the events before it are nowhere). Iterate once.

        NOTE: ``start`` (a snapshot's index) skips the segments that end before it unread."""
        if start is None:
            start = self.first_event
        if start < self.first_event:
            what = (
                f"the journal starts at event {self.first_event} (its writer started from a snapshot): the events "
                f"before it are in no segment, so it can only be replayed from a snapshot taken at or after it"
            )
            raise JournalError(self.segments[0].path, PREAMBLE_SIZE, what)
        at = self.first_event
        done = 0  # bytes of the segments before this one
        end = self.segments[0].path, 0
        for i, seg in enumerate(self.segments):
            size = _size(seg.path)
            nxt = self.segments[i + 1] if i + 1 < len(self.segments) else None
            if nxt is not None and nxt.first_event <= start:
                at = self.events_read = nxt.first_event  # nothing in this one is wanted: unread
                done += size
                continue
            if self.torn_tail is not None:
                what = f"segment {seg.number} follows {self.torn_segment}, which ends in a torn frame (damage)"
                raise JournalError(seg.path, PREAMBLE_SIZE, what)
            if seg.first_event != at:
                what = f"segment {seg.number} starts at event {seg.first_event}, but the one before ends at event {at}"
                raise JournalError(seg.path, PREAMBLE_SIZE, what)
            reader = JournalReader(seg.path)
            count = 0
            try:
                for _, offset, batch in reader.batches():
                    first = at
                    at += len(batch)
                    count += len(batch)
                    self.events_read = at
                    if at > start:
                        yield first, done + offset, batch[start - first :] if first < start else batch
            finally:
                reader.close()
            self.read.append((seg, count))
            if reader.torn_tail is not None:
                self.torn_tail, self.torn_segment = reader.torn_tail, seg.path
            end = seg.path, reader.offset
            done += size
        if start > at:
            raise JournalError(end[0], end[1], f"the journal ends at event {at}; reading was to start at event {start}")

    def events(self, start: int | None = None) -> Iterator[Event]:
        """The events with global index >= ``start`` (None: all of them), across all segments."""
        for _, _, batch in self.batches(start):
            yield from batch


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


# --- snapshots --------------------------------------------------------------------------------


def read_snapshot(path: str | os.PathLike[str]) -> LedgerSnapshot:
    """The snapshot at ``path``; a ``JournalError`` naming it if it is unreadable, not one, or
    not one that ``Ledger.restore`` and a replay after it can use (``snapshot_problem``).

    NOTE: snapshots are msgpack ``LedgerSnapshot`` values; they are read from regular files only,
    bounded by the file's size."""
    name = os.fspath(path)
    try:
        data = read_regular(name)
    except NotRegularFileError as exc:
        raise JournalError(name, 0, f"cannot read the snapshot: {exc.strerror}") from None
    except OSError as exc:
        raise JournalError(name, 0, f"cannot read the snapshot: {exc.strerror or exc}") from None
    try:
        snap = msgspec.msgpack.decode(data, type=LedgerSnapshot)
    except msgspec.DecodeError as exc:
        raise JournalError(name, 0, f"not a ledger snapshot: {' '.join(str(exc).split())}") from None
    except RecursionError:
        raise JournalError(name, 0, "not a ledger snapshot: nested too deep to decode") from None
    except ConfigError as exc:  # its header's geometry is beyond the ledger's bounds
        raise JournalError(name, 0, f"not a ledger snapshot: header: {exc}") from None
    if (why := snapshot_problem(snap)) is not None:
        raise JournalError(name, 0, f"not a consistent ledger snapshot: {why}")
    return snap


def _int64s(values: Sequence[int]) -> bool:
    """All of ``values`` fit the ledger's int64 arrays and are not negative (min and max: C-speed)."""
    return not values or (min(values) >= 0 and max(values) <= INT64_MAX)


def snapshot_problem(snap: LedgerSnapshot) -> str | None:
    """What in a decoded snapshot ``Ledger.restore``, or a replay after it, would trip on; None if
    nothing. Restore trusts its input's sizes and cross-references, so a snapshot of the wrong
    shape failed later, mid-replay, as an IndexError (a violation index past the list), an
    OverflowError (an index beyond the int64 arrays) or, for a negative page, not at all (a wrong
    page silently). Checked here, where every reader of a snapshot gets it: kvreplay and the
    journal service's resume. Linear in the snapshot, C-speed for its large tables."""
    h = snap.header
    if (why := misfit(h)) is not None:
        return f"header: {why}"
    pages = sum(-(-p.num_blocks // (h.page_bytes // p.block_bytes)) for p in h.pools)
    if not _int64s((snap.index, snap.build, snap.liveness_builds)):
        return "its event index, build or liveness_builds is not an int in 0..2^63-1"
    if any(v is not None and v < 0 for v in (snap.limit, snap.stall_since, snap.over_limit_since)):
        return "a negative limit, or a negative build for a shrink's start"
    if len(snap.boundary_ix) != len(snap.boundary_build) or not (
        _int64s(snap.boundary_ix) and _int64s(snap.boundary_build)
    ):
        return "its build boundaries are not two int lists of one length with values in 0..2^63-1"
    # A mapped or allocated flag is a byte 0 or 1: translate deletes those and leaves any other.
    tables = (snap.page_alloc, snap.mapped, snap.epoch, snap.unmap_ix, snap.pfree_ix)
    if any(len(t) != pages for t in tables) or snap.mapped.translate(None, b"\0\1"):
        return f"its page tables do not have the header's {pages} pages"
    if len(snap.pools) != len(h.pools):
        return f"it has {len(snap.pools)} pool tables for the header's {len(h.pools)} pools"
    for i, (pool, geo) in enumerate(zip(snap.pools, h.pools, strict=True)):
        nb = geo.num_blocks
        sizes = {len(pool.alloc), len(pool.epoch), len(pool.alloc_ix), len(pool.free_ix)}
        if sizes != {nb} or pool.alloc.translate(None, b"\0\1"):
            return f"the block tables of pool {i} do not have its {nb} blocks"
    for what, used in (
        ("grace", snap.grace),
        ("window hold", snap.holds),
        ("job", (p for r in snap.jobs for p in r.pages)),
    ):
        if not all(0 <= p < pages for p in used):
            return f"a {what} on a page outside the header's {pages} pages"
    if any(r.kind not in (0, 1) for r in snap.jobs):
        return "a job of an unknown kind"
    n = len(snap.violations)
    if not all(0 <= i < n for ixs in snap.job_violation.values() for i in ixs):
        return f"a job's violation index outside its {n} violations"
    # The ledger keeps a finished request only while one of its jobs is outstanding (I4 names it).
    orphans = set(snap.finished).difference(r.req for r in snap.jobs)
    if orphans:
        return f"finished request {min(orphans)} with no job (a finished request is kept only while it has one)"
    return None


def write_snapshot(path: str, snap: LedgerSnapshot, *, sync: bool = False, replacing: FileId | None = None) -> FileId:
    """Writes ``snap`` to ``path``: under a fresh name, then installed (see ``files.install``:
    ``replacing`` None means ``path`` must not exist). Returns the new file's id, to pass as
    ``replacing`` next time. ``sync``: on the disk, rename included, before it returns.
    Raises ``OSError``; nothing is left behind but the file installed.

    NOTE: it never replaces a file the writer did not make (:mod:`kvcached.ledger.files`)."""
    return write_whole(path, msgspec.msgpack.encode(snap), sync=sync, replacing=replacing)


def resume(path: str | os.PathLike[str]) -> tuple[Ledger, Iterator[Event], RotatedJournal]:
    """A ledger restored from the journal's snapshot ``P.snap`` (or fresh) and the events after it."""
    journal = RotatedJournal(path)
    snap = snapshot_path(journal.base)
    if os.path.exists(snap):
        sf = read_snapshot(snap)
        if sf.index >= journal.first_event:
            return Ledger.restore(sf), journal.events(sf.index), journal
    if journal.first_event:
        what = f"the journal starts at event {journal.first_event} and no snapshot covers the events before it"
        raise JournalError(journal.segments[0].path, PREAMBLE_SIZE, what)
    return Ledger(journal.header), journal.events(), journal
