"""The ledger service's configuration: what the served engine sets from ``KVCACHED_*`` (served.py)
and the tests and benchmarks set directly. Checked when made, with one line naming what is wrong."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcached.errors import ConfigError
from kvcached.service.retention import MAX_BYTES_VAR, SEGMENT_VAR

if TYPE_CHECKING:
    from kvcached.settings import Settings


class Durability(enum.Enum):
    NONE = "none"  # write, never fsync: the kernel decides when the disk sees it
    INTERVAL = "interval"  # fsync at most every ``fsync_interval`` seconds
    BATCH = "batch"  # fsync after every frame, before it is reported durable


@dataclass(frozen=True, kw_only=True, slots=True)
class ServiceConfig:
    journal: str | None = None  # base path P; None: no journal (live view only)
    durability: Durability = Durability.INTERVAL
    fsync_interval: float = 1.0
    capacity: int = 1 << 16  # events the hand-off holds before the producer drops
    batch_events: int = 8192  # most events per frame
    flush_interval: float = 0.01  # a trickle of events waits at most this long (after activity)
    rotate_bytes: int = 256 << 20  # 0: never rotate
    snapshot_every: int = 1_000_000  # events between snapshots; 0: never
    replica: bool = True  # False: no snapshots and no pins view, one apply less per event
    socket: str | None = None  # live view socket; None: no live view
    live_queue: int = 256  # batches queued per tail client before it counts as stopped reading
    on_durable: Callable[[int], None] | None = None  # gets the durable event count, on the loop; never raise
    keep_runs: int = 3  # earlier runs' journals kept beside it (P.run<N>, ...); 0: the previous run's is deleted
    flight_events: int = 0  # the flight recorder keeps at least this many latest events; 0: off
    dump_dir: str | None = None  # where the flight recorder saves itself; None: $XDG_STATE_HOME/kvcached
    max_bytes: int = 0  # this run's journal files are kept within it (retention.py); 0: unbounded
    max_dumps: int = 0  # flight-recorder dumps of this service kept; 0: all

    def __post_init__(self) -> None:
        try:  # the string a setting or a caller gives is accepted too
            object.__setattr__(self, "durability", Durability(self.durability))
        except ValueError:
            raise ConfigError(f"ledger service: durability {self.durability!r}: use none, interval or batch") from None
        bad = [f"{k}={getattr(self, k)}" for k in ("capacity", "batch_events", "live_queue") if getattr(self, k) < 1]
        bad += [f"{k}={getattr(self, k)}" for k in ("fsync_interval", "flush_interval") if getattr(self, k) <= 0]
        nonneg = ("rotate_bytes", "snapshot_every", "keep_runs", "flight_events", "max_bytes", "max_dumps")
        bad += [f"{k}={getattr(self, k)}" for k in nonneg if getattr(self, k) < 0]
        if bad:
            raise ConfigError(f"ledger service: {', '.join(bad)}: out of range")
        if self.snapshot_every and not self.replica:
            raise ConfigError("ledger service: snapshots need the replica (replica=True or snapshot_every=0)")
        if self.max_bytes and not (self.replica and 0 < self.rotate_bytes < self.max_bytes):
            raise ConfigError(
                f"ledger service: max_bytes={self.max_bytes} ({MAX_BYTES_VAR}) needs rotation below it "
                f"(rotate_bytes={self.rotate_bytes}, {SEGMENT_VAR}) and the replica, to snapshot before deleting"
            )


def service_config(settings: Settings, socket: str, journal: str | None = None) -> ServiceConfig:
    """The ledger service of a served engine, vLLM's or SGLang's (the bridge benchmark measures
    the same one). The journal, if any, is written by the service's thread, off the scheduler's
    path, within ``flush_interval`` of each event: vLLM kills the engine core, and SGLang its
    scheduler process, at shutdown without a last call, so nothing may wait for a final flush.
    ``journal``: this engine's own path where it differs from the setting's (a data-parallel
    rank's, ``kvcached.vllm.engine_core.ranks.rank_path``)."""
    journal = journal or settings.journal
    return ServiceConfig(
        journal=journal,
        replica=True,
        snapshot_every=1_000_000 if journal else 0,
        flush_interval=0.005,
        socket=socket,
        flight_events=settings.flight_recorder_events,
        dump_dir=settings.dump_dir,
        durability=Durability(settings.journal_durability),
        rotate_bytes=settings.journal_segment_bytes,
        keep_runs=settings.journal_keep_runs,
        max_bytes=settings.max_journal_bytes,
        max_dumps=settings.max_dumps,
    )
