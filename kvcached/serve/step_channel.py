"""The scheduler's page decisions, carried to every worker by the step vLLM already sends it.

The scheduler (engine-core process) decides when a logical page is mapped or unmapped; the KV
memory lives in each worker (one per tensor-parallel rank, in its own process under vLLM's ``mp``
and Ray executors, on its own GPU). Upstream kvcached broadcasts those decisions over Unix sockets
of its own; here they ride vLLM's per-step message instead, so every executor vLLM has carries
them and nothing else is opened. Engine side, the manager's backends are ``DecisionBackend``
objects: they keep the backend contract (a page is mapped or not, exactly) and write each
decision on logical page ``p`` into a ``PageLog``. At the end of ``Scheduler.schedule()`` what
the log holds is attached to the returned ``SchedulerOutput`` as ``kvcached_page_ops``, a tuple
of ints: vLLM pickles that dataclass with its ``__dict__`` to every worker (the ``mp`` executor's
shared-memory queue, ``shm_broadcast.MessageQueue.enqueue``; Ray's compiled graph; the ``uni``
executor hands the object itself). Worker side, ``GPUModelRunner.execute_model`` (which every
executor's worker path ends in, Ray's ``execute_model_ray`` included) first applies the ops to
this worker's own range, then runs the step. When the engine goes idle (``EngineCore.has_work``
is false) with decisions pending, they go out through vLLM's ``collective_rpc``, the path vLLM
uses for its utility calls, so an idle engine still gives memory back. docs/design.md ("Tensor
parallel: decisions ride the step") says why this ordering is safe.

Message: ``(seq, blocks_per_page, op, ...)``; ``op >= 0`` maps logical page ``op``, ``op < 0``
unmaps page ``~op``. ``seq`` counts batches from 1; a worker refuses a gap (a batch an executor
lost would leave its memory out of step with the ledger), and batch 1 first drops whatever
vLLM's warm-up wrote. ``blocks_per_page`` lets each worker check that its own plan puts blocks
on the same pages as the scheduler's.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Protocol

from ..backends.base import Backend
from ..errors import ConfigError, KvcachedError
from ..kv_cache_manager import KVGeometry

if TYPE_CHECKING:
    import torch


class KVPlan(Protocol):
    """What this module needs of ``kv_memory.KVPlan`` (named so, without importing it: that
    module imports this one)."""

    @property
    def geometry(self) -> KVGeometry: ...

log = logging.getLogger("vllm.kvcached")

ATTR: Final = "kvcached_page_ops"
# Where vLLM's model runners live (V1's and the V2 runner of vllm/v1/worker/gpu/); the CPU
# build's CPUModelRunner subclasses the first without overriding execute_model.
RUNNERS: Final = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


class ChannelError(KvcachedError):
    """A worker received page decisions out of order, or for another page geometry."""


# --- engine core --------------------------------------------------------------------------------


class PageLog:
    """Decisions on logical pages since the last batch was taken; thread-safe (``kvctl limit``
    decides on the ledger service's thread)."""

    def __init__(self, blocks_per_page: int) -> None:
        self.blocks_per_page = blocks_per_page
        self.seq = 0
        self._ops: list[int] = []
        self._lock = threading.Lock()
        self.batches = 0  # batches sent with at least one op (for the tests and the log)

    def record(self, op: int) -> None:
        with self._lock:
            self._ops.append(op)

    @property
    def pending(self) -> bool:
        return bool(self._ops)

    def take(self) -> tuple[int, ...]:
        with self._lock:
            self.seq += 1
            ops, self._ops = self._ops, []
        if ops:
            self.batches += 1
        return (self.seq, self.blocks_per_page, *ops)


class DecisionBackend(Backend):
    """A backend with no memory: the scheduler's view of the workers' ranges. Rank 0's records
    each decision on logical page ``p`` (slot ``p``, region 0: ``_Slots`` maps region ``r`` of
    page ``p`` at slot ``r * num_pages + p``); the other ranks' only count, so that a page costs
    its bytes on every rank (limits and budgets speak for the whole engine)."""

    def __init__(self, page_bytes: int, kind: str, logical_pages: int, log: PageLog | None) -> None:
        super().__init__(page_bytes)
        self.kind = kind
        self._logical = logical_pages
        self._log = log

    def _reserve(self, num_pages: int) -> None:
        pass

    def _map(self, index: int) -> None:
        if self._log is not None and index < self._logical:
            self._log.record(index)

    def _unmap(self, index: int) -> None:
        if self._log is not None and index < self._logical:
            self._log.record(~index)

    def _tensor(self, dtype: torch.dtype) -> torch.Tensor:
        raise ConfigError("kvcached: the scheduler holds no KV bytes; they are in the workers")

    def _close(self) -> None:
        pass

    def resident_bytes(self) -> int:
        return 0


def attach_scheduler(scheduler: Any, plan: KVPlan, *, kind: str) -> tuple[DecisionBackend, ...]:
    """The backends for ``assemble`` (one per worker: tensor x pipeline ranks), with
    ``scheduler.schedule`` shadowed on the instance so that each output carries the decisions
    made since the last one. Taken under the engine's lock (``control``), so a decision that
    ``kvctl limit`` makes on another thread goes out whole, in this batch or the next."""
    g = plan.geometry
    world = max(1, int(scheduler.vllm_config.parallel_config.world_size))
    page_log = PageLog(g.blocks_per_page)
    backends = tuple(
        DecisionBackend(g.page_bytes, kind, g.num_pages, page_log if r == 0 else None) for r in range(world)
    )
    for b in backends:
        b.reserve(g.backend_pages)
    schedule = scheduler.schedule  # bound: vLLM's (AsyncScheduler's) method under kvcached's lock

    @functools.wraps(schedule)
    def schedule_with_pages(*args: Any, **kwargs: Any) -> Any:
        state = scheduler.__dict__.get("_kvcached")
        lock = state.lock if state is not None else threading.RLock()
        with lock:
            out = schedule(*args, **kwargs)
            setattr(out, ATTR, page_log.take())
        return out

    scheduler.schedule = schedule_with_pages
    scheduler._kvcached_pages = page_log
    return backends


def flush_on_worker(_worker: Any, message: tuple[int, ...]) -> None:
    """What ``collective_rpc`` runs on each worker (vLLM passes its worker wrapper first)."""
    worker = _WORKER
    if worker is not None:
        worker.apply(message)


def install_engine_core() -> None:
    """Wrap ``EngineCoreProc.run_busy_loop`` (vllm/v1/engine/core.py, 0.32 and 0.33): before the
    loop starts, the engine core's ``has_work`` is shadowed so that an engine about to wait for
    requests first sends pending decisions through ``collective_rpc``, and the engine's control
    gets its ``wake`` (vLLM's own ``WAKEUP`` sentinel on its input queue), which ``kvctl limit``
    calls so that an idle engine does. Not its ``__init__``:
    a spawned engine core loads vLLM's plugins (so runs kvcached's ``register``) from inside
    ``EngineCore.__init__``, too late to wrap the constructor already running; the busy loop is
    looked up on the class when it starts, after that."""
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc.run_busy_loop
    if getattr(original, "_kvcached_steer", False):
        return

    @functools.wraps(original)
    def run_busy_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        page_log = getattr(self.scheduler, "_kvcached_pages", None)
        if page_log is not None:
            _steer_engine_core(self, page_log)
        return original(self, *args, **kwargs)

    run_busy_loop._kvcached_steer = True  # type: ignore[attr-defined]
    EngineCoreProc.run_busy_loop = run_busy_loop  # type: ignore[method-assign,unused-ignore]


def _steer_engine_core(core: Any, page_log: PageLog) -> None:
    from vllm.v1.engine import EngineCoreRequestType

    has_work = core.has_work
    state = core.scheduler.__dict__.get("_kvcached")

    def has_work_or_flush() -> bool:
        busy = bool(has_work())
        if not busy and page_log.pending and core.is_running():
            # Idle: no step is in flight (has_work covers the batch queue), so every step a
            # worker ran is done, and the decisions go out now instead of with the next request.
            lock = state.lock if state is not None else threading.RLock()
            with lock:
                message = page_log.take()
            core.model_executor.collective_rpc(flush_on_worker, args=(message,))
        return busy

    core.has_work = has_work_or_flush
    control = getattr(state, "control", None)
    if control is not None:
        # kvctl limit wakes an engine blocked on its input queue: pages that wait for a grace
        # build need a step (it asks has_requests() once woken), and decisions already taken go
        # out through has_work() above. vLLM's own WAKEUP sentinel, as its signal handler uses.
        queue = core.input_queue
        control.wake = lambda: queue.put_nowait((EngineCoreRequestType.WAKEUP, None))


# --- worker -------------------------------------------------------------------------------------


class WorkerPages:
    """This worker's range and the batches applied to it."""

    def __init__(self, backend: Backend, plan: KVPlan) -> None:
        g = plan.geometry
        self.backend = backend
        self.num_pages = g.num_pages
        self.regions = g.regions
        self.blocks_per_page = g.blocks_per_page
        self.seq = 0
        self.maps = self.unmaps = 0

    def apply(self, message: tuple[int, ...]) -> None:
        seq, bpp, *ops = message
        if seq != self.seq + 1:
            raise ChannelError(
                f"kvcached: page decisions batch {seq} reached this worker after batch {self.seq}; "
                "the executor lost or reordered a step"
            )
        if bpp != self.blocks_per_page:
            raise ChannelError(
                f"kvcached: the scheduler puts {bpp} blocks on a page, this worker's KV layout {self.blocks_per_page}; "
                "its ranks' KV caches differ (pipeline stages of unequal layers?)"
            )
        self.seq = seq
        if seq == 1:
            self._forget_warm_up()
            log.info(
                "[kvcached] worker pid %d: %d pages x %d regions, mapped as the scheduler decides (step channel)",
                os.getpid(),
                self.num_pages,
                self.regions,
            )
        if not ops:
            return
        b = self.backend
        if b.kind == "cuda" and any(op < 0 for op in ops):
            # Kernels of the step before this one may still be queued (async scheduling launches
            # step N+1 before N's are done); an unmap must not pull memory from under them.
            import torch

            torch.cuda.synchronize(b.device)  # type: ignore[attr-defined]
        n = self.num_pages
        for op in ops:
            if op >= 0:
                for r in range(self.regions):
                    b.map_page(r * n + op)
                self.maps += 1
            else:
                for r in range(self.regions):
                    b.unmap_page(r * n + ~op)
                self.unmaps += 1

    def _forget_warm_up(self) -> None:
        """vLLM's profiling and warm-up ran on this range before any scheduler existed; the
        scheduler's first batch starts from nothing mapped."""
        b = self.backend
        unmap_all = getattr(b, "unmap_all", None)
        if unmap_all is not None:  # host: drop what warm-up wrote; nothing is mapped yet
            unmap_all()
            unlink = getattr(b, "unlink", None)
            if unlink is not None:
                unlink()  # no other process opens this worker's file: drop the name now
            return
        import torch

        torch.cuda.synchronize(b.device)  # type: ignore[attr-defined]
        for slot in b.mapped_pages():  # mapped by kv_memory for warm-up
            b.unmap_page(slot)


_WORKER: WorkerPages | None = None


def install_worker(backend: Backend, plan: KVPlan) -> None:
    """In a worker, where its KV memory was just made: apply each step's decisions to it before
    the step runs. Idempotent per process (one worker per process under every executor)."""
    global _WORKER
    _WORKER = WorkerPages(backend, plan)
    for name in RUNNERS:
        module = sys.modules.get(name)
        cls = getattr(module, "GPUModelRunner", None) if module is not None else None
        if cls is not None:
            _wrap_runner(cls)


def _wrap_runner(cls: type) -> None:
    original: Callable[..., Any] = cls.execute_model  # type: ignore[attr-defined]
    if getattr(original, "_kvcached", False):
        return

    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        worker = _WORKER
        if worker is not None:
            message = getattr(scheduler_output, ATTR, None)
            if message is not None:
                worker.apply(message)
            elif scheduler_output.total_num_scheduled_tokens > 0:
                raise ChannelError(
                    "kvcached: a step reached this worker without the scheduler's page decisions; "
                    "this executor does not carry SchedulerOutput whole: disable kvcached"
                )
        return original(self, scheduler_output, *args, **kwargs)

    execute_model._kvcached = True  # type: ignore[attr-defined]
    cls.execute_model = execute_model  # type: ignore[attr-defined]
