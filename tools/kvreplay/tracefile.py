"""Opening traces and snapshots, and the replay loop that every kvreplay subcommand shares.

Every subcommand reads a journal the same way, so the rules for bad input live here once
(``Trace``). The journal reader and the snapshot reader and writer are the ledger core's
(``kvcached.ledger.segments``), the ones the service uses, so kvreplay reads exactly what the
service writes, a rotated journal included.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Final

import kvcli

from kvcached.errors import TraceError
from kvcached.ledger import files, segments
from kvcached.ledger.events import Event, Header, Policy
from kvcached.ledger.journal import TornTail
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.segments import RotatedJournal, names, read_snapshot, snapshot_path
from kvcached.ledger.simulate import derive
from kvcached.ledger.state import LedgerSnapshot

# Below this size a trace replays faster than a progress bar can be drawn.
PROGRESS_MIN_BYTES: Final = 1 << 20


class ReplayError(TraceError):
    """A problem kvreplay itself found in its input (a snapshot, an option for this trace)."""


def json_name(path: str) -> str:
    # Reports meant for machines (and golden files) must not depend on where the trace lies.
    return os.path.basename(path)


def header_json(header: Header) -> dict[str, object]:
    """The parts of a header that decide a replay's outcome; producer versions and the creation
    time are left out so that a report stays the same when only those change."""
    return {
        "page_bytes": header.page_bytes,
        "pools": [{"block_bytes": p.block_bytes, "num_blocks": p.num_blocks} for p in header.pools],
        "workers": header.workers,
        "policy": header.policy.value,
    }


def warn(message: str) -> None:
    print(f"kvreplay: warning: {message}", file=sys.stderr)


def torn_message(path: str, torn: TornTail, events: int) -> str:
    return (
        f"{path}: torn tail at byte {torn.offset}: the last frame is cut off ({torn.bytes_present} of "
        f"{torn.frame_bytes_expected} bytes present), as an interrupted write leaves it; "
        f"using the {kvcli.plural(events, 'event')} before it"
    )


class Trace:
    """An open trace: its header, checked for sanity, and its events as a stream of batches.

    A journal the service rotated (``P``, ``P.1``, ...) is one trace, read in order from ``P``
    whichever of its segments is named (``kvcached.ledger.segments.RotatedJournal``);
    :meth:`segments_note` says which files exist and which were read.

    NOTE: the rules for bad input: the journal reader's errors (which already name file and byte
    offset) pass through untouched, and a torn last frame becomes one warning line on stderr and
    the events before it are used (``batches``). A snapshot or header that cannot be trusted
    becomes one line naming the file (``start_ledger``).
    """

    def __init__(self, path: str, *, progress: bool = True, note: bool = True) -> None:
        self.path = path
        self.journal = RotatedJournal(path)
        # The header's geometry is bounded (events.MAX_BLOCKS) and laid out (events.misfit) by
        # the journal reader, which names the file: a Ledger can be made for it.
        self.header = self.journal.header
        self.events = 0  # global index after the last event read, skipped ones included
        self.torn_tail: TornTail | None = None
        self._progress = progress and sys.stderr.isatty()
        self._note = note

    @property
    def first_event(self) -> int:
        return self.journal.first_event

    def policy(self, override: str | None) -> Policy:
        return Policy(override) if override else self.header.policy

    def batches(
        self, skip: int = 0, label: str = "replaying", *, require_events: bool = False
    ) -> Iterator[list[Event]]:
        """The trace's events after the first ``skip`` (a global index), a frame at a time.

        Warns about a torn tail once the stream ends; a damaged frame raises ``JournalError``.
        ``require_events``: a journal that holds no complete event (only its header, or a first
        frame cut off) raises ``ReplayError`` saying nothing was checked, instead of the warning.

        NOTE: the loop streams the trace frame by frame, so memory is bounded by one frame plus the
        ledger, whatever the length of the trace. A progress bar is drawn only when stderr is a
        terminal, and only once per frame, so that it costs nothing per event.
        """
        j = self.journal
        size = j.size
        with _progress_bar(self.path, label, size, self._progress and size >= PROGRESS_MIN_BYTES) as advance:
            for first, position, events in j.batches(skip):
                self.events = first + len(events)
                advance(position)
                yield events
        self.events = j.events_read
        if require_events and self.events == self.first_event:
            raise ReplayError(_no_event(j))
        if self._note and (note := self.segments_note()) is not None:
            print(f"kvreplay: note: {self.path}: {note}", file=sys.stderr)
        self.torn_tail = j.torn_tail
        if self.torn_tail is not None:
            warn(torn_message(j.torn_segment or self.path, self.torn_tail, self.events))

    def segments_note(self) -> str | None:
        """Which segments the trace has and which were read; None for a trace of one file read whole."""
        j = self.journal
        if len(j.segments) == 1 and not j.given and not j.pruned_below:
            return None
        seg = j.segments
        if j.standalone:
            head = f"segment {j.given} of a rotated journal whose other segments are not named after it; read alone"
        else:
            whole = f"segment {j.given} of the rotated journal {j.base}, which has" if j.given else "a journal of"
            head = f"{whole} {kvcli.plural(len(seg), 'segment')} ({names(seg)})"
            if j.pruned_below:  # the head is gone by design, not lost: the segments say so
                head += f", segments 0 to {j.pruned_below - 1} deleted by its writer's size bound"
        read = [s for s, _ in j.read]
        if read == seg:
            return f"{head}; read all" if len(seg) > 1 else head
        if not read:
            return f"{head}; read none"
        unread = [s for s in seg if s not in read]
        return f"{head}; read {names(read)}; unread, as they hold only events before the snapshot: {names(unread)}"

    def segments_json(self) -> list[dict[str, object]] | None:
        """The segments for a JSON report (file names without directories); None as for the note."""
        if self.segments_note() is None:
            return None
        counts = {s.number: n for s, n in self.journal.read}
        return [
            {
                "file": json_name(s.path),
                "segment": s.number,
                "first_event": s.first_event,
                "events": counts.get(s.number),  # None: not read (before the snapshot)
            }
            for s in self.journal.segments
        ]

    def close(self) -> None:
        pass

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _no_event(j: RotatedJournal) -> str:
    files = f"its {len(j.segments)} files hold" if len(j.segments) > 1 else "it holds"
    if j.torn_tail is None:
        return f"{j.path}: no event to check: {files} a header and no event; nothing was checked"
    t = j.torn_tail
    return (
        f"{j.torn_segment or j.path}: no event to check: its first frame is cut off at byte {t.offset} "
        f"({t.bytes_present} of {t.frame_bytes_expected} bytes present), as an interrupted write leaves it; "
        "nothing was checked"
    )


@contextlib.contextmanager
def _progress_bar(path: str, label: str, size: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda offset: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn(f"{label} {os.path.basename(path)}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bar.add_task(label, total=size)
    last = [0.0]

    def advance(offset: int) -> None:
        # Frames can be small (one per build); redrawing at most 10 times a second keeps the
        # bar off the profile.
        now = time.monotonic()
        if now - last[0] >= 0.1:
            last[0] = now
            bar.update(task, completed=offset)

    with bar:
        yield advance


# --- the ledger a replay starts from --------------------------------------------------------


def load_snapshot(path: str) -> LedgerSnapshot:
    """The snapshot at ``path`` (the service's ``P.snap`` or one ``kvreplay snapshot`` wrote)."""
    return read_snapshot(path)


def start_ledger(trace: Trace, policy: str | None, snapshot: str | None) -> tuple[Ledger, int]:
    """A ledger for ``trace`` and how many of its events are already in it (from a snapshot)."""
    if snapshot is None and trace.first_event:
        # A journal that starts mid-run (a service started from a snapshot, a flight-recorder
        # dump) carries its start as P.snap: use it, as the service's own resume does.
        snap_name = snapshot_path(trace.journal.base)
        if os.path.exists(snap_name) and read_snapshot(snap_name).index >= trace.first_event:
            snapshot = snap_name
    if snapshot is None:
        if trace.first_event:
            snap_name = snapshot_path(trace.journal.base)
            hint = snap_name if os.path.exists(snap_name) else "SNAP (one taken at or after that event)"
            raise ReplayError(
                f"{trace.path}: the journal starts at event {trace.first_event:,} (its service started from a "
                f"snapshot); replay it with --from-snapshot {hint}"
            )
        return Ledger(trace.header, trace.policy(policy)), 0
    snap = load_snapshot(snapshot)
    if snap.index < trace.first_event:
        raise ReplayError(
            f"{snapshot}: taken after event {snap.index:,}, before the journal {trace.path} starts "
            f"(event {trace.first_event:,})"
        )
    h, s = trace.header, snap.header
    if (h.page_bytes, h.pools, h.workers) != (s.page_bytes, s.pools, s.workers):
        raise ReplayError(f"{snapshot}: taken from a trace of another geometry than {trace.path}")
    if policy is not None and Policy(policy) is not snap.policy:
        raise ReplayError(f"{snapshot}: taken under policy {snap.policy.value}, not {policy}; replay from the start")
    # read_snapshot checked the snapshot's shape and cross-references (segments.snapshot_problem).
    return Ledger.restore(snap), snap.index


def feed(ledger: Ledger, batch: list[Event], derived: bool) -> None:
    """Applies one batch: as recorded, or with the decisions re-derived under the ledger's policy."""
    if derived:
        deque(derive(ledger, batch), maxlen=0)
    else:
        ledger.apply_all(batch)


def write_snapshot(ledger: Ledger, path: str) -> None:
    """Writes the ledger's snapshot to ``path``, which the user named: a regular file there is
    replaced (as ``-o`` does everywhere), anything else (a symlink, a device) is refused."""
    st = files.lstat(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ReplayError(f"{path}: {files.kind(st.st_mode)}, not a regular file: not writing the snapshot there")
    try:
        segments.write_snapshot(path, ledger.snapshot(), replacing=None if st is None else files.FileId.of(st))
    except OSError as exc:
        raise ReplayError(f"{path}: cannot write the snapshot: {exc.strerror or exc}") from None
