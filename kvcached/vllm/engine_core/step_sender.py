"""The engine core's end of the step channel (``kvcached.vllm.step_channel``): decisions out.

The manager's backends in the engine core are ``DecisionBackend`` objects with no memory: each
map or unmap of logical page ``p`` is written into the scheduler's ``PageLog``, and the batch the
log holds leaves with the next ``SchedulerOutput`` (``take``, called by the engine's wrapper of
``Scheduler.schedule``) or, on an idle engine, through vLLM's ``collective_rpc``
(``steer_engine_core``, which the busy-loop patch installs).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...backends.base import Backend
from ...errors import ConfigError
from .. import patches
from ..kv_layout import KVPlan
from ..step_channel import PageLog
from ..worker.step_receiver import flush_on_worker

if TYPE_CHECKING:
    import torch

    from .engine import Engine

log = logging.getLogger("vllm.kvcached")


class DecisionBackend(Backend):
    """A backend with no memory: the scheduler's view of the workers' ranges. Rank 0's records
    each decision on logical page ``p`` (slot ``p``, region 0: ``page_slots.RegionSlots`` maps region ``r`` of
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


def decision_backends(scheduler: Any, plan: KVPlan, *, kind: str) -> tuple[tuple[DecisionBackend, ...], PageLog]:
    """The backends for ``assemble`` (one per worker: tensor x pipeline ranks) and the log they
    write to; the engine's ``schedule`` wrapper attaches the log's batch to each output
    (``scheduler_calls``), under the engine's lock, so a decision that ``kvctl limit`` makes on
    another thread goes out whole, in this batch or the next."""
    g = plan.geometry
    world = max(1, int(scheduler.vllm_config.parallel_config.world_size))
    page_log = PageLog(g.blocks_per_page)
    backends = tuple(
        DecisionBackend(g.page_bytes, kind, g.num_pages, page_log if r == 0 else None) for r in range(world)
    )
    for b in backends:
        b.reserve(g.backend_pages)
    return backends, page_log


def wrap_run_busy_loop(original: Callable[..., Any], _context: object) -> Callable[..., Any]:
    """``EngineCoreProc.run_busy_loop`` (the patch table's "idle engine sends decisions"): before
    the loop starts, the engine core's ``has_work`` is shadowed so that an engine about to wait for
    requests first sends pending decisions through ``collective_rpc``, and the engine's control
    gets its ``wake`` (vLLM's own ``WAKEUP`` sentinel on its input queue), which ``kvctl limit``
    calls so that an idle engine does. Not its ``__init__``: a spawned engine core loads vLLM's
    plugins (so runs kvcached's ``register``) from inside ``EngineCore.__init__``, too late to
    wrap the constructor already running; the busy loop is looked up on the class when it
    starts, after that."""

    from .engine import engine_of  # here: the GPU checks import this module where anyio is not

    @functools.wraps(original)
    def run_busy_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        engine = engine_of(self.scheduler)
        if engine is not None and engine.page_log is not None:
            steer_engine_core(self, engine, engine.page_log)
        return original(self, *args, **kwargs)

    return run_busy_loop


def steer_engine_core(core: Any, engine: Engine, page_log: PageLog) -> None:
    from vllm.v1.engine import EngineCoreRequestType

    patch = patches.by_name("idle engine flushes decisions")
    patches.check_object(core, patch)
    has_work = core.has_work
    lock = engine.lock

    def has_work_or_flush() -> bool:
        busy = bool(has_work())
        if not busy and page_log.pending and core.is_running():
            # Idle: no step is in flight (has_work covers the batch queue), so every step a
            # worker ran is done, and the decisions go out now instead of with the next request.
            with lock:
                message = page_log.take()
            core.model_executor.collective_rpc(flush_on_worker, args=(message,))  # returns once all ranks did
            with lock:
                engine.batch_applied(message)
        return busy

    patches.shadow(core, patch, {"has_work": has_work_or_flush})
    if engine.control is not None:
        # kvctl limit wakes an engine blocked on its input queue: pages that wait for a grace
        # build need a step (it asks has_requests() once woken), and decisions already taken go
        # out through has_work() above. vLLM's own WAKEUP sentinel, as its signal handler uses.
        queue = core.input_queue
        engine.wake = lambda: queue.put_nowait((EngineCoreRequestType.WAKEUP, None))
