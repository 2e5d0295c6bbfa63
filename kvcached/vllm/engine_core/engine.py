"""One engine assembly: backends -> manager -> bridge -> page-aware pool, over one recorder.

An *engine*, in kvcached, is kvcached under one vLLM scheduler, which is one vLLM engine core.
It is always the same chain: a ledger and its journal, a KV cache manager over the backends that
hold the worker's KV memory, the bridge on the scheduler's connector and block pool, the
page-aware pool, and one wrapper around each of the scheduler's KV calls (``scheduler_calls``).
Every caller builds it with ``assemble``, so a change to the chain is made once. ``Engine`` is also
the control surface of a running engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from ...backends.base import Backend
from ...budget import Budget
from ...engine.config import CoreConfig
from ...engine.steps import OpsPerStep, StepEnds
from ...errors import ConfigError, KvcachedError
from ...kv_cache_manager import KVCacheManager, KVGeometry
from ...ledger.events import Header, Policy
from ...ledger.journal import JournalWriter
from ...ledger.ledger import Ledger
from ...ledger.recorder import Recorder
from ...page_allocator import AllocatorState
from ...service.ledger_service import BackgroundService
from ...service.messages import EngineControl
from ...settings import format_size
from ...version import KVCACHED_VERSION
from .. import patches
from ..step_channel import DeferredRelease
from . import scheduler_calls
from .block_pool import PageAwarePool, install_page_aware_pool
from .bridge import Bridge, install_bridge
from .ranks import data_parallel_size, engine_index

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..step_channel import PageLog

log = logging.getLogger("vllm.kvcached")


class EngineConfig(CoreConfig, frozen=True, kw_only=True):
    """The core's configuration and what only vLLM has (the plugin's comes from ``Settings``)."""

    max_cached_blocks: int | None = None  # KVCACHED_MAX_CACHED_TOKENS in blocks; None: no cap
    # False: vLLM's own block pool and no manager, the bridge's events only (a benchmark's baseline).
    page_aware: bool = True
    # Under a budget: the pages this engine waits for before it starts (its floor, kvctl limit's:
    # one request of max_model_len, from vLLM's KV cache groups), claimed from the others.
    join_floor_pages: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_cached_blocks is not None and self.max_cached_blocks < 0:
            raise ConfigError(f"engine: max_cached_blocks must be >= 0, got {self.max_cached_blocks}")
        if self.budget is not None and not self.page_aware:
            raise ConfigError("engine: a budget needs the page-aware pool (page_aware=True)")


class Engine:
    """kvcached under one vLLM scheduler: what ``assemble`` built, found by ``engine_of``.

    One engine per scheduler (one per vLLM engine core): its recorder and ledger, the manager
    and page-aware pool (None over vLLM's own pool), the bridge, the ledger service, the shared
    budget it joined. ``lock`` is held by every scheduler call kvcached wraps and by every
    ``kvctl`` request, so a limit or a status report falls between two scheduler calls. A
    served engine also has its ``page_log`` (the decisions the workers are sent) and its
    ``control`` (what ``kvctl`` reaches through the service's live socket). ``close`` ends the
    journal (not the backends, which belong to whoever made them).

    NOTE: ``kvctl list`` lists engines, a budget is shared by engines, the metrics' ``engine``
    label names one.

    NOTE: it is the control surface of a running engine: the live service calls it with the
    engine's lock held, so nothing else touches the scheduler meanwhile."""

    def __init__(
        self,
        recorder: Recorder,
        *,
        manager: KVCacheManager | None,
        pool: PageAwarePool | None,
        bridge: Bridge,
        service: BackgroundService | None,
        budget: Budget | None = None,
    ) -> None:
        self.recorder = recorder
        self.manager = manager
        self.pool = pool
        self.bridge = bridge
        self.service = service
        self.budget = budget
        self.lock = threading.RLock()
        self.page_log: PageLog | None = None
        self.control: EngineControl | None = None
        self.wake: Callable[[], None] | None = None  # steps an idle engine core (set at busy-loop start)
        # The manager's hand on the budget where its unmaps are decisions for the workers.
        self.deferred: DeferredRelease | None = None
        self.ends = None if manager is None else StepEnds(manager)
        self._closed = False
        self._failed = False

    def drain(self) -> None:
        """Let the allocator unmap what the ledger released (after a scheduler call's events)."""
        if self.ends is not None:
            self.ends.drain()

    def step_ended(self) -> None:
        """``Scheduler.schedule`` returned: count the page ops decided since the last one did."""
        if self.ends is not None:
            self.ends.step_ended()

    @property
    def page_ops(self) -> OpsPerStep:
        """Page maps and unmaps per step (none counted without a pool)."""
        return self.ends.ops if self.ends is not None else OpsPerStep()

    def batch_applied(self, message: tuple[int, ...] | None) -> None:
        """Every worker applied the step channel's batch ``message`` (and those before it): the
        budget bytes of the pages it unmapped go back now (``step_channel.DeferredRelease``)."""
        if message is not None and self.deferred is not None:
            self.deferred.release_applied(message[0])

    def failed(self, where: str, exc: BaseException) -> None:
        """A scheduler call raised: save the flight recorder once (the engine core stops next)."""
        if self._failed:
            return
        self._failed = True
        if self.service is None:
            return
        path = self.service.service.request_dump(f"engine error in {where}: {type(exc).__name__}")
        if path is not None:
            log.error("[kvcached] the scheduler failed in %s; the flight recorder is saved to %s", where, path)

    @property
    def ledger(self) -> Ledger:
        return self.recorder.ledger

    @property
    def offloading(self) -> bool:
        """Whether the bridge is on an OffloadingConnector (else it records resets only)."""
        return self.bridge.connector is not None

    def _paged(self) -> tuple[KVCacheManager, PageAwarePool]:
        if self.manager is None or self.pool is None:
            raise ConfigError("engine: no page-aware pool (vLLM's own block pool): no memory to limit")
        return self.manager, self.pool

    @property
    def page_bytes(self) -> int:
        """What one page costs: ``page_bytes`` of the geometry in every layer, region, replica.

        NOTE: ``set_limit_bytes`` and ``memory`` speak bytes, where a page costs ``page_bytes`` in
        every layer, region and replica (16 MiB for 8 layers of 2 MiB). So do the reserve
        (``max_reserved_bytes``, ``describe_reserve``) and the shared budget (``budget``:
        ``kvcached.budget``), which the engine joins in ``assemble`` and leaves in ``close``."""
        return self._paged()[0].page_cost

    def set_limit_bytes(self, n: int | None) -> AllocatorState:
        """Map at most ``n`` bytes (whole pages, rounded down; None: no limit) and return the
        state. A limit below what is mapped starts a shrink: reserved pages go as the ledger
        lets them, cached blocks are evicted by page so that pages empty (``PageAwarePool.
        shrink``), pages with blocks in use go when their requests end. A page emptied now
        still waits for its grace pin, which ends at the connector's next build: the bridge
        keeps the engine stepping for it (``has_pending_push_work``), but vLLM's engine core
        asks that only when woken, so a caller on an idle engine wakes it (any request or
        utility call) for the pages to go; without a KV connector no build ever ends a grace.
        Not thread-safe: call it where nothing else drives the scheduler."""
        manager, pool = self._paged()
        if n is not None and n < 0:
            raise ConfigError(f"engine: a memory limit must be >= 0 bytes, got {n}")
        pages = manager.geometry.num_pages if n is None else n // manager.page_cost
        manager.set_limit_pages(pages)
        pool.shrink()
        return manager.state()

    def yield_to(self, cap: int | None) -> bool:
        """Keep at most ``cap`` pages while another engine waits for the budget (None: no cap):
        as a lowered limit, the reserve goes and cached blocks are evicted by page. Returns
        whether the limit changed. Not thread-safe, as ``set_limit_bytes``."""
        manager, pool = self._paged()
        if not manager.allocator.yield_to(cap):
            return False
        pool.shrink()
        return True

    def memory(self) -> AllocatorState:
        """Pages and bytes mapped, in use, reserved, the limit; what a pending shrink waits on."""
        return self._paged()[0].state()

    def describe_reserve(self) -> str:
        """The reserve's bounds in pages and bytes, for the active line (``reserve 5..10 pages =
        80..160 MiB``)."""
        if self.manager is None:
            return "reserve: none (vLLM's own block pool)"
        a = self.manager.allocator
        lo, hi, cost = a.min_reserved, a.max_reserved, a.page_cost
        return f"reserve {lo}..{hi} pages = {_size_range(lo * cost, hi * cost)}"

    def close(self) -> None:
        """Flush and close the journal, then stop the service, then leave the budget (giving
        back this engine's share: its pages go with the process or the backends); once.
        Raises what they raise."""
        if self._closed:
            return
        self._closed = True
        try:
            self.recorder.close()
        finally:
            try:
                if self.service is not None:
                    self.service.close()
            finally:
                if self.budget is not None:
                    self.budget.close()

    def close_logged(self) -> None:
        """``close`` at a process's end (vLLM's shutdown, atexit): a journal that cannot be
        finished is logged, since losing the trace must not fail the shutdown."""
        try:
            self.close()
        except KvcachedError as e:
            log.error("[kvcached] journal: %s", e)


def _size_range(lo: int, hi: int) -> str:
    """``80..160 MiB``: one unit when both are at least a MiB, else each its own."""
    if lo >= 1 << 20 and hi >= 1 << 20:
        return f"{lo / (1 << 20):g}..{hi / (1 << 20):g} MiB"
    return f"{format_size(lo)}..{format_size(hi)}"


def header_for(scheduler: Any, geometry: KVGeometry, policy: Policy, *, clock: bool = False) -> Header:
    """The journal header of an engine over ``scheduler``: one pool, its workers, the producers,
    and with ``clock`` the wall-clock base its build boundaries' times count from. A data-parallel
    rank's journal says which rank it is (``meta``), as its file name does (``ranks.rank_path``)."""
    ranks = data_parallel_size(scheduler)
    meta = {"data_parallel_rank": str(engine_index(scheduler)), "data_parallel_size": str(ranks)} if ranks > 1 else {}
    return Header(
        page_bytes=geometry.page_bytes,
        pools=(geometry.pool(),),
        workers=int(scheduler.vllm_config.parallel_config.world_size),
        policy=policy,
        producer={"vllm": patches.vllm_version(), "kvcached": KVCACHED_VERSION},
        clock_base_unix=time.time() if clock else 0.0,
        meta=meta,
    )


def page_cost_of(geometry: KVGeometry, backends: Sequence[Backend]) -> int:
    """What one logical page costs: its bytes in every region of every backend (rank)."""
    return geometry.page_bytes * geometry.regions * max(1, len(backends))


def engine_of(scheduler: Any) -> Engine | None:
    """The engine ``assemble`` put under ``scheduler``, if any: the one accessor of that state."""
    engine = scheduler.__dict__.get(ENGINE_ATTR)
    return engine if isinstance(engine, Engine) else None


ENGINE_ATTR = patches.by_name("the engine, found by kvcached").attrs[0]


def assemble(
    scheduler: Any,
    geometry: KVGeometry,
    backends: Sequence[Backend],
    config: EngineConfig,
    *,
    page_log: PageLog | None = None,
) -> Engine:
    """Put kvcached under ``scheduler`` (before its first request) and return the parts.

    ``backends``: the primary range first, then one replica per further tensor-parallel rank
    that keeps its own copy (empty when ``config.page_aware`` is off). The scheduler's
    connector, if it has one, must be vLLM's OffloadingConnector. ``page_log``: where the
    backends write their decisions (a served engine's ``DecisionBackend`` objects), attached
    to each ``SchedulerOutput``. Every vLLM attribute the engine changes is checked first.

    NOTE: the vLLM plugin, the real-vLLM scenarios (whose journals are the golden traces) and the
    benchmarks all build the engine here; what differs between them is data: ``EngineConfig``.
    The ledger's journal is written inline, or by the ledger service's thread.

    NOTE: every vLLM object the chain changes is checked against the patch table
    (``kvcached.vllm.patches``) before any is changed (``check_targets``). The order matters
    twice: the bridge is installed before the page-aware pool, whose prefix-cache reset wraps the
    bridge's (a reset is recorded before the frees it causes), and the manager before the
    scheduler's wrappers, which drain it.
    """
    if config.page_aware and not backends:
        raise ConfigError("engine: a page-aware pool needs at least one backend")
    check_targets(scheduler, page_aware=config.page_aware)
    header = header_for(scheduler, geometry, config.policy, clock=config.clock)
    page_cost = page_cost_of(geometry, backends)
    lo, hi = config.reserve_pages(page_cost)
    budget = None
    service = None
    # NOTE: opened in this order; a start that fails half-way closes what it opened in the
    # reverse one (the journal, its service, the share of the budget), as Engine.close does.
    with ExitStack() as opening:
        if config.budget is not None:
            budget = Budget.open(config.budget, config.budget_bytes or None, directory=config.budget_dir)
            opening.callback(budget.close)
            if config.join_floor_pages:
                waited = budget.join(config.join_floor_pages * page_cost, config.join_wait_s)
                if waited:
                    log.info(
                        "[kvcached] budget %s: waited %.2f s for the others to give back this engine's floor",
                        config.budget,
                        waited,
                    )
        # NOTE: with a page log the backends only decide; the workers unmap when the batch reaches
        # them, so the budget gets an unmap's bytes back then (step_channel's module docstring).
        deferred = DeferredRelease(budget, page_log) if budget is not None and page_log is not None else None
        if config.journal_service is not None:
            service = BackgroundService.start(header, config.journal_service)
            opening.callback(service.close)
        if service is not None:
            recorder = Recorder(Ledger(header), sink=service.producer)
        elif config.journal_path is not None:
            recorder = Recorder(Ledger(header), JournalWriter.create(config.journal_path, header))
        else:
            recorder = Recorder(Ledger(header))
        opening.callback(recorder.close)
        manager = None
        if config.page_aware:
            manager = KVCacheManager(
                geometry,
                backends[0],
                recorder,
                replicas=backends[1:],
                min_reserved=lo,
                max_reserved=hi,
                budget=deferred or budget,
                # Short of the budget while serving, it asks for a request's worth or a reserve's.
                ask_pages=max(config.join_floor_pages, hi, 1),
                placement=config.placement,
            )
        bridge = install_bridge(scheduler, recorder, offloading=getattr(scheduler, "connector", None) is not None)
        pool = None
        if manager is not None:
            pool = install_page_aware_pool(scheduler, manager, max_cached_blocks=config.max_cached_blocks)
            # The null block's allocation counted free blocks, which leases the budget's room
            # (kvcached.page_allocator): give back what it did not spend, as every scheduler
            # call's drain does, or an engine idle from its start would hold it for good.
            manager.drain_releasable()
        opening.pop_all()  # started: Engine.close closes them from now on
    engine = Engine(recorder, manager=manager, pool=pool, bridge=bridge, service=service, budget=budget)
    engine.page_log = page_log
    engine.deferred = deferred
    scheduler_calls.install(scheduler, engine)
    setattr(scheduler, ENGINE_ATTR, engine)
    patches.mark(scheduler, patches.by_name("the engine, found by kvcached"))
    return engine


def check_targets(scheduler: Any, *, page_aware: bool) -> None:
    """Refuse, before anything changes, a scheduler whose objects lack what the engine patches."""
    patches.check_object(scheduler, patches.by_name("the engine, found by kvcached"))
    if type(scheduler).__module__.startswith("vllm."):  # stand-ins in tests have the calls they need
        patches.check_object(scheduler, patches.by_name("the engine's lock and drain around each KV call"))
    connector = getattr(scheduler, "connector", None)
    if type(connector).__name__ == "OffloadingConnector":  # any other is refused by install_bridge
        patches.check_object(connector, patches.by_name("offloading bridge"))
    pool = scheduler.kv_cache_manager.block_pool
    patches.check_object(pool, patches.by_name("prefix-cache reset and fresh blocks, recorded"))
    if page_aware:
        patches.check_object(pool, patches.by_name("page-aware block pool"))
        patches.check_object(pool, patches.by_name("pool seam"))
        patches.check_object(pool.free_block_queue, patches.by_name("free queue seam"))
