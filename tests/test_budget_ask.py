"""An engine short of the budget while it serves asks; an idle neighbour gives back toward it.

Two real ``KVCacheManager``s on host pages under one real budget file: B serves (it counts its free
blocks, as vLLM's scheduler does each step, and allocates what the count allowed), A is idle with
its reserve mapped. The end of each of B's scheduler calls is its drain
(``PageAllocator.drain_releasable``), where a short engine asks (``Budget.ask``); A's side is its
control's tick as the ledger service runs it every ``TICK_S`` (``tick`` of ``test_budget_join``).
What trips: with the ask removed from the drain (``PageAllocator._ask`` never called),
``test_an_idle_neighbours_reserve_goes_to_a_short_engine`` fails (B never grows past what was
free); with an engine that asks still yielding (``asked`` without its own-ask check),
``test_two_short_engines_keep_what_they_hold`` fails.
"""

from __future__ import annotations

import time

import pytest
from test_budget_join import PAGE, filled, tick

from kvcached import budget as budget_mod
from kvcached.backends.host import HostBackend
from kvcached.budget import Budget, budget_usage
from kvcached.kv_cache_manager import KVCacheManager, KVGeometry
from kvcached.ledger.events import BuildBoundary
from kvcached.page_allocator import RETRY_SHORT_LEASE

BPP = 4  # blocks per page (test_budget_join's geometry: 8 pages of 4 blocks)
BOUND_S = 60.0  # generous: a wait for a condition, not a timing


def serving(budget: Budget, **kw: int) -> KVCacheManager:
    geo = KVGeometry(num_blocks=32, block_bytes=PAGE // BPP, page_bytes=PAGE)
    return KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE), budget=budget, **kw)  # type: ignore[arg-type]


def step(m: KVCacheManager, want_blocks: int) -> list[int]:
    """One scheduler call of a busy engine: count, take what the count allows, drain. A count
    that fell short is reused for ``RETRY_SHORT_LEASE``, so the call starts after that."""
    time.sleep(2 * RETRY_SHORT_LEASE)
    got = m.alloc(min(want_blocks, m.available_size()))
    m.drain_releasable()
    return got


def test_an_idle_neighbours_reserve_goes_to_a_short_engine(bdir) -> None:
    a_b, a = filled(bdir)  # A idle, its 8 pages all mapped as reserve: the budget is full
    b_b = Budget.open("gpu0", None, directory=bdir)
    b = serving(b_b, ask_pages=2)
    try:
        held: list[int] = []
        for build in range(1, 8):
            held += step(b, 32)  # B wants every block it can get
            tick(a, a_b, 2, build)  # A's tick: gives back toward B's ask, down to its floor of 2
        held += step(b, 32)
        assert a.state().mapped == 2 and a_b.held == 2 * PAGE  # its floor stays
        assert b.state().in_use == 6 and len(held) == 6 * BPP  # B serves on what A gave back
        assert budget_usage("gpu0", directory=bdir).short == 2 * PAGE  # B is still short
        assert a.state().reason.endswith("while another engine waits for the budget's bytes")
        # B's work is done: its next count has room to spare, so it stops asking, and A's cap goes.
        b.free(held)
        step(b, 0)
        assert budget_usage("gpu0", directory=bdir).short == 0 and a_b.asked() == 0
        tick(a, a_b, 2, 9)
        assert a.state().limit == 8 and a.state().mapped == 2  # lifted, and nothing mapped back
    finally:
        for m in (a, b):
            m.backend.close()
        a_b.close()
        b_b.close()


def test_an_engine_with_room_asks_nothing(bdir) -> None:
    a_b = Budget.open("gpu0", 8 * PAGE, directory=bdir)
    a = serving(a_b, ask_pages=2)
    try:
        step(a, 8)  # two of the eight pages: the count had room for every page
        assert budget_usage("gpu0", directory=bdir).short == 0
    finally:
        a.backend.close()
        a_b.close()


def test_two_short_engines_keep_what_they_hold(bdir) -> None:
    a_b = Budget.open("gpu0", 8 * PAGE, directory=bdir)
    b_b = Budget.open("gpu0", None, directory=bdir)
    a, b = serving(a_b, ask_pages=2), serving(b_b, ask_pages=2)
    try:
        step(a, 4 * BPP)
        step(b, 32)  # B takes the other four pages and is short
        step(a, 32)  # and so is A
        assert budget_usage("gpu0", directory=bdir).short == 4 * PAGE
        assert a_b.asked() == 0 and b_b.asked() == 0  # neither gives back to the other
        assert a_b.yield_cap(PAGE, 1) is None
    finally:
        for m in (a, b):
            m.backend.close()
        a_b.close()
        b_b.close()


def test_a_capped_engine_given_work_asks_its_pages_back(bdir) -> None:
    a_b = Budget.open("gpu0", 8 * PAGE, directory=bdir)
    a = serving(a_b, min_reserved=0, max_reserved=8, ask_pages=2)
    a.free(a.alloc(32))  # A's eight pages all mapped, as its reserve, and idle
    a.recorder.emit(BuildBoundary(0))
    a.drain_releasable()
    b_b = Budget.open("gpu0", None, directory=bdir)
    b = serving(b_b, ask_pages=4)
    try:
        step(b, 32)
        tick(a, a_b, 2, 1)
        assert a.state().limit == 4 and a.state().mapped == 4
        step(b, 32)  # B maps what A gave back
        a.alloc(4 * BPP)  # A has work again: its four pages fill
        a.drain_releasable()
        step(a, 32)  # and it wants more: capped below its own limit, it is short too
        assert a_b.asked() == 0
        tick(a, a_b, 2, 2)
        assert a.state().limit == 8  # the cap goes; what is free is whoever's counts first
    finally:
        for m in (a, b):
            m.backend.close()
        a_b.close()
        b_b.close()


def test_an_ask_lapses_once_the_engine_stops_counting(bdir, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(budget_mod, "ASK_TTL", 0.2)
    a_b, a = filled(bdir)
    b_b = Budget.open("gpu0", None, directory=bdir)
    b = serving(b_b, ask_pages=2)
    try:
        step(b, 32)
        assert a_b.asked() == 2 * PAGE
        deadline = time.monotonic() + BOUND_S  # B went idle (or was killed): it counts no more
        while a_b.asked():
            assert time.monotonic() < deadline, "B's ask never lapsed"
            time.sleep(0.05)
        assert budget_usage("gpu0", directory=bdir).short == 0
        a.recorder.emit(BuildBoundary(1))
    finally:
        for m in (a, b):
            m.backend.close()
        a_b.close()
        b_b.close()
