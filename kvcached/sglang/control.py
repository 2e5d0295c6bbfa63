"""Steering a served SGLang engine: ``kvctl list`` / ``status`` / ``limit`` through the live socket.

The ledger service's live socket calls an ``EngineControl`` (``kvcached.service.messages``) from
its own thread, while SGLang's scheduler thread allocates and frees. So a limit is handed to the
scheduler's thread and applied at its next step (``SglangControl.apply``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..engine.control import engine_info as core_engine_info
from ..engine.control import memory_status, refuse_below_floor, with_budget
from ..ledger.compiled import CORE_COMPILED, compiled_status
from ..service.messages import EngineInfo, MemoryStatus

if TYPE_CHECKING:
    from ..budget import Budget
    from ..engine.steps import OpsPerStep
    from ..kv_cache_manager import KVCacheManager

# How long a limit waits for the scheduler's next step before it is reported as pending.
APPLY_WAIT_S = 5.0


class SglangControl:
    """The ``EngineControl`` of one SGLang engine.

    NOTE: vLLM's control takes the engine's lock, which every scheduler call kvcached wraps holds.
    SGLang's allocator is called from too many places to wrap them all, so a limit is handed to
    the scheduler's thread instead and applied at its next step (``Bridge.step``), which SGLang's
    event loop takes continuously, busy or idle."""

    def __init__(
        self,
        manager: KVCacheManager,
        budget: Budget | None,
        info: EngineInfo,
        page_cost: int,
        page_size: int = 1,
        *,
        floor_pages: int = 1,
        floor_why: str = "",
        page_ops: OpsPerStep | None = None,
    ) -> None:
        self.manager = manager
        self.page_ops = page_ops
        self.budget = budget
        self.page_cost = page_cost  # a page in every region: 2 * layers of them
        self.floor_pages = floor_pages  # the least limit set unforced, and what it yields down to
        self.floor_why = floor_why
        self._info = info
        self._lock = threading.Lock()
        self._pending: tuple[int, threading.Event] | None = None
        # The cap the budget's claims ask for (``tick``), applied at the next step; a 1-tuple so
        # that "no change" (None) differs from "no cap" ((None,)).
        self._cap: tuple[int | None] | None = None
        # Evicts up to n tokens of SGLang's tree cache (set by the scheduler's hook, ``hooks._step``).
        self.evict_cached: Callable[[int], int] | None = None
        g = manager.geometry
        self._slots_per_page = g.page_bytes // g.block_bytes * page_size  # a block is one SGLang page

    def info(self) -> EngineInfo:
        return self._info

    def memory(self) -> MemoryStatus:
        """NOTE: the report reads the allocator's counts as they are between two changes of the
        limit (``apply``)."""
        ops = None if self.page_ops is None else self.page_ops.snapshot()
        status = memory_status(
            self.manager, self.page_cost, floor_pages=self.floor_pages, floor_why=self.floor_why, page_ops=ops
        )
        return with_budget(status, self.budget)

    def set_limit(self, size: int | None, force: bool = False) -> MemoryStatus:
        """Map at most ``size`` bytes (whole pages, rounded down; None: no limit), from the
        scheduler's next step on; below the floor only with ``force`` (``refuse_below_floor``)."""
        refuse_below_floor(size, force, self.page_cost, self.floor_pages, self.floor_why)
        pages = self.manager.allocator.num_pages if size is None else max(0, size) // self.page_cost
        done = threading.Event()
        with self._lock:
            self._pending = (pages, done)
        done.wait(APPLY_WAIT_S)
        return self.memory()

    def tick(self) -> None:
        """What other engines' claims on the budget ask of this one (the ledger service calls it
        every ``TICK_S``), for the scheduler's next step to apply."""
        if self.budget is not None:
            cap = self.budget.yield_cap(self.page_cost, self.floor_pages)
            with self._lock:
                self._cap = (cap,)

    def apply(self) -> None:
        """On the scheduler's thread, at a step: the limit asked for since the last one.

        NOTE: what a lowered limit cannot take at once goes as SGLang frees the slots: a running
        request's when it ends; a cached tree node's only when SGLang evicts it, which it does
        only when it needs slots. So while pages in use are over the limit, each step evicts as
        many tokens as those pages hold from SGLang's tree (``evict``, least recently used first,
        as SGLang would), and an idle engine with a full prefix cache reaches its limit too."""
        with self._lock:
            pending, self._pending = self._pending, None
            cap, self._cap = self._cap, None
        if pending is not None:
            pages, done = pending
            self.manager.set_limit_pages(pages)
            done.set()
        if cap is not None:
            self.manager.allocator.yield_to(cap[0])
        over = self.manager.allocator.in_use_over_limit
        if over and self.evict_cached is not None:
            # The pages empty once all their slots are evicted: their grace ends at a later step.
            self.evict_cached(over * self._slots_per_page)


def engine_info(
    *,
    socket: str,
    policy: str,
    sglang: str,
    budget: str | None,
    backend: str,
    page_size: int,
    page_cost: int = 0,
) -> EngineInfo:
    """Who this SGLang engine is (``kvcached.engine.control.engine_info``), from its server's
    arguments (``get_server_args``) where a server built it.

    NOTE: ``api_pid`` is the process that loaded kvcached's plugin first, SGLang's HTTP server
    under ``launch_server`` (``plugin.register`` names it in ``KVCACHED_SERVE_PID``, which the
    scheduler processes it starts inherit); its ``/metrics`` finds this engine by it."""
    api = os.environ.get("KVCACHED_SERVE_PID", "")
    return core_engine_info(
        engine=f"SGLang {sglang}",
        model=_model_name(),
        socket=socket,
        policy=policy,
        budget=budget,
        backend=backend,
        page_size=page_size,
        page_cost=page_cost,
        compiled=compiled_status(CORE_COMPILED) is None,
        api_pid=int(api) if api.isdigit() else None,
    )


def _model_name() -> str:
    # NOTE: the port is not taken from the server's arguments: SGLang's offline ``Engine`` has one
    # too (``ServerArgs.port``, 30000 by default) while it serves no HTTP at all.
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
        return str(getattr(args, "served_model_name", None) or getattr(args, "model_path", "?"))
    except Exception:  # a pool built outside a server (tests): no server arguments
        return "?"
