"""``alloc(available_size())`` always succeeds.

vLLM's scheduler trusts the page-aware pool's free-block count and asks for that many blocks
inside ``Scheduler.schedule()``; an ``OutOfPagesError`` there kills the engine. The count was
wrong when the pool's last page is short (the block count is not a multiple of blocks per page,
as in serving) and a memory limit or a pending shrink leaves only some pages available.
"""

from __future__ import annotations

import time
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached.backends.host import HostBackend
from kvcached.kv_cache_manager import KVCacheManager, KVGeometry, OutOfBlocksError
from kvcached.ledger.events import BuildBoundary
from kvcached.page_allocator import RETRY_SHORT_LEASE

KiB = 1024
PAGE = 64 * KiB


def manager(num_blocks: int, per_page: int, policy: str = "ledger", **kw: Any) -> KVCacheManager:
    geo = KVGeometry(num_blocks=num_blocks, block_bytes=PAGE // per_page, page_bytes=PAGE)
    return KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE), policy=policy, **kw)


def move(m: KVCacheManager, op: str, x: int, held: list[int], build: int) -> tuple[list[int], int]:
    """The moves the randomized tests make (take some blocks, take one free block as vLLM's touch
    does, free some, empty a page, end a build, set a limit); returns the blocks still held and the
    next build. Other ops change nothing here."""
    if op == "alloc":
        held = held + m.alloc(x % (m.available_size() + 1))
    elif op == "take":
        free = [b for b in range(m.geometry.num_blocks) if not m.holds(b)]
        if free:
            try:
                m.take([free[x % len(free)]])
                held = [*held, free[x % len(free)]]
            except OutOfBlocksError:
                pass  # a limit or a shrink refuses the page: nothing changed
    elif op == "free" and held:
        k = x % len(held) + 1
        m.free(held[:k])
        held = held[k:]
    elif op == "free-page" and held:  # empties a page: what lets the allocator give it back
        page = m.page_of(held[x % len(held)])
        m.free([b for b in held if m.page_of(b) == page])
        held = [b for b in held if m.page_of(b) != page]
    elif op == "build":
        m.recorder.emit(BuildBoundary(build))
        m.drain_releasable()
        build += 1
    elif op == "limit":
        m.set_limit_pages(x % (m.geometry.num_pages + 2))
    return held, build


def test_the_short_last_page_is_not_counted_as_a_full_one() -> None:
    # The smallest reproduction: 28 blocks, 8 per page (the last page holds 4).
    m = manager(28, 8)
    try:
        blocks = m.alloc(28)
        m.free(blocks[8:16])  # page 1
        m.recorder.emit(BuildBoundary(0))  # its grace ends
        m.drain_releasable()  # as the bridge does after each of its events
        m.free(blocks[24:])  # the short last page
        for limit in (2, 3):
            m.set_limit_pages(limit)
            n = m.available_size()
            got = m.alloc(n)
            assert len(got) == n
            m.free(got)
    finally:
        m.backend.close()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    per_page=st.sampled_from([1, 2, 3, 8]),
    pages=st.integers(1, 4),
    short=st.integers(0, 7),
    policy=st.sampled_from(["ledger", "legacy"]),
    reserve=st.tuples(st.integers(0, 2), st.integers(0, 3)),
    ops=st.lists(
        st.tuples(st.sampled_from(["alloc", "free", "free-page", "build", "limit"]), st.integers(0, 10**6)),
        max_size=16,
    ),
)
def test_alloc_of_available_size_always_succeeds(
    per_page: int, pages: int, short: int, policy: str, reserve: tuple[int, int], ops: list[tuple[str, int]]
) -> None:
    num_blocks = pages * per_page + short % per_page
    lo, hi = min(reserve), max(reserve)
    m = manager(num_blocks, per_page, policy, min_reserved=lo, max_reserved=hi)
    held: list[int] = []
    build = 0
    try:
        for op, x in ops:
            if op == "alloc":
                avail = m.available_size()
                held += m.alloc(avail if x % 2 else x % (avail + 1))  # fill up, or take some
            else:
                held, build = move(m, op, x, held, build)
            n = m.available_size()
            assert 0 <= n <= num_blocks - m.num_allocated
            got = m.alloc(n)  # must not raise
            assert len(got) == n
            m.free(got)
    finally:
        m.backend.close()


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_available_size_is_exact_under_a_limit(limit: int) -> None:
    # Not only safe but exact: one more block than available is refused.
    m = manager(28, 8)
    try:
        m.set_limit_pages(limit)
        n = m.available_size()
        assert n == min(28, sum(min(8, 28 - 8 * p) for p in range(limit)))
        got = m.alloc(n)
        assert len(got) == n
    finally:
        m.backend.close()


class _Pot:
    """A budget that another engine in the same test draws on (``PageBudget``): ``mine`` is the
    tested engine's share, ``other`` the other engine's."""

    name = "pot"

    def __init__(self, size: int) -> None:
        self.size, self.mine, self.other = size, 0, 0

    def acquire_up_to(self, nbytes: int, unit: int) -> int:
        room = min(nbytes, max(0, self.size - self.mine - self.other))
        granted = room - room % unit
        self.mine += granted
        return granted

    def release(self, nbytes: int) -> None:
        assert 0 < nbytes <= self.mine
        self.mine -= nbytes

    release_unmapped = release  # its pages' memory is its own: gone when unmapped

    def headroom(self) -> int | None:
        return max(0, self.size - self.mine - self.other)

    room = headroom  # no engine claims bytes here


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    per_page=st.sampled_from([1, 3, 8]),
    pages=st.integers(1, 5),
    short=st.integers(0, 7),
    policy=st.sampled_from(["ledger", "legacy"]),
    reserve=st.tuples(st.integers(0, 2), st.integers(0, 3)),
    budget_pages=st.none() | st.integers(0, 6),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["alloc", "take", "free", "free-page", "build", "limit", "other"]), st.integers(0, 10**6)
        ),
        max_size=24,
    ),
)
def test_the_cached_count_is_the_count(
    per_page: int,
    pages: int,
    short: int,
    policy: str,
    reserve: tuple[int, int],
    budget_pages: int | None,
    ops: list[tuple[str, int]],
) -> None:
    # available_size caches its page part behind the allocator's change count: after
    # any sequence of the calls that move pages, and of another engine drawing on the budget, it
    # answers what counting afresh answers.
    num_blocks = pages * per_page + short % per_page
    lo, hi = min(reserve), max(reserve)
    pot = None if budget_pages is None else _Pot(budget_pages * PAGE)
    m = manager(num_blocks, per_page, policy, min_reserved=lo, max_reserved=hi, budget=pot)
    held: list[int] = []
    build = 0

    def afresh() -> int:
        return min(m._partial_free + m._count_page_blocks(), num_blocks - m.num_allocated)

    # A count the budget could not lease in full is reused for RETRY_SHORT_LEASE; the other
    # engine's moves let that much time pass.
    skew = [0.0]
    real = time.monotonic
    try:
        with mock.patch("time.monotonic", lambda: real() + skew[0]):
            for op, x in ops:
                assert m.available_size() == afresh()  # read first, so that a stale cache is in play
                if op == "other":
                    if pot is not None:
                        pot.other = max(0, pot.other + (x % 5 - 2) * PAGE)
                        skew[0] += RETRY_SHORT_LEASE
                else:
                    held, build = move(m, op, x, held, build)
                # A count for a report reads the room without leasing it, and says the same.
                assert m.available_unleased() == m.available_size() == afresh(), op
                if pot is not None:  # the engine's share is what it maps and what its count leased
                    assert pot.mine == (m.allocator.mapped + m.allocator._leased) * PAGE
    finally:
        m.backend.close()
