"""The seam on vLLM's real block pool: kvcached's choice is handed out by vLLM's own
``get_new_blocks``, moving only the chosen blocks that do not already lead vLLM's free queue."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

vllm_block_pool = pytest.importorskip("vllm.v1.core.block_pool")
pytestmark = pytest.mark.vllm

from kvcached.vllm.engine_core import pool_seam  # noqa: E402


def _pool(num_blocks: int = 16) -> Any:
    return vllm_block_pool.BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)


def _queue_ids(pool: Any) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def _counting(pool: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ids of the blocks vLLM's ``remove`` is called with (the seam's moves)."""
    removed: list[int] = []
    queue = pool.free_block_queue
    remove: Callable[[Any], None] = queue.remove

    def counted(block: Any) -> None:
        removed.append(block.block_id)
        remove(block)

    monkeypatch.setattr(queue, "remove", counted)
    return removed


@pytest.mark.parametrize(
    ("chosen", "moves"),
    [
        ([1, 2, 3, 4], []),  # the head, in order
        ([3, 1, 4, 2], []),  # the same blocks in another order: nothing to move
        ([1, 2, 9, 10], [9, 10]),  # the head's run, then two from elsewhere
        ([9, 1, 10, 2], [9, 10]),  # the same, interleaved
        ([9, 10, 11], [9, 10, 11]),  # none at the head
    ],
)
def test_only_the_chosen_blocks_not_leading_the_queue_are_moved(chosen, moves, monkeypatch) -> None:
    pool = _pool()
    removed = _counting(pool, monkeypatch)
    before = _queue_ids(pool)
    blocks = [pool.blocks[b] for b in chosen]
    marks = [False] * 16
    got = pool_seam.hand_out(pool, blocks, pool.get_new_blocks, ids=chosen, marks=marks)
    assert sorted(b.block_id for b in got) == sorted(chosen)
    assert removed == moves
    assert marks == [False] * 16  # left as it was given, for the next call
    assert all(b.ref_cnt == 1 for b in got)
    # Every other block keeps its place in vLLM's queue.
    assert _queue_ids(pool) == [b for b in before if b not in chosen]


def test_without_ids_the_blocks_after_those_in_order_are_moved(monkeypatch) -> None:
    pool = _pool()
    removed = _counting(pool, monkeypatch)
    blocks = [pool.blocks[b] for b in (1, 3, 2, 9)]
    got = pool_seam.hand_out(pool, blocks, pool.get_new_blocks)
    assert removed == [3, 2, 9]
    assert [b.block_id for b in got] == [3, 2, 9, 1]


def test_a_moved_block_is_checked_before_anything_moves(monkeypatch) -> None:
    pool = _pool()
    removed = _counting(pool, monkeypatch)
    blocks = [pool.blocks[b] for b in (1, 9)]

    def refuse(moving: Any) -> None:
        assert [b.block_id for b in moving] == [9]
        raise RuntimeError("block 9 is in use")

    marks = [False] * 16
    with pytest.raises(RuntimeError, match="block 9"):
        pool_seam.hand_out(pool, blocks, pool.get_new_blocks, refuse, ids=[1, 9], marks=marks)
    assert removed == [] and _queue_ids(pool) == list(range(1, 16))
    assert marks == [False] * 16


def test_a_chosen_block_missing_from_the_queue_is_checked_even_when_the_rest_is_all_of_it() -> None:
    """The walk reaches the queue's tail sentinel (block id -1), whose mark would be the pool's
    last block's: that block, not in the queue, must still go to ``check_free``."""
    pool = _pool()
    pool.free_block_queue.remove(pool.blocks[15])  # as if vLLM used it
    chosen = list(range(1, 16))
    checked: list[int] = []

    def refuse(moving: Any) -> None:
        checked.extend(b.block_id for b in moving)
        raise RuntimeError("in use")

    marks = [False] * 16
    with pytest.raises(RuntimeError, match="in use"):
        pool_seam.hand_out(pool, [pool.blocks[b] for b in chosen], pool.get_new_blocks, refuse, ids=chosen, marks=marks)
    assert checked == [15] and marks == [False] * 16


def test_a_vllm_that_hands_out_other_blocks_is_refused() -> None:
    pool = _pool()
    blocks = [pool.blocks[b] for b in (9, 10)]

    def elsewhere(n: int) -> list[Any]:  # a vLLM popping from the tail
        return [pool.blocks[15 - i] for i in range(n)]

    with pytest.raises(pool_seam.SeamError, match="did not hand out the head"):
        pool_seam.hand_out(pool, blocks, elsewhere)
