"""The wire types of the live view, and what the live view needs from the service that feeds it.

Every message, in both directions, is a 4-byte big-endian length followed by that many bytes of
msgpack (``frame``). The journal service (``ledger_service``), the live view (``live``) and
``kvctl`` all speak these types; keeping them here, with the ``LiveSource`` protocol that the
service satisfies, is what lets the service and the live view depend on this module and not on
each other (before, ``live`` imported the service for its type and the service imported ``live``
for its status structs and server).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Literal, Protocol

import msgspec

from kvcached.ledger.findings import PageStatus

if TYPE_CHECKING:
    from kvcached.ledger.ledger import Ledger

MAX_REQUEST: Final = 4096
MAX_REPLY: Final = 256 << 20
LEN: Final = struct.Struct(">I")


class Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["pins", "status", "why", "tail", "limit", "dump"]
    page: int | None = None  # for why
    limit: int | None = None  # for pins: at most this many rows
    size: int | None = None  # for limit: the memory limit in bytes; negative: no limit
    force: bool = False  # for limit: below the engine's floor (one request of max_model_len) too


class PinRow(msgspec.Struct, frozen=True, array_like=True):
    """One pin on one page; a page with three pins has three rows."""

    page: int
    kind: Literal["job", "grace", "window"]
    since_build: int
    job: int | None = None
    job_kind: Literal["store", "load"] | None = None
    request: str | None = None
    waiting_workers: int | None = None
    until_build: int | None = None


class PinsReply(msgspec.Struct, frozen=True, kw_only=True, tag="pins", tag_field="type"):
    index: int  # events applied by the replica
    build: int
    pinned_pages: int
    lossy: bool  # the replica saw a gap: pins may be missing or stale
    truncated: bool
    rows: list[PinRow]


class JournalStatus(msgspec.Struct, frozen=True, kw_only=True):
    state: Literal["off", "starting", "writing", "stopped", "closed"]
    path: str | None
    durability: str
    segment: int
    segment_bytes: int
    events_written: int  # global index after the last event written (page cache at least)
    events_durable: int  # global index after the last event known fsynced
    snapshot_index: int | None
    error: str | None
    # The size bound (KVCACHED_MAX_JOURNAL_BYTES; 0: none) and what it did: this run's journal
    # bytes now (segments and snapshot), the first segment kept, the segments and bytes deleted.
    max_bytes: int = 0
    kept_bytes: int = 0
    first_segment: int = 0
    pruned_segments: int = 0
    pruned_bytes: int = 0


class HandoffStatus(msgspec.Struct, frozen=True, kw_only=True):
    capacity: int
    queued: int
    dropped: int
    gaps: int
    episodes: int


class LedgerCounts(msgspec.Struct, frozen=True, kw_only=True):
    """The replica's view; it lags the engine by what the hand-off holds."""

    policy: str
    index: int  # events applied
    build: int
    num_pages: int
    mapped_pages: int
    pinned_pages: int
    releasable_pages: int
    outstanding_jobs: int
    violations: int
    lossy: bool  # a gap was applied: the counts may be off by what was dropped
    dropped_events: int  # the sum of the gaps applied
    maps: int = 0  # pages mapped so far (PageMapped events)
    unmaps: int = 0
    jobs_failed: int = 0  # transfer jobs a worker reported failed (JobFailed events)


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Which engine a service belongs to, for ``kvctl list`` and the metrics' labels."""

    model: str
    pid: int
    api_pid: int | None  # the vllm serve API server that started this engine core
    port: int | None  # its HTTP port, where known
    socket: str
    started_unix: float
    policy: str
    engine: str  # the serving engine and its release: "vLLM 0.34.0", "SGLang 0.5.23"
    kvcached: str
    budget: str | None = None
    # vLLM's engine index (its data-parallel rank, as ``PrometheusStatLogger`` labels its own series
    # ``engine``): the metrics' ``engine`` label, so that kvcached's series join vLLM's.
    index: int = 0
    data_parallel: int = 1  # --data-parallel-size: engines > 1 are ranks of one server (kvctl list says which)
    backend: str = ""  # the memory backend: cuda or host
    page_size: int = 0  # bytes of one page of one layer (KVCACHED_PAGE_SIZE_MB)
    # Bytes one page counts in the engine's memory figures: a page in every layer (and region and
    # replica) it spans, so ``mapped_bytes`` is mapped pages times this.
    page_cost: int = 0
    compiled: bool = False  # the hot path runs mypyc-compiled

    @property
    def release(self) -> str:
        """The engine's release alone: ``"0.34.0"`` of ``"vLLM 0.34.0"``."""
        return self.engine.rsplit(" ", 1)[-1]


class BudgetStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The memory budget an engine maps its pages within (``KVCACHED_BUDGET``)."""

    name: str
    size: int | None  # bytes; None: unbounded
    used: int  # bytes granted to every engine on it
    share: int = 0  # of which this engine holds (its maps, a count's lease, unmaps not yet applied)
    # Bytes of pages this engine unmapped that its workers have not yet confirmed unmapped: they
    # go back to the budget then (vLLM's step channel: ``step_channel.DeferredRelease``).
    unapplied: int = 0
    # Bytes engines wait for at start (``Budget.join``) or are short of while serving
    # (``Budget.ask``): what the budget lacks now, the others giving back toward it.
    wanted: int = 0


class Histogram(msgspec.Struct, frozen=True, kw_only=True):
    """Observations by bucket, as Prometheus' histograms hold them: ``counts[i]`` observations
    were at most ``bounds[i]`` and more than the bound before; the last count, more than every
    bound. ``sum``: of every observation. Page maps and unmaps per scheduler step
    (``kvcached.engine.steps``), seconds a pin held an emptied page (``kvcached.holds``)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def observed(self) -> int:
        return sum(self.counts)


class MemoryStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's pages as its allocator holds them (not the replica's lagging view)."""

    page_bytes: int  # what one page costs: a page in every layer (and replica) it spans
    num_pages: int  # the virtual capacity vLLM sized its block table for
    mapped_pages: int
    in_use_pages: int
    reserved_pages: int
    limit_pages: int
    shrink_pending: bool
    waiting_on: dict[str, int]  # what a pending shrink waits for -> pages
    reason: str  # one line: within the limit, or what the shrink waits on
    held_pages: int = 0  # reserved pages a pin keeps mapped (the rest of the reserve may go)
    budget: BudgetStatus | None = None
    page_ops: Histogram | None = None  # per scheduler step, since the engine started
    # Seconds each emptied page was kept mapped by a pin, since the engine started (``kvcached.holds``)
    page_holds: Histogram | None = None
    # The least limit kvctl sets unforced: one request of max_model_len (and KVCACHED_MIN_KV_CACHE_MB)
    floor_pages: int = 0
    floor_why: str = ""  # what the floor is made of, for the refusal's line

    @property
    def mapped_bytes(self) -> int:
        return self.mapped_pages * self.page_bytes

    @property
    def limit_bytes(self) -> int:
        return self.limit_pages * self.page_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def floor_bytes(self) -> int:
        return self.floor_pages * self.page_bytes


class FlightStatus(msgspec.Struct, frozen=True, kw_only=True):
    capacity: int  # events kept at least (once that many happened)
    first_event: int
    events: int
    dumps: list[str]  # files written so far (violations, shutdown after an error)


class StatusReply(msgspec.Struct, frozen=True, kw_only=True, tag="status", tag_field="type"):
    pid: int
    uptime_s: float
    events: int  # events the service has taken from the hand-off
    ledger: LedgerCounts | None  # None: the service keeps no replica
    journal: JournalStatus
    handoff: HandoffStatus
    clients: int
    dropped_clients: int
    evicted_clients: int = 0
    engine: EngineInfo | None = None  # None: a service that belongs to no engine (tests, tools)
    memory: MemoryStatus | None = None
    flight: FlightStatus | None = None
    violations_by_invariant: dict[str, int] = {}
    pinned_by_kind: dict[str, int] = {}  # pin kind -> pages it keeps (a page with two kinds counts twice)


class LimitReply(msgspec.Struct, frozen=True, tag="limit", tag_field="type"):
    memory: MemoryStatus


class DumpReply(msgspec.Struct, frozen=True, kw_only=True, tag="dump", tag_field="type"):
    first_event: int
    events: int
    journal: bytes  # a journal file (docs/trace-format.md) starting at first_event
    snapshot: bytes | None  # the ledger before first_event (P.snap); None when it is 0


class WhyReply(msgspec.Struct, frozen=True, tag="why", tag_field="type"):
    status: PageStatus


class EventsReply(msgspec.Struct, frozen=True, tag="events", tag_field="type"):
    first: int  # global index of the first event
    events: msgspec.Raw  # a msgpack array of events, as in a journal frame


class ErrorReply(msgspec.Struct, frozen=True, tag="error", tag_field="type"):
    message: str


Reply = PinsReply | StatusReply | WhyReply | EventsReply | ErrorReply | LimitReply | DumpReply

_encoder: Final = msgspec.msgpack.Encoder()


def frame(message: Request | Reply) -> bytes:
    body = _encoder.encode(message)
    return LEN.pack(len(body)) + body


class EngineControl(Protocol):
    """What an engine lets an operator see and change while it serves. ``memory`` and
    ``set_limit`` may wait for the scheduler's current step (they take its lock): the live view
    calls them from a worker thread, never on its loop."""

    def info(self) -> EngineInfo: ...

    def memory(self) -> MemoryStatus: ...

    # bytes; None: no limit. Below the floor raises LimitRefusedError unless ``force``.
    def set_limit(self, size: int | None, force: bool = False) -> MemoryStatus: ...

    # Every ``ledger_service.TICK_S``, from a worker thread: give back toward other engines'
    # claims on the shared budget (``kvcached.budget.Budget.join``), down to this one's floor.
    def tick(self) -> None: ...


class LiveSource(Protocol):
    """What the live view reads from the service: its replica, its counters and its batches."""

    replica: Ledger | None  # None: the service keeps no replica
    index: int  # global index of the next event the service takes
    started_unix: float
    listeners: list[Callable[[int, bytes], None]]  # (first index, encoded batch), on the loop
    control: EngineControl | None  # None: a service with no engine to steer

    def journal_status(self) -> JournalStatus: ...

    def handoff_status(self) -> HandoffStatus: ...

    def flight_status(self) -> FlightStatus | None: ...

    def dump(self, reason: str) -> DumpReply | None: ...  # None: no flight recorder
