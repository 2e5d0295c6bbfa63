"""An engine that starts on a full budget joins it: it claims its floor, the others give back.

The joiner is ``Budget.join`` as an engine's start calls it (in a thread, as a second engine
process would); the engine already there is a real ``KVCacheManager`` on host pages under the
same budget, and its control's tick is what the ledger service runs every ``TICK_S``:
``yield_cap`` read from the budget, ``PageAllocator.yield_to`` applied, the ledger drained. What
trips: without the tick the joiner refuses after its bound (one line naming who holds the
budget); with the cap left in force once nothing is asked,
``test_an_idle_neighbours_reserve_goes_to_a_joiner`` fails; with a raised limit that tops the
reserve up again (as ``set_limit`` did), ``test_a_lifted_limit_maps_no_reserve_on_an_idle_engine``.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvcached.backends.host import HostBackend
from kvcached.budget import Budget, BudgetError, budget_usage
from kvcached.kv_cache_manager import KVCacheManager, KVGeometry
from kvcached.ledger.events import BuildBoundary

PAGE = 1 << 20
BOUND_S = 120.0  # generous: a wait for a condition, not a timing


def manager(budget: Budget, **kw: int) -> KVCacheManager:
    geo = KVGeometry(num_blocks=32, block_bytes=PAGE // 4, page_bytes=PAGE)  # 8 pages of 4 blocks
    return KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE), budget=budget, **kw)  # type: ignore[arg-type]


def tick(m: KVCacheManager, budget: Budget, floor_pages: int, build: int) -> None:
    """The control's tick, then the engine's next step (a build ends the pages' grace)."""
    m.allocator.yield_to(budget.yield_cap(PAGE, floor_pages))
    m.recorder.emit(BuildBoundary(build))
    m.drain_releasable()


def filled(bdir: str) -> tuple[Budget, KVCacheManager]:
    """Engine A alone on an 8-page budget, idle: every page mapped, as its reserve."""
    a_b = Budget.open("gpu0", 8 * PAGE, directory=bdir)
    a = manager(a_b, min_reserved=0, max_reserved=8)
    a.free(a.alloc(32))
    a.recorder.emit(BuildBoundary(0))
    a.drain_releasable()
    assert a.state().mapped == 8 and a.state().reserved == 8 and a_b.held == 8 * PAGE
    return a_b, a


def test_an_idle_neighbours_reserve_goes_to_a_joiner(bdir) -> None:
    a_b, a = filled(bdir)
    b_b = Budget.open("gpu0", None, directory=bdir)
    outcome: list[object] = []
    joiner = threading.Thread(target=lambda: outcome.append(_join(b_b, 3 * PAGE)))
    try:
        joiner.start()
        deadline = time.monotonic() + BOUND_S
        while budget_usage("gpu0", directory=bdir).claimed == 0 and joiner.is_alive():
            assert time.monotonic() < deadline, "the joiner never claimed"
            time.sleep(0.01)
        build = 1
        while joiner.is_alive():
            assert time.monotonic() < deadline, "A never gave the joiner its floor"
            tick(a, a_b, 1, build)
            build += 1
            time.sleep(0.02)
        joiner.join()
        assert outcome and isinstance(outcome[0], float), outcome  # joined: the seconds waited
        st = a.state()
        assert st.mapped <= 5 and a_b.held <= 5 * PAGE, st  # gave back 3 pages or more, not below its floor
        # Nothing is asked any more: the cap goes, and the lifted limit maps nothing back.
        tick(a, a_b, 1, build)
        st = a.state()
        assert st.limit == 8 and st.mapped <= 5 and "another engine waits" not in st.reason, st
        assert b_b.acquire_up_to(3 * PAGE, PAGE) == 3 * PAGE  # the joiner's floor is there for it
        assert budget_usage("gpu0", directory=bdir).claimed == 0
    finally:
        a.backend.close()
        a_b.close()  # A's share goes: a joiner still waiting has its room
        joiner.join(timeout=BOUND_S)
        b_b.close()


def _join(b: Budget, nbytes: int) -> object:
    try:
        return b.join(nbytes, wait=BOUND_S, poll=0.01)
    except BudgetError as e:
        return e


def test_without_the_yield_a_joiner_refuses_at_its_bound_in_one_line(bdir) -> None:
    a_b, a = filled(bdir)
    b_b = Budget.open("gpu0", None, directory=bdir)
    try:
        with pytest.raises(BudgetError) as info:
            b_b.join(3 * PAGE, wait=0.2, poll=0.05)
        text = str(info.value)
        assert "\n" not in text and "budget gpu0 has 0 B free for this engine's 3 MiB after 0.2 s" in text, text
        assert f"held by pid {a_b.pid}: 8 MiB" in text and "KVCACHED_JOIN_WAIT_S" in text
        assert budget_usage("gpu0", directory=bdir).claimed == 0  # the claim went with the refusal
    finally:
        a.backend.close()
        a_b.close()
        b_b.close()


def test_a_neighbour_yields_no_further_than_its_floor(bdir) -> None:
    a_b, a = filled(bdir)
    b_b = Budget.open("gpu0", None, directory=bdir)
    try:
        b_b._set_claim(8 * PAGE)  # a joiner that wants the whole budget
        for build in range(1, 4):
            tick(a, a_b, 6, build)
        assert a.state().mapped == 6 and a_b.held == 6 * PAGE  # its floor of 6 pages stays
        assert a_b.asked() == 6 * PAGE
    finally:
        a.backend.close()
        a_b.close()
        b_b.close()


def test_claimed_bytes_are_granted_to_nobody_else(bdir) -> None:
    a_b = Budget.open("gpu0", 8 * PAGE, directory=bdir)
    b_b = Budget.open("gpu0", None, directory=bdir)
    try:
        assert a_b.acquire_up_to(6 * PAGE, PAGE) == 6 * PAGE
        b_b._set_claim(3 * PAGE)  # what join posts while it waits
        assert a_b.acquire_up_to(2 * PAGE, PAGE) == 0  # the 2 free pages are the joiner's
        assert a_b.asked() == PAGE  # and A is asked for the third
        assert b_b.acquire_up_to(2 * PAGE, PAGE) == 2 * PAGE  # the joiner's own claim does not bar it
    finally:
        a_b.close()
        b_b.close()


def test_a_budget_with_room_is_joined_at_once_and_no_claim_is_left(bdir) -> None:
    a_b = Budget.open("gpu0", 8 * PAGE, directory=bdir)
    try:
        assert a_b.join(4 * PAGE, wait=0.0) == 0.0  # room at once: no claim, no wait
        assert budget_usage("gpu0", directory=bdir).claimed == 0 and a_b.asked() == 0
        # A floor over the budget's size waits for the whole budget, not forever.
        assert a_b.join(64 * PAGE, wait=0.0) == 0.0
    finally:
        a_b.close()


def test_a_lifted_limit_maps_no_reserve_on_an_idle_engine(bdir) -> None:
    """An idle engine whose limit (or yield cap) is lifted maps nothing: its reserve refills at its
    next allocation, when it has work, not while a neighbour may need the pages."""
    a_b = Budget.open("gpu0", 8 * PAGE, directory=bdir)
    a = manager(a_b, min_reserved=4, max_reserved=4)
    try:
        a.free(a.alloc(4))  # page 0, and a reserve of 4 topped up beside it; then a reserve of 4
        a.recorder.emit(BuildBoundary(0))
        a.drain_releasable()
        assert a.state().mapped == 4
        a.set_limit_pages(0)
        a.recorder.emit(BuildBoundary(1))
        a.drain_releasable()
        assert a.state().mapped == 0 and a_b.held == 0
        a.set_limit_pages(8)
        assert a.state().mapped == 0 and a_b.held == 0
        a.alloc(1)  # work again: the reserve comes back with it
        assert a.state().mapped == 5
    finally:
        a.backend.close()
        a_b.close()
