"""The ledger service: journal, snapshots and live view, kept off vLLM's scheduler thread.

The scheduler applies each event to its ledger, then :meth:`Producer.put` appends the immutable
event to a ``deque``: no lock, no syscall, no encoding. Everything slow runs on the service's
anyio loop (:class:`LedgerService`), which keeps its own replica of the ledger. For a journal at
``P`` it writes segments ``P``, ``P.1``, ``P.2`` ... and the snapshot ``P.snap``
(docs/trace-format.md). Naming, the segment header and the snapshot writer come from
``kvcached.ledger.segments``, whose ``RotatedJournal`` and ``resume`` read all of it back, for
kvreplay as for anyone else: one reader and one writer of these files.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import BinaryIO, Final, Literal

import anyio
import msgspec

from kvcached.errors import JournalWriteError, KvcachedError
from kvcached.ledger.events import Event, Gap, Header
from kvcached.ledger.files import FileId, create_temp, discard, fsync_dir, install
from kvcached.ledger.findings import plural
from kvcached.ledger.journal import JournalWriter, encode_batch
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.segments import segment_header, segment_path, snapshot_path, write_snapshot
from kvcached.ledger.state import LedgerSnapshot
from kvcached.service import journal_files
from kvcached.service.config import Durability as Durability  # re-exported: where callers have it from
from kvcached.service.config import ServiceConfig as ServiceConfig
from kvcached.service.flight import FlightRecorder, default_dump_dir, dump_name, make_dump_dir, write_dump_files
from kvcached.service.live import LiveServer
from kvcached.service.messages import DumpReply, EngineControl, FlightStatus, HandoffStatus, JournalStatus
from kvcached.service.retention import MAX_BYTES_VAR, DumpRetention, JournalBound, Written, check_bound

log = logging.getLogger("kvcached.service.ledger_service")

_IDLE_MAX: Final = 0.1  # longest idle sleep: how stale the live view and the journal get at a trickle
# How often the engine's control looks at its shared budget (``EngineControl.tick``): a joining
# engine's claim is seen within this, by an idle engine too (one locked read of a small file).
TICK_S: Final = 0.25


# --- the hand-off ---------------------------------------------------------------------------


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Producer:
    """The hot path's side of the hand-off: :meth:`put` never blocks or locks, and makes one
    syscall per batch at most (a pipe write that wakes a sleeping writer), never per event.

    Exact for one producer thread (vLLM's scheduler). Several threads may put safely, but
    the bound may be exceeded by one event per thread and drop counts may be approximate.

    NOTE: a full deque makes the producer drop and count, and one ``Gap`` marks the spot.
    """

    __slots__ = (
        "__weakref__",
        "_cap",
        "_dropped",
        "_gapped",
        "_q",
        "_rfd",
        "_sleeping",
        "_wake_at",
        "_wfd",
        "episodes",
        "gaps",
    )

    def __init__(self, capacity: int, wake_at: int) -> None:
        self._q: collections.deque[Event] = collections.deque()
        self._cap = capacity
        self._wake_at = wake_at
        self._dropped = 0  # drops since the last event that got in: the open gap
        self._gapped = 0  # drops already turned into Gap events
        self._sleeping = False  # set by the writer while it waits on the pipe
        self.episodes = 0  # overflow episodes (a run of drops) so far
        self.gaps = 0  # Gap events put in the stream
        self._rfd, self._wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        # The pipe lives as long as the producer: closed earlier, a reused descriptor number
        # could receive a wake byte from a scheduler still putting.
        weakref.finalize(self, _close_fds, self._rfd, self._wfd)

    def put(self, event: Event) -> None:
        q = self._q
        n = len(q)
        if n < self._cap:
            if self._dropped:
                self._close_gap()
            q.append(event)
            # Only past the mark, and _wake clears the flag: one wake-up per batch, not per event.
            if n >= self._wake_at and self._sleeping:
                self._wake()
        else:
            if not self._dropped:
                self.episodes += 1
            self._dropped += 1

    def _close_gap(self) -> None:
        n = self._dropped
        self._dropped = 0
        self._gapped += n
        self.gaps += 1
        # Past the bound by one: the gap must sit right before the event that ended it.
        self._q.append(Gap(n))

    def _wake(self) -> None:
        self._sleeping = False
        try:  # noqa: SIM105 - on the producer's thread, where suppress() would cost an object
            os.write(self._wfd, b"\0")
        except OSError:  # full pipe: a wake-up is already pending
            pass

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def queued(self) -> int:
        return len(self._q)

    @property
    def dropped(self) -> int:
        """Events dropped so far (those of a gap still open included)."""
        return self._gapped + self._dropped


# --- the service ----------------------------------------------------------------------------


class LedgerService:
    """Drains a :class:`Producer` into a rotating journal, snapshots and a ledger replica.

    NOTE: it runs on an anyio loop (a daemon thread, :class:`BackgroundService`, or any loop
    awaiting :meth:`run`). It drains the deque in batches, applies them to its *own replica* of
    the ledger, and encodes each batch once (journal and ``kvctl tail``). It writes each batch as
    one frame from a worker thread, so a slow disk never stalls the loop that answers ``kvctl``.
    A sleeping writer is woken by one pipe write per batch, else by a short timer (``_sleep``).

    NOTE: the replica costs one more ``apply`` per event (GIL time the engine pays). In exchange
    the hot path never copies or locks the live ledger, and snapshots and pins read a ledger
    consistent with the journal, gaps included.
    """

    def __init__(self, header: Header, config: ServiceConfig | None = None, *, start: LedgerSnapshot | None = None):
        self.header = header
        self.config = cfg = config or ServiceConfig()
        self.producer = Producer(cfg.capacity, max(1, min(cfg.batch_events, cfg.capacity) // 4))
        self.replica: Ledger | None = None
        if cfg.replica:
            self.replica = Ledger.restore(start) if start is not None else Ledger(header)
        self._start = start
        self.index = start.index if start is not None else 0  # global index of the next event
        # listener(first index, payload) for every batch, on the loop: the live view's tail.
        self.listeners: list[Callable[[int, bytes], None]] = []
        self._writer: JournalWriter | None = None
        self._state: Literal["off", "starting", "writing", "stopped", "closed"] = "starting" if cfg.journal else "off"
        self._error: str | None = None
        self._segment = 0
        self._written = self._durable = self._reported = self.index  # global indices, as self.index
        self._dirty = False
        self._next_fsync = 0.0
        self._snap_index: int | None = None
        self._snap_id: FileId | None = None  # the snapshot file this service installed last
        self._overflowing = False  # from the first drop until the writer has caught up
        self._episodes_seen = self._dropped_seen = 0
        self._stopping = self._started = False
        self.started_unix = time.time()
        self.control: EngineControl | None = None  # set by the engine that owns this service
        self.flight = FlightRecorder(header, cfg.flight_events, start) if cfg.flight_events else None
        self.dumps: list[str] = []  # flight-recorder files written by this service
        self._violations_seen = 0
        self._dumped_invariants: set[str] = set()
        self._dump_requests: collections.deque[tuple[str, threading.Event, list[str]]] = collections.deque()
        self._kept_dumps = DumpRetention(cfg.max_dumps)
        self._bound = JournalBound(cfg.max_bytes, cfg.rotate_bytes)
        if cfg.journal and cfg.max_bytes and self.replica is not None:
            check_bound(cfg.max_bytes, cfg.rotate_bytes, len(msgspec.msgpack.encode(self.replica.snapshot())))

    # --- control, from any thread -------------------------------------------------------------

    def stop(self) -> None:
        """Ask :meth:`run` to drain, close the journal and return (thread-safe, idempotent)."""
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self.producer._wfd, b"\0")

    def journal_status(self) -> JournalStatus:
        w = self._writer  # read once: a rotation in the worker thread may swap it meanwhile
        size = w.bytes_written if w is not None else 0
        return JournalStatus(
            state=self._state,
            path=self.config.journal,
            durability=self.config.durability.value,
            segment=self._segment,
            segment_bytes=size,
            events_written=self._written,
            events_durable=self._durable,
            snapshot_index=self._snap_index,
            error=self._error,
            max_bytes=self.config.max_bytes,
            kept_bytes=self._bound.kept_bytes(size if w is not None else None),
            first_segment=self._bound.pruned_below,
            pruned_segments=self._bound.pruned_segments,
            pruned_bytes=self._bound.pruned_bytes,
        )

    def handoff_status(self) -> HandoffStatus:
        p = self.producer
        return HandoffStatus(capacity=p.capacity, queued=p.queued, dropped=p.dropped, gaps=p.gaps, episodes=p.episodes)

    def request_dump(self, reason: str, *, wait: float = 10.0) -> str | None:
        """From any thread (the scheduler's, after an error): save the flight recorder once the
        events already handed off are in it; waits up to ``wait`` s for the file's name."""
        if self.flight is None or self._stopping:
            return None
        done, out = threading.Event(), list[str]()
        self._dump_requests.append((reason, done, out))
        with contextlib.suppress(OSError):
            os.write(self.producer._wfd, b"\0")
        done.wait(wait)
        return out[0] if out else None

    def flight_status(self) -> FlightStatus | None:
        f = self.flight
        if f is None:
            return None
        return FlightStatus(capacity=f.capacity, first_event=f.first_event, events=f.events, dumps=list(self.dumps))

    def dump(self, reason: str) -> DumpReply | None:
        """The flight recorder's events as a trace, in memory (on the loop: ``kvctl dump``)."""
        if self.flight is None:
            return None
        return self.flight.dump(reason)

    # --- the loop -----------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`stop`; ``task_status.started()`` once the journal and socket exist."""
        if self._started:
            raise RuntimeError("a LedgerService runs once")
        self._started = True
        if self.config.journal:
            await self._disk(self._open_first)
        try:
            async with anyio.create_task_group() as tg:
                if self.config.socket:
                    await tg.start(LiveServer(self, self.config.socket, client_queue=self.config.live_queue).serve)
                tg.start_soon(self._tick_forever)
                task_status.started()
                await self._drain_forever()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._disk(self._close_journal)
                while self._dump_requests:  # asked as the service stopped: nobody waits forever
                    self._dump_requests.popleft()[1].set()

    async def _tick_forever(self) -> None:
        """Let the engine's control look at its budget every ``TICK_S`` (in a worker thread: it
        takes the engine's lock); a failing tick is logged once and retried."""
        failing = False
        while True:
            await anyio.sleep(TICK_S)
            control = self.control
            if control is None:
                continue
            try:
                await anyio.to_thread.run_sync(control.tick)
                failing = False
            except Exception as exc:  # the journal and kvctl's socket go on without it
                if not failing:
                    log.warning("kvcached: the engine's budget tick failed (retried every %g s): %r", TICK_S, exc)
                failing = True

    async def _drain_forever(self) -> None:
        p, cfg = self.producer, self.config
        q, limit = p._q, cfg.batch_events
        idle = cfg.flush_interval
        while True:
            if p.episodes != self._episodes_seen:
                self._episodes_seen = p.episodes
                if not self._overflowing:
                    self._overflowing = True
                    log.warning(
                        "kvcached: the ledger hand-off is full (%d events): dropping events until the service "
                        "catches up; the drops are journaled as gaps",
                        p.capacity,
                    )
            if q:
                pop = q.popleft
                await self._process([pop() for _ in range(min(len(q), limit))])
                idle = cfg.flush_interval
                continue
            while self._dump_requests:  # the hand-off is empty: every event before the request is in
                reason, done, out = self._dump_requests.popleft()
                path = await self._save_flight(reason, "error")
                if path is not None:
                    out.append(path)
                done.set()
            if self._overflowing and not p._dropped:
                # One warning per overload, not per refill: a slow disk frees and refills the hand-off
                # once per batch, which would otherwise log at the batch rate.
                self._overflowing = False
                lost, self._dropped_seen = p.dropped - self._dropped_seen, p.dropped
                log.warning("kvcached: the ledger service caught up; %d events were dropped", lost)
            if self._stopping:
                break
            if self._dirty and time.monotonic() >= self._next_fsync:
                await self._disk(self._fsync)
            await self._sleep(idle)
            idle = min(idle * 2, max(_IDLE_MAX, cfg.flush_interval))
        # Shutdown: close the hand-off, let a put preempted mid-call finish (the GIL hands over
        # within a switch interval), then write what is left and the last gap.
        p._cap = 0
        await anyio.sleep(2 * sys.getswitchinterval())
        while q:
            pop = q.popleft
            await self._process([pop() for _ in range(min(len(q), limit))])
        if p._dropped:
            await self._process([Gap(p._dropped)])

    async def _sleep(self, timeout: float) -> None:
        p = self.producer
        p._sleeping = True
        # Armed first, checked second (see Producer.put): either we see the events or it wakes us.
        if len(p._q) <= p._wake_at and not self._stopping:
            if self._dirty:
                timeout = max(0.0, min(timeout, self._next_fsync - time.monotonic()))
            with anyio.move_on_after(timeout):
                await anyio.wait_readable(p._rfd)
        p._sleeping = False
        with contextlib.suppress(BlockingIOError):
            os.read(p._rfd, 4096)

    async def _process(self, batch: list[Event]) -> None:
        replica = self.replica
        if replica is not None:
            try:
                for ev in batch:
                    replica.apply(ev)
            except Exception:
                log.exception("kvcached: the ledger service's replica failed; pins and snapshots are off")
                self.replica = None
        payload = encode_batch(batch)
        first = self.index
        self.index = first + len(batch)
        flight = self.flight
        if flight is not None:
            flight.add(first, len(batch), payload, None if self.replica is None else self.replica.snapshot)
        if self.replica is not None and len(self.replica.violations) > self._violations_seen:
            await self._on_violations()
        for listener in self.listeners:
            listener(first, payload)
        if self._writer is not None:
            await self._disk(self._append, payload, len(batch))
        if self._writer is not None and 0 < self.config.rotate_bytes <= self._writer.bytes_written:
            await self._rotate()
        every = self.config.snapshot_every
        due = every and self.index - (self._snap_index or 0) >= every
        if due and self._writer is not None and self.replica is not None:
            await self._disk(self._write_snapshot, self.replica.snapshot())

    async def _rotate(self) -> None:
        """Closes the segment and opens the next; under a size bound, first decides which segments
        go (retention.py) and takes the snapshot that lets them go, on the loop that owns the replica."""
        assert self._writer is not None
        cut, snapshot = self._bound.plan(self._snap_index, self.index, self._writer.bytes_written)
        snap = None
        if snapshot:
            if self.replica is None:
                what = f"the journal reached {MAX_BYTES_VAR}={self.config.max_bytes} and, without the replica, "
                self._stop_journal(JournalWriteError(what + "no snapshot can be taken to delete its oldest segments"))
                return
            snap = self.replica.snapshot()
        await self._disk(self._next_segment, cut, snap)

    async def _on_violations(self) -> None:
        """The first violation of each invariant saves the flight recorder, with one log line
        naming the file and the command that replays it."""
        replica = self.replica
        assert replica is not None
        new = replica.violations[self._violations_seen :]
        self._violations_seen = len(replica.violations)
        for v in new:
            if v.invariant in self._dumped_invariants:
                continue
            self._dumped_invariants.add(v.invariant)
            if replica.lossy:  # a gap: the replica missed events, so this may be an artifact of it
                log.info(
                    "kvcached: invariant %s violated after %d dropped events (may come from the gap): %s",
                    v.invariant,
                    replica.dropped_events,
                    v.one_line(),
                )
            else:
                log.error("kvcached: invariant %s violated: %s", v.invariant, v.one_line())
            if self.flight is not None:
                await self._save_flight(f"{v.invariant} at event {v.index}", v.invariant)

    async def _save_flight(self, reason: str, tag: str | None) -> str | None:
        flight = self.flight
        assert flight is not None
        dump = flight.dump(reason)  # on the loop: the ring must not turn while it is read
        folder = self.config.dump_dir or default_dump_dir()
        path = dump_name(folder, os.getpid(), tag or reason)

        def write() -> tuple[list[str], list[str], list[str]]:
            make_dump_dir(folder)
            files = write_dump_files(dump, path)
            return [f for f, _ in files], *self._kept_dumps.add(files)

        try:
            written, gone, left = await anyio.to_thread.run_sync(write)
        except OSError as exc:
            log.error("kvcached: the flight recorder could not be saved to %s: %s", path, exc.strerror or exc)
            return None
        self.dumps = [d for d in self.dumps if d not in gone] + [path]
        if left:
            log.warning(
                "kvcached: older flight-recorder dumps not deleted, as they are no longer the files it wrote: %s",
                ", ".join(left),
            )
        log.error(
            "kvcached: flight recorder (%s): the last %d events saved to %s; replay with: kvreplay check %s",
            reason,
            dump.events,
            written[-1],
            path,
        )
        return path

    async def _disk(self, fn: Callable[..., None], *args: object) -> None:
        """Runs ``fn`` in a worker thread; a disk error stops journaling, never the service."""
        try:
            await anyio.to_thread.run_sync(fn, *args)
        except (OSError, KvcachedError) as exc:
            self._stop_journal(exc)
        durable = self._durable
        if self._reported != durable and self.config.on_durable is not None:
            self._reported = durable
            self.config.on_durable(durable)

    def _stop_journal(self, exc: BaseException) -> None:
        """NOTE: a failing disk stops journaling with one log line while replica, live view and
        engine go on."""
        msg = " ".join(str(exc).split()) or type(exc).__name__
        log.error("kvcached: journaling stopped, serving goes on: %s", msg)
        self._error, self._state = msg, "stopped"
        w, self._writer = self._writer, None
        with contextlib.suppress(OSError, KvcachedError):
            if w is not None:  # leave a journal that reads cleanly up to its last whole frame
                w.truncate_to_last_frame()
                w.close()
                self._bound.closed(w.bytes_written)

    # --- disk work, in a worker thread (the loop awaits it, so state needs no lock) ------------

    def _open_first(self) -> None:
        """NOTE: at start the previous run's files are kept as ``P.run<N>...`` and nothing the
        service did not write is touched (``journal_files``)."""
        base = self.config.journal
        assert base is not None
        # Nothing beside the journal is replaced or deleted unless this service wrote it; the
        # previous run's files are kept under P.run<N> (journal_files explains the rules).
        kept, pruned = journal_files.claim(base, self.config.keep_runs)
        if kept is not None:
            gone = f"; the files of {plural(pruned, 'older run')} were deleted (keep_runs={self.config.keep_runs})"
            log.info("kvcached: the previous run's journal is kept as %s%s", kept, gone if pruned else "")
        self._writer = self._open_segment(0)
        self._state = "writing"
        if self._start is not None:  # a journal that starts mid-run is replayable only from it
            self._write_snapshot(self._start)

    def _open_segment(self, k: int, pruned_below: int = 0) -> JournalWriter:
        """NOTE: each segment is a complete journal (docs/trace-format.md) whose header ``meta``
        adds ``segment`` and ``first_event`` (global index of its first event). It is made
        visible only once the header is written (a fresh temporary file, then linked to its
        name, never over an existing file)."""
        base = self.config.journal
        assert base is not None
        path = segment_path(base, k)
        header = segment_header(self.header, k, self.index, pruned_below)
        # A fresh file under an unpredictable name, given the segment's name only once its
        # header is written, and never over a file that already has that name.
        tmp, file = _open_segment_file(path)
        try:
            journal_files.lock(file)
            writer = JournalWriter(file, path, header)
            if self.config.durability is not Durability.NONE:
                writer.fsync()
            install(tmp, path)
            self._bound.opened(k, self.index, Written.of(path, FileId.of(os.fstat(file.fileno()))))
        except BaseException as exc:
            file.close()
            discard(tmp)
            if isinstance(exc, FileExistsError):
                what = "exists already and this service did not write it: not replacing it"
                raise JournalWriteError(f"{path}: {what}") from None
            raise
        if self.config.durability is not Durability.NONE:
            fsync_dir(path)
        self._segment = k
        self._next_fsync = time.monotonic() + self.config.fsync_interval
        return writer

    def _append(self, payload: bytes, count: int) -> None:
        w = self._writer
        assert w is not None
        w.append_encoded(payload, count)
        self._written += count
        self._dirty = True
        dur = self.config.durability
        if dur is Durability.BATCH or (dur is Durability.INTERVAL and time.monotonic() >= self._next_fsync):
            self._fsync()

    def _next_segment(self, cut: int | None, snap: LedgerSnapshot | None) -> None:
        w = self._writer
        assert w is not None
        if self._dirty:
            self._fsync()  # a segment is complete on disk before the next one appears
        w.close()
        self._writer = None  # a failure below leaves journaling off, not a closed writer
        self._bound.closed(w.bytes_written)
        if snap is not None:  # at the new segment's first event: every closed segment may go
            self._write_snapshot(snap)
        # The note is in the new header before anything is deleted: a crash between the two leaves
        # leftovers the reader skips, never a journal whose start it cannot tell from lost events.
        self._writer = self._open_segment(self._segment + 1, cut or self._bound.pruned_below)
        if cut is not None:
            left = self._bound.prune(cut)
            if left:
                log.warning(
                    "kvcached: journal segments not deleted, as they are no longer the files it wrote "
                    "(no longer counted against %s): %s",
                    MAX_BYTES_VAR,
                    ", ".join(left),
                )

    def _fsync(self) -> None:
        w = self._writer
        if w is None or self.config.durability is Durability.NONE:
            self._dirty = False
            return
        w.fsync()
        self._durable = self._written
        self._dirty = False
        self._next_fsync = time.monotonic() + self.config.fsync_interval

    def _write_snapshot(self, snap: LedgerSnapshot) -> None:
        """NOTE: ``P.snap`` is the latest snapshot, replaced by rename: a msgpack
        ``LedgerSnapshot`` (as ``kvreplay snapshot`` writes) of the ledger after events
        ``[0, index)``, written once those events are in the journal."""
        base = self.config.journal
        assert base is not None
        sync = self.config.durability is not Durability.NONE
        if sync:
            self._fsync()  # the snapshot must never be ahead of the journal on disk
        # The one snapshot writer (kvcached.ledger.segments): a fresh file, then renamed over
        # the snapshot this service wrote before, never over a file it did not write.
        self._snap_id = write_snapshot(snapshot_path(base), snap, sync=sync, replacing=self._snap_id)
        self._snap_index = snap.index
        st = os.stat(snapshot_path(base), follow_symlinks=False)
        self._bound.snapshot_bytes = st.st_size if FileId.of(st) == self._snap_id else 0

    def _close_journal(self) -> None:
        w = self._writer
        if w is not None:
            self._fsync()
            w.close()
            self._writer = None
            self._state = "closed"
            self._bound.closed(w.bytes_written)


def _open_segment_file(near: str) -> tuple[str, BinaryIO]:
    # A new temporary file beside the segment, unbuffered: a frame reaches the kernel in one
    # write (see JournalWriter). Tests replace this to wrap the file.
    return create_temp(near)


class BackgroundService:
    """A :class:`LedgerService` on its own anyio event loop, in a daemon thread of the engine.

    Daemon and closed by ``atexit``: an engine that never calls :meth:`close` neither hangs at
    exit (a non-daemon loop thread would be joined forever) nor skips the final drain.
    """

    def __init__(self, service: LedgerService) -> None:
        self.service, self.producer = service, service.producer
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._main, name="kvcached-ledger", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        atexit.register(self.close)

    @classmethod
    def start(
        cls, header: Header, config: ServiceConfig | None = None, *, start: LedgerSnapshot | None = None
    ) -> BackgroundService:
        """Starts a service; returns once its journal and socket exist (or raises why not)."""
        return cls(LedgerService(header, config, start=start))

    def _main(self) -> None:
        try:
            anyio.run(self._serve)
        except BaseException as exc:  # reported to start(), or logged if it fails later
            while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]
            if self._ready.is_set():
                log.error("kvcached: the ledger service failed: %s", exc, exc_info=exc)
            else:
                self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(self.service.run)
            self._ready.set()

    def close(self, timeout: float | None = 60.0) -> None:
        """Drains the hand-off, closes the journal and the socket, joins the thread."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.service.stop()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("kvcached: the ledger service did not stop within %s s; its journal may lack a tail", timeout)

    def __enter__(self) -> BackgroundService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
