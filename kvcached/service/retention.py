"""Keeping a long-running ledger service within its disk: the journal's size bound and the number
of flight-recorder dumps.

A journal that only grows fills its disk in days on a busy engine, and so can dumps written over
weeks. Bounding the journal cannot mean dropping its oldest events, though: a journal whose head
is gone is replayable only from a snapshot. So at a rotation the service deletes the segments
that its snapshot makes dead weight (``JournalBound``), and it keeps only its newest dumps
(``DumpRetention``). Only files this run wrote are deleted (``remove_written``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import stat
from typing import Final

import msgspec

from kvcached.errors import ConfigError
from kvcached.ledger.files import FileId, kind, lstat
from kvcached.settings import format_size

MAX_BYTES_VAR: Final = "KVCACHED_MAX_JOURNAL_BYTES"
SEGMENT_VAR: Final = "KVCACHED_JOURNAL_SEGMENT_BYTES"


class Written(msgspec.Struct, frozen=True):
    """A file this service made: its name and which file that was (device, inode)."""

    path: str
    dev: int
    ino: int

    @classmethod
    def of(cls, path: str, fid: FileId) -> Written:
        return cls(path, fid.dev, fid.ino)


def remove_written(f: Written) -> str | None:
    """Deletes ``f.path`` if it still is the regular file this service wrote there; None when
    deleted (or already gone), else why it was left, in words.

    NOTE: only files this run wrote are deleted, each checked to be the very file (device and
    inode, recorded when it was made) and a regular file, never a link. A name that holds
    anything else is left and no longer counted."""
    st = lstat(f.path)
    if st is None:
        return None
    if not stat.S_ISREG(st.st_mode):
        return kind(st.st_mode)
    if FileId.of(st) != FileId(f.dev, f.ino) or st.st_uid != os.geteuid():
        return "a file other than the one this service wrote there"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f.path)
    return None


class SegmentFile(msgspec.Struct, frozen=True):
    number: int
    first_event: int
    file: Written
    size: int  # bytes once closed; 0 while it is written


def check_bound(max_bytes: int, segment_bytes: int, snapshot_bytes: int) -> None:
    """Refuses a bound that cannot hold one segment beside the engine's snapshot (whose size
    depends on its geometry, so it is known only once the service has its header)."""
    if max_bytes and segment_bytes + snapshot_bytes > max_bytes:
        raise ConfigError(
            f"{MAX_BYTES_VAR}={format_size(max_bytes)} cannot hold one segment of {SEGMENT_VAR}="
            f"{format_size(segment_bytes)} beside this engine's {format_size(snapshot_bytes)} snapshot; "
            f"set {MAX_BYTES_VAR} to at least {format_size(segment_bytes + snapshot_bytes)} or lower {SEGMENT_VAR}"
        )


class JournalBound:
    """This run's segments, oldest first (the last is the one being written), the snapshot's
    size, and where to cut at a rotation so that the run's files stay within ``max_bytes``
    (0: never cut, only counted).

    NOTE: between rotations the files stay within ``max_bytes`` plus the last frame of the
    segment being written (it rotates once a frame takes it past the segment size). That holds
    as long as a snapshot and one segment fit (checked at start: ``check_bound``)."""

    def __init__(self, max_bytes: int, segment_bytes: int) -> None:
        self.max_bytes, self.segment_bytes = max_bytes, segment_bytes
        self.segments: list[SegmentFile] = []
        self.snapshot_bytes = 0
        self.pruned_below = 0  # the lowest segment number a reader needs (the headers' note)
        self.pruned_segments = self.pruned_bytes = 0
        self.left: list[str] = []  # names of ours that held another file when they were to go

    def opened(self, number: int, first_event: int, file: Written) -> None:
        self.segments.append(SegmentFile(number, first_event, file, 0))

    def closed(self, size: int) -> None:
        if self.segments:
            self.segments[-1] = msgspec.structs.replace(self.segments[-1], size=size)

    def kept_bytes(self, current: int | None) -> int:
        """The run's journal bytes now, the segment being written at ``current`` bytes (None: it
        is closed, at the size it closed with)."""
        if current is None:
            return sum(s.size for s in self.segments) + self.snapshot_bytes
        return sum(s.size for s in self.segments[:-1]) + current + self.snapshot_bytes

    def _from(self, cut: int, current: int) -> int:
        """Bytes kept from segment ``cut`` on, with room for one more whole segment."""
        closed = sum(s.size for s in self.segments[:-1] if s.number >= cut)
        last = current if self.segments and self.segments[-1].number >= cut else 0
        return closed + last + self.snapshot_bytes + self.segment_bytes

    def plan(self, snap_index: int | None, end: int, current: int) -> tuple[int | None, bool]:
        """At a rotation (the segment being written holds ``current`` bytes and ends at event
        ``end``): (the segment number to keep from, None for no cut; whether a snapshot at ``end``
        must be taken first). A cut never passes the segment that holds the snapshot.

        NOTE: the service keeps a snapshot (``P.snap``), so once the first segment goes every
        segment before the snapshot's is dead weight. So at each rotation, when this run's files
        (segments and snapshot) would leave no room for one more segment within ``max_bytes``,
        the segments before the one that holds the snapshot are deleted at once. If that frees
        too little, the service first takes a snapshot at the rotation (the new segment's first
        event), after which every closed segment may go."""
        if not self.max_bytes or not self.segments or self._from(self.segments[0].number, current) <= self.max_bytes:
            return None, False
        after = self.segments[-1].number + 1  # the segment about to be opened, from event ``end``
        if snap_index is not None:
            holding = (s.number for s in self.segments if s.first_event <= snap_index)
            cut = after if snap_index >= end else max(holding, default=self.segments[0].number)
            if cut > self.segments[0].number and self._from(cut, current) <= self.max_bytes:
                return cut, False
        return after, True

    def prune(self, cut: int) -> list[str]:
        """Deletes this run's segments below ``cut`` (oldest first); returns the names left
        because they no longer hold the file this service wrote.

        NOTE: the new segment's header says where the journal now starts
        (``segments.PRUNED_KEY``), written before anything is deleted. So a reader tells a
        pruned head from lost events, and a crash between the two leaves a journal that still
        reads."""
        self.pruned_below = cut
        left: list[str] = []
        while self.segments and self.segments[0].number < cut:
            seg = self.segments.pop(0)
            why = remove_written(seg.file)
            if why is None:
                self.pruned_segments += 1
                self.pruned_bytes += seg.size
            else:
                left.append(f"{seg.file.path} ({why})")
        self.left += left
        return left


class DumpRetention:
    """The flight-recorder dumps this service wrote, oldest first; at most ``keep`` (0: all).

    NOTE: dumps are the journal's rule with a count: the service keeps its newest ``max_dumps``
    and deletes the files of its older ones."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.dumps: collections.deque[list[Written]] = collections.deque()

    def add(self, files: list[tuple[str, FileId]]) -> tuple[list[str], list[str]]:
        """Records one dump's files; deletes the oldest dumps past ``keep``. Returns (the dumps
        deleted, by journal name; names left because they hold another file now)."""
        self.dumps.append([Written.of(path, fid) for path, fid in files])
        gone: list[str] = []
        left: list[str] = []
        while self.keep and len(self.dumps) > self.keep:
            files_of = self.dumps.popleft()
            for f in reversed(files_of):  # the journal first, so that none is left without its snapshot
                why = remove_written(f)
                if why is not None:
                    left.append(f"{f.path} ({why})")
            gone.append(files_of[-1].path)
        return gone, left
