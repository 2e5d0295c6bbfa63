"""Where ``KVCacheManager.alloc`` puts blocks (``Placement``): each rule on a sequence
where it differs from the others, the default emptying a page that the old lowest-first rule
keeps, the duplicate check of free and take, and stale bucket entries dropped. The fields'
invariants (the buckets by free count among them) after random moves under every rule are
``test_invariants``'s."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from test_available_size import manager
from test_invariants import broken

from kvcached.kv_cache_manager import BlockStateError, KVCacheManager, Placement

Make = Callable[..., KVCacheManager]


@pytest.fixture
def make() -> Iterator[Make]:
    made: list[KVCacheManager] = []

    def _make(placement: Placement, num_blocks: int = 32, per_page: int = 4, **kw: int) -> KVCacheManager:
        m = manager(num_blocks, per_page, "ledger", **kw)
        m.placement = placement
        made.append(m)
        return m

    yield _make
    for m in made:
        m.backend.close()


@pytest.mark.parametrize("placement", list(Placement))
def test_a_decode_block_goes_to_the_fullest_page_which_lets_the_sparse_one_empty(
    make: Make, placement: Placement
) -> None:
    m = make(placement)
    a = m.alloc(8)  # pages 0 and 1, full
    m.free(a[1:4])  # page 0: one block left
    m.free(a[4:5])  # page 1: three left
    (b,) = m.alloc(1)  # a decode step's block
    m.free(a[:1])  # page 0's last block of the first run
    if placement is Placement.LOWEST:  # the old rule put the block on page 0, which stays
        assert m.page_of(b) == 0 and m.state().in_use == 2
    else:  # page 1 is full again, page 0 emptied
        assert m.page_of(b) == 1 and m.state().in_use == 1
    assert broken(m) == []


def test_the_default_rule_empties_the_page_the_old_one_keeps(make: Make) -> None:
    # The test that fails under the old lowest-first rule: the default is not lowest-first.
    m = manager(32, 4)
    try:
        a = m.alloc(8)
        m.free(a[1:5])
        m.alloc(1)
        m.free(a[:1])
        assert m.state().in_use == 1
    finally:
        m.backend.close()


def test_best_fit_takes_the_smallest_hole_that_holds_the_run_and_fullest_the_smallest(make: Make) -> None:
    for placement, pages in ((Placement.BEST_FIT, [1, 1]), (Placement.FULLEST, [0, 1])):
        m = make(placement)
        a = m.alloc(12)  # pages 0-2, full
        m.free(a[0:1])  # page 0: 1 free
        m.free(a[4:6])  # page 1: 2 free
        m.free(a[8:11])  # page 2: 3 free
        assert [m.page_of(b) for b in m.alloc(2)] == pages, placement


def test_whole_pages_gives_a_run_pages_of_its_own(make: Make) -> None:
    runs = {}
    for placement in (Placement.WHOLE_PAGES, Placement.BEST_FIT):
        m = make(placement)
        (first,) = m.alloc(1)  # page 0, 3 blocks free
        run = m.alloc(6)
        runs[placement] = sorted(m.page_of(b) for b in run)
        m.free([first])
        if placement is Placement.WHOLE_PAGES:  # a page of its own, the rest in page 0's hole
            assert runs[placement] == [0, 0, 1, 1, 1, 1] and m.state().in_use == 2
            m.free(run)
            assert m.state().in_use == 0
        else:  # the hole first, then a new page: page 0 is shared with the run's tail
            assert runs[placement] == [0, 0, 0, 1, 1, 1]
        assert broken(m) == []


def test_whole_pages_fills_holes_first_while_a_shrink_is_pending(make: Make) -> None:
    m = make(Placement.WHOLE_PAGES, max_reserved=0)
    a = m.alloc(8)
    m.free(a[1:4] + a[5:8])  # pages 0 and 1 with 3 free blocks each
    m.set_limit_pages(1)  # a shrink: nothing more is mapped
    assert m.state().shrink_pending
    run = m.alloc(4)
    assert {m.page_of(b) for b in run} == {0, 1} and m.state().mapped == 2


@pytest.mark.parametrize("taking", [False, True])
def test_a_block_listed_twice_is_refused_and_nothing_changes(make: Make, taking: bool) -> None:
    m = make(Placement.WHOLE_PAGES)
    held = m.alloc(3)
    before = (bytes(m._allocated), list(m._used), m.num_allocated)
    blocks = [5, 6, 5] if taking else [held[0], held[1], held[0]]
    with pytest.raises(BlockStateError, match="appears twice"):
        (m.take if taking else m.free)(blocks)
    assert (bytes(m._allocated), list(m._used), m.num_allocated) == before
    with pytest.raises(BlockStateError, match="outside pool"):
        (m.take if taking else m.free)([blocks[0], 99])
    assert bytes(m._allocated) == before[0]  # the first block's mark undone
    (m.take if taking else m.free)(blocks[:2])  # and the blocks still move as asked
    assert broken(m) == []


def test_stale_bucket_entries_are_dropped(make: Make) -> None:
    m = make(Placement.WHOLE_PAGES, num_blocks=64, per_page=8)
    held = m.alloc(20)
    for _ in range(500):  # a decode-like churn: one block in, one out
        held.append(m.alloc(1)[0])
        m.free([held.pop(0)])
    assert m._entries <= 2 * len(m._free_in) + 65 and broken(m) == []
