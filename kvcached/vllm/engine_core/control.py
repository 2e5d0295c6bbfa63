"""Steering a served engine while it runs: its identity, its memory report, its limit.

``kvctl limit`` and ``kvctl status`` reach the engine core through the ledger service's live
socket, whose loop runs in its own thread. ``LiveControl`` is what that socket calls (the
``EngineControl`` of ``kvcached.service.messages``): each request takes the engine's lock, which
every scheduler call kvcached wraps holds too (``scheduler_calls``), so a limit is applied between
two scheduler calls, never inside one, and an idle engine is steered at once. A limit may empty
pages that wait for a build or decisions that wait for a step; ``wake`` (vLLM's ``WAKEUP``
sentinel on the engine core's input queue, set when the busy loop starts) makes an idle engine
take one.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from ...engine.control import engine_info as core_engine_info
from ...engine.control import floor, memory_status, refuse_below_floor, with_budget
from ...service.messages import EngineInfo, MemoryStatus
from .ranks import data_parallel_size, engine_index

if TYPE_CHECKING:
    from .engine import Engine


# Seconds page decisions may wait to go out before the tick wakes the engine core: a step or an
# idle flush takes them within milliseconds, so this is well past any that is on its way.
STALE_BATCH_S = 1.0


class LiveControl:
    """The ``EngineControl`` of one engine (``service.messages``): its identity, its memory and
    its limit, each under the engine's lock."""

    def __init__(self, engine: Engine, info: EngineInfo, page_cost: int, floor: tuple[int, str] = (0, "")) -> None:
        self.engine = engine
        self.lock = engine.lock
        self._info = info
        self.page_cost = page_cost  # bytes one page costs: one page in every region of every backend
        self.floor_pages, self.floor_why = floor  # request_floor's: the least limit set unforced

    def info(self) -> EngineInfo:
        return self._info

    def memory(self) -> MemoryStatus:
        with self.lock:
            status = self._status()
        log = self.engine.page_log
        unapplied = 0 if log is None else log.held_bytes
        return with_budget(status, self.engine.budget, unapplied=unapplied)  # outside the lock (with_budget's NOTE)

    def set_limit(self, size: int | None, force: bool = False) -> MemoryStatus:
        """Sets the memory limit to ``size`` bytes, rounded down to whole pages (None: no limit),
        and shrinks as far as pins allow now; the rest follows as they are released. A limit
        below the floor (``request_floor``) would leave an engine that admits no request of its
        max_model_len, waiting for memory that never comes: it is refused unless ``force``."""
        refuse_below_floor(size, force, self.page_cost, self.floor_pages, self.floor_why)
        with self.lock:  # Engine.set_limit_bytes refuses a negative size and an engine without the pool
            self.engine.set_limit_bytes(size)
            if not self.engine.offloading:
                self.engine.bridge.close_build()
                self.engine.drain()
            status = self._status()
        wake = self.engine.wake
        if wake is not None:
            wake()  # pages emptied now may wait for a build, decisions for a step
        return status

    def tick(self) -> None:
        """Give back toward other engines' claims on the budget, down to the floor, and stop
        once nothing is asked (the ledger service calls it every ``TICK_S``, busy or idle).

        NOTE: it also wakes an engine core whose page decisions have waited more than
        ``STALE_BATCH_S`` to go out. They go with the next step, or through the idle engine's
        flush when its busy loop next asks ``has_work`` (``step_sender.steer_engine_core``);
        an engine core blocked on its input queue asks only when something arrives. Each
        change that decides on another thread wakes it, so this wakes only what slipped past
        them; until then the unmaps' budget bytes stay this engine's (``DeferredRelease``)."""
        log = self.engine.page_log
        wake = self.engine.wake
        if log is not None and wake is not None and log.due_for(time.monotonic()) > STALE_BATCH_S:
            wake()
        engine, budget = self.engine, self.engine.budget
        if budget is None or engine.manager is None:
            return
        cap = budget.yield_cap(self.page_cost, self.floor_pages)
        with self.lock:
            changed = engine.yield_to(cap)
            if changed and not engine.offloading:
                engine.bridge.close_build()
                engine.drain()
        wake = engine.wake
        if changed and wake is not None:
            wake()  # pages emptied now wait for a build, decisions for a step

    def _status(self) -> MemoryStatus:
        manager = self.engine.manager
        if manager is None:
            return MemoryStatus(
                page_bytes=self.page_cost,
                num_pages=0,
                mapped_pages=0,
                in_use_pages=0,
                reserved_pages=0,
                limit_pages=0,
                shrink_pending=False,
                waiting_on={},
                reason="vLLM's own block pool",
            )
        return memory_status(
            manager,
            self.page_cost,
            floor_pages=self.floor_pages,
            floor_why=self.floor_why,
            page_ops=self.engine.page_ops.snapshot(),
        )


def request_floor(scheduler: Any, blocks_per_page: int, page_cost: int, min_bytes: int = 0) -> tuple[int, str]:
    """The least limit in pages that still admits one request of ``max_model_len``, and what it
    is made of. vLLM's block pool serves every KV cache group of a hybrid model, so a request
    needs the blocks of each; each group's spec says how many its layers need at most
    (``KVCacheSpec.max_memory_usage_bytes``, what vLLM's ``check_enough_kv_cache_memory`` sums to
    refuse a KV cache too small at start-up: a sliding window needs only its window, Mamba its
    state). ``KVCACHED_MIN_KV_CACHE_MB`` (upstream kvcached's model-aware minimum) raises it."""
    config = getattr(scheduler, "vllm_config", None)
    groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None) or []
    max_len = int(getattr(getattr(config, "model_config", None), "max_model_len", 0) or 0)
    blocks = 0
    for group in groups:
        spec = group.kv_cache_spec
        try:
            need = -(-int(spec.max_memory_usage_bytes(config)) // int(spec.page_size_bytes))
        except (AttributeError, NotImplementedError, TypeError, ZeroDivisionError):
            need = -(-max_len // int(getattr(spec, "block_size", 16) or 16))  # full attention's
        blocks += need
    pages = -(-blocks // max(1, blocks_per_page))
    why = f"one request of max_model_len {max_len:,} needs {blocks:,} blocks on {pages:,} pages" if blocks else ""
    return floor(pages, why, min_bytes, page_cost)


def engine_info(
    scheduler: Any,
    *,
    socket: str,
    policy: str,
    vllm: str,
    budget: str | None,
    backend: str = "",
    page_size: int = 0,
    page_cost: int = 0,
    compiled: bool = False,
) -> EngineInfo:
    """Who this engine core is (``kvcached.engine.control.engine_info``), from its scheduler."""
    model = "?"
    with_model = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
    if with_model is not None:
        model = str(getattr(with_model, "served_model_name", None) or getattr(with_model, "model", "?"))
    # Set by the plugin in vllm serve's API server for its engine cores (plugin.register).
    port, api = os.environ.get("KVCACHED_SERVE_PORT"), os.environ.get("KVCACHED_SERVE_PID")
    return core_engine_info(
        engine=f"vLLM {vllm}",
        model=model,
        port=int(port) if port and port.isdigit() else None,
        api_pid=int(api) if api and api.isdigit() else None,
        socket=socket,
        policy=policy,
        budget=budget,
        backend=backend,
        page_size=page_size,
        page_cost=page_cost,
        compiled=compiled,
        index=engine_index(scheduler),
        data_parallel=data_parallel_size(scheduler),
    )
