"""How long pins hold emptied pages (``kvcached.holds``), clocked by the manager's own allocator.

The manager runs on the host backend (real memory mapped and unmapped); only the clock is the
test's, stepped by hand, so that each hold's length is known exactly."""

from __future__ import annotations

import pytest

from kvcached.backends.host import HostBackend
from kvcached.holds import BOUNDS, HoldClock
from kvcached.kv_cache_manager import KVCacheManager, KVGeometry
from kvcached.ledger.events import BuildBoundary, Event, JobBuilt, JobKind, JobReported

KiB = 1024
PAGE = 64 * KiB
BLOCKS_PER_PAGE = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def made():
    """A manager (ledger policy, no reserve kept beyond what the pins hold) and its clock."""
    geo = KVGeometry(num_blocks=32, block_bytes=PAGE // BLOCKS_PER_PAGE, page_bytes=PAGE)
    m = KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE), policy="ledger")
    clock = Clock()
    m.allocator.holds = HoldClock(clock)
    yield m, clock
    m.backend.close()


def record(m: KVCacheManager, event: Event) -> None:
    m.recorder.emit(event)
    m.drain_releasable()


def bucket(seconds: float) -> int:
    return next((i for i, b in enumerate(BOUNDS) if seconds <= b), len(BOUNDS))


def test_a_hold_lasts_from_the_free_to_the_job_s_last_report(made) -> None:
    m, clock = made
    blocks = m.alloc(2 * BLOCKS_PER_PAGE)  # two pages
    record(m, JobBuilt(1, JobKind.STORE, 0, (tuple(blocks),), 1))
    m.free(blocks)
    assert len(m.allocator.holds) == 2 and m.state().held == 2
    for step in range(3):  # grace long over: the job's pin alone keeps both pages
        record(m, BuildBoundary(step))
    clock.now += 3.0
    record(m, JobReported(1, 1))
    h = m.allocator.holds.snapshot()
    assert len(m.allocator.holds) == 0 and m.state().held == 0
    assert h.observed == 2 and h.sum == 6.0
    assert h.counts[bucket(3.0)] == 2 and h.counts[bucket(3.0) - 1] == 0  # 3 s is in (2.5, 5]


def test_a_free_s_grace_holds_its_page_until_the_open_build_is_built(made) -> None:
    m, clock = made
    blocks = m.alloc(BLOCKS_PER_PAGE)
    m.free(blocks)  # no job: the grace alone (a job of the open build may still read it)
    assert len(m.allocator.holds) == 1
    clock.now += 0.02
    record(m, BuildBoundary(0))
    h = m.allocator.holds.snapshot()
    assert len(m.allocator.holds) == 0 and h.observed == 1 and h.counts[bucket(0.02)] == 1


def test_under_the_legacy_policy_no_page_is_held() -> None:
    geo = KVGeometry(num_blocks=32, block_bytes=PAGE // BLOCKS_PER_PAGE, page_bytes=PAGE)
    m = KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE), policy="legacy")
    try:
        blocks = m.alloc(BLOCKS_PER_PAGE)
        record(m, JobBuilt(1, JobKind.STORE, 0, (tuple(blocks),), 1))
        m.free(blocks)  # legacy: the free lets the page go, job or not (the freed-block-copy bug)
        assert len(m.allocator.holds) == 0 and m.allocator.holds.snapshot().observed == 0
    finally:
        m.backend.close()


def test_a_held_page_handed_out_again_ends_its_hold(made) -> None:
    m, clock = made
    blocks = m.alloc(BLOCKS_PER_PAGE)
    record(m, JobBuilt(2, JobKind.STORE, 0, (tuple(blocks),), 1))
    m.free(blocks)
    assert len(m.allocator.holds) == 1
    clock.now += 0.07
    again = m.alloc(1)  # the held page is the lowest reserved one: no new map
    assert again[0] in blocks
    h = m.allocator.holds.snapshot()
    assert len(m.allocator.holds) == 0 and h.observed == 1 and h.counts[bucket(0.07)] == 1
    clock.now += 5.0
    record(m, JobReported(2, 1))  # the pin goes later: the page is in use, no second observation
    assert m.allocator.holds.snapshot().observed == 1


def test_a_hold_longer_than_every_bound_is_in_the_last_bucket() -> None:
    clock = Clock()
    holds = HoldClock(clock)
    holds.begin(7)
    holds.end((8,))  # no open hold: passed over
    clock.now += BOUNDS[-1] + 1
    holds.end((7,))
    h = holds.snapshot()
    assert h.counts[-1] == 1 and h.observed == 1 and h.sum == BOUNDS[-1] + 1
