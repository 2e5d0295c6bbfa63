"""What kvctl gets from an engine, whichever engine it is: who it is, its memory, the floor of a limit.

Both wings answer ``kvctl status`` and ``kvctl limit`` through an ``EngineControl`` of the live
socket (``kvcached.service.messages``). How a limit is applied differs: vLLM's control takes the
engine's lock, which every scheduler call kvcached wraps holds, and applies it at once; SGLang's
hands it to the scheduler's thread for its next step. What the answer says, and which limits are
refused, is the same, and is here.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import msgspec

from ..errors import LimitRefusedError
from ..service.messages import BudgetStatus, EngineInfo, Histogram, MemoryStatus
from ..settings import format_size
from ..version import KVCACHED_VERSION

if TYPE_CHECKING:
    from ..budget import Budget
    from ..kv_cache_manager import KVCacheManager


def memory_status(
    manager: KVCacheManager,
    page_cost: int,
    *,
    floor_pages: int = 0,
    floor_why: str = "",
    page_ops: Histogram | None = None,
) -> MemoryStatus:
    """The manager's pages as ``kvctl status`` shows them (``page_cost``: one page in every
    region and replica, what a page costs the budget; ``page_ops``: per step, from the wing; how long
    pins held emptied pages, from the allocator)."""
    st = manager.state()
    return MemoryStatus(
        page_bytes=page_cost,
        num_pages=manager.allocator.num_pages,
        mapped_pages=st.mapped,
        in_use_pages=st.in_use,
        reserved_pages=st.reserved,
        limit_pages=st.limit,
        shrink_pending=st.shrink_pending,
        waiting_on=dict(st.waiting_on),
        reason=st.reason,
        held_pages=st.held,
        floor_pages=floor_pages,
        floor_why=floor_why,
        page_ops=page_ops,
        page_holds=manager.allocator.holds.snapshot(),
    )


def with_budget(status: MemoryStatus, budget: Budget | None, *, unapplied: int = 0) -> MemoryStatus:
    """The report with the shared budget's size and use, and this engine's share, read from its
    file; ``unapplied``: bytes of unmaps the engine's workers have not confirmed yet.

    NOTE: call it outside the engine's lock: the budget is a file other engines lock too, and a
    step of this engine must not wait on another engine's lock holder."""
    if budget is None:
        return status
    u, share = budget.usage_and_share()
    b = BudgetStatus(
        name=u.name, size=u.size, used=u.used, share=share, unapplied=unapplied, wanted=u.claimed + u.short
    )
    return msgspec.structs.replace(status, budget=b)


def floor(need_pages: int, need_why: str, min_bytes: int, page_cost: int) -> tuple[int, str]:
    """The least limit set unforced, in pages, and what it is made of: what the engine needs to
    serve (``need_pages``, for ``need_why``), raised to ``KVCACHED_MIN_KV_CACHE_MB``'s
    ``min_bytes`` (upstream kvcached's model-aware minimum) where that is more."""
    extra = -(-min_bytes // page_cost) if min_bytes else 0
    if extra > need_pages:
        return extra, f"KVCACHED_MIN_KV_CACHE_MB is {min_bytes / (1 << 20):g}" + (f"; {need_why}" if need_why else "")
    return need_pages, need_why


def refuse_below_floor(size: int | None, force: bool, page_cost: int, floor_pages: int, floor_why: str) -> None:
    """A limit below the floor (the least that admits one request of the engine's longest, or
    ``KVCACHED_MIN_KV_CACHE_MB``) leaves an engine waiting for memory that never comes: refused
    in one line unless ``force``."""
    if size is None or force or size // page_cost >= floor_pages:
        return
    floor_bytes = floor_pages * page_cost
    asked, floor, why = format_size(size), format_size(floor_bytes), floor_why
    if asked == floor:  # "32 KiB is below ... floor of 32 KiB" reads as a bug: say the bytes
        asked, why = f"{size:,} B", f"{floor_bytes:,} B; {why}" if why else f"{floor_bytes:,} B"
    because = f" ({why})" if why else ""
    raise LimitRefusedError(f"{asked} is below this engine's floor of {floor}{because}; pass --force to set it anyway")


def engine_info(
    *,
    engine: str,
    model: str,
    socket: str,
    policy: str,
    budget: str | None,
    backend: str,
    page_size: int,
    compiled: bool,
    page_cost: int = 0,
    port: int | None = None,
    api_pid: int | None = None,
    index: int = 0,
    data_parallel: int = 1,
) -> EngineInfo:
    """Who an engine is, for ``kvctl list`` and the metrics' labels (``engine``: "vLLM 0.34.0",
    "SGLang 0.5.23"): what its wing knows of it (the HTTP server's port and pid, where one
    started it), and what its process knows alike under any engine."""
    return EngineInfo(
        model=model,
        pid=os.getpid(),
        api_pid=api_pid,
        port=port,
        socket=socket,
        started_unix=time.time(),
        policy=policy,
        engine=engine,
        kvcached=KVCACHED_VERSION,
        budget=budget,
        index=index,
        data_parallel=data_parallel,
        backend=backend,
        page_size=page_size,
        page_cost=page_cost or page_size,
        compiled=compiled,
    )
