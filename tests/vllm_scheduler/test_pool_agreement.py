"""kvcached's view of vLLM's block pool and vLLM's own agree, whatever vLLM does through the
pool's public methods: a block is held by kvcached's manager exactly while vLLM uses it or keeps
it evictable in the prefix cache, and a disagreement is reported at the call that causes it.

vLLM's regression tests for its issue #33775 (``test_prefix_caching.py::
test_cache_hit_local_and_external``) touch free blocks that are not cached; kvcached's ``touch``
used to leave them free in its manager, which handed them out again.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

vllm_block_pool = pytest.importorskip("vllm.v1.core.block_pool")
pytestmark = pytest.mark.vllm

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvcached.backends.host import HostBackend  # noqa: E402
from kvcached.errors import KvcachedError  # noqa: E402
from kvcached.kv_cache_manager import KVCacheManager, KVGeometry  # noqa: E402
from kvcached.vllm.engine_core.block_pool import install_page_aware_pool  # noqa: E402

PAGE = 64 * 1024  # 4 blocks a page


def vllm_pool(num_blocks: int, caching: bool = True):
    return vllm_block_pool.BlockPool(num_gpu_blocks=num_blocks, enable_caching=caching, hash_block_size=16)


def setup(num_blocks: int = 9, caching: bool = True):
    pool = vllm_pool(num_blocks, caching)
    geo = KVGeometry(num_blocks=num_blocks, block_bytes=16 * 1024, page_bytes=PAGE)
    m = KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE))
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool), connector=None)
    return pool, m, install_page_aware_pool(scheduler, m)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def agree(pool, m, w) -> None:
    """Block by block, and in the free count vLLM's scheduler sees."""
    for block in pool.blocks[1:]:
        b = block.block_id
        in_use, cached = block.ref_cnt > 0, b in w.evictable
        assert not (in_use and cached), f"block {b} is in use by vLLM and evictable in kvcached"
        assert m.holds(b) == (in_use or cached), f"block {b}: ref_cnt {block.ref_cnt}, evictable {cached}"
    assert pool.get_num_free_blocks() == pool.free_block_queue.num_free_blocks


def test_touch_of_a_free_block_takes_it_from_kvcached_as_vllm_takes_it_from_its_queue() -> None:
    """The smallest case: vLLM alone hands out block 2 after block 1 is touched."""
    alone = vllm_pool(9)
    alone.touch([alone.blocks[1]])
    assert ids(alone.get_new_blocks(1)) == [2]

    pool, m, w = setup(9)
    pool.touch([pool.blocks[1]])
    assert ids(pool.get_new_blocks(1)) == [2]
    assert m.holds(1) and pool.blocks[1].ref_cnt == 1
    agree(pool, m, w)
    pool.free_blocks([pool.blocks[1]])  # no hash: back to kvcached
    assert not m.holds(1)
    agree(pool, m, w)


def test_touch_of_a_free_block_on_an_unmapped_page_maps_that_page() -> None:
    pool, m, w = setup(13)
    pool.touch([pool.blocks[6], pool.blocks[6]])  # page 1; twice in one call, as vLLM allows
    assert pool.blocks[6].ref_cnt == 2 and m.holds(6)
    assert m.backend.mapped_count == 2
    agree(pool, m, w)
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]  # page 0 first, as before
    assert {m.page_of(b) for b in ids(pool.get_new_blocks(3))} == {1}  # then page 1's free blocks
    agree(pool, m, w)


def test_touch_of_a_free_block_on_a_reserved_page_takes_that_page_from_the_reserve() -> None:
    pool = vllm_pool(13)
    geo = KVGeometry(num_blocks=13, block_bytes=16 * 1024, page_bytes=PAGE)
    m = KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE), min_reserved=1, max_reserved=1)
    w = install_page_aware_pool(SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool)), m)
    assert m.state().reserved == 1  # page 1, mapped ahead of demand
    pool.touch([pool.blocks[5]])
    assert m.holds(5) and m.state().in_use == 2 and m.state().reserved == 1  # page 2 tops the reserve up
    agree(pool, m, w)
    assert m.recorder.ledger.violations == []


def test_a_touch_kvcached_cannot_back_changes_nothing() -> None:
    pool, m, _w = setup(13)
    m.set_limit_pages(1)
    with pytest.raises(KvcachedError, match="block 6"):
        pool.touch([pool.blocks[1], pool.blocks[6]])
    assert pool.blocks[1].ref_cnt == 0 and pool.blocks[6].ref_cnt == 0
    assert not m.holds(1) and not m.holds(6) and m.num_allocated == 1
    assert pool.free_block_queue.num_free_blocks == 12


def test_a_block_vllm_took_behind_kvcacheds_back_is_reported_by_get_new_blocks_which_keeps_nothing() -> None:
    pool, m, w = setup(9)
    w._orig["touch"]([pool.blocks[1]])  # vLLM's own touch, around kvcached: the old bug's state
    with pytest.raises(KvcachedError, match="block 1"):
        pool.get_new_blocks(2)
    assert m.num_allocated == 1  # only the null block: nothing kept that vLLM never received
    assert pool.blocks[2].ref_cnt == 0 and pool.free_block_queue.num_free_blocks == 7


def test_evicted_choices_go_back_in_lru_order_when_get_new_blocks_refuses() -> None:
    pool, _m, w = setup(5)
    a = pool.get_new_blocks(4)
    for blk in a:
        pool._insert_block_hash((b"h%d" % blk.block_id, 0), blk, num_tokens=16)
    pool.free_blocks(a)
    assert list(w.evictable) == [1, 2, 3, 4]
    w._orig["touch"]([pool.blocks[2]])  # vLLM takes an evictable block around kvcached
    with pytest.raises(KvcachedError, match="block 2"):
        pool.get_new_blocks(3)
    assert list(w.evictable) == [1, 2, 3, 4] and pool.blocks[1].block_hash is not None


def test_a_free_of_a_block_kvcached_does_not_hold_is_refused_before_vllm_frees() -> None:
    pool, m, w = setup(9)
    a = pool.get_new_blocks(2)
    w._orig["touch"]([pool.blocks[5]])  # vLLM holds block 5; kvcached never gave it
    with pytest.raises(KvcachedError, match="block 5"):
        pool.free_blocks([a[0], pool.blocks[5]])
    assert a[0].ref_cnt == 1 and pool.blocks[5].ref_cnt == 1 and m.holds(a[0].block_id)


# --- any sequence of public calls keeps the two views in agreement -------------------------------

CALLS = ["new", "cache", "free", "touch_free", "touch_cached", "touch_used", "unpin", "evict", "reset"]
OPS = st.lists(st.tuples(st.sampled_from(CALLS), st.integers(0, 40)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, caching=st.booleans())
def test_any_sequence_of_public_calls_keeps_kvcached_and_vllm_in_agreement(ops, caching) -> None:
    pool, m, w = setup(14, caching)
    refs: list = []  # one entry per reference this "scheduler" holds
    for op, k in ops:
        free = [blk for blk in pool.blocks[1:] if blk.ref_cnt == 0]
        if op == "new" and 0 < k % 6 <= pool.get_num_free_blocks():
            refs += pool.get_new_blocks(k % 6)
        elif op == "cache" and refs and caching:
            blk = refs[k % len(refs)]
            if blk.block_hash is None:
                pool._insert_block_hash((b"h%d" % k, 0), blk, num_tokens=16)
        elif op == "free" and refs:
            pool.free_blocks([refs.pop(k % len(refs))])
        elif op in ("touch_free", "touch_cached") and free:
            cands = [b for b in free if (b.block_hash is not None) == (op == "touch_cached")] or free
            blk = cands[k % len(cands)]
            pool.touch([blk])
            refs.append(blk)
        elif op == "touch_used" and refs:
            blk = refs[k % len(refs)]
            pool.touch([blk])
            refs.append(blk)
        elif op == "unpin" and refs:
            pool.unpin_blocks([refs.pop(k % len(refs))], lambda _b: None)
        elif op == "evict":
            pool.evict_blocks({1 + k % 13})
        elif op == "reset":
            pool.reset_prefix_cache()
        agree(pool, m, w)
    pool.free_blocks(refs)
    agree(pool, m, w)
