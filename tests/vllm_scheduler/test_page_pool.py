"""The page-aware pool over vLLM's real BlockPool: ids from kvcached, prefix caching kept, and
vLLM's own code handing the blocks out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

vllm_block_pool = pytest.importorskip("vllm.v1.core.block_pool")
pytestmark = pytest.mark.vllm

from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector  # noqa: E402

from kvcached.backends.host import HostBackend  # noqa: E402
from kvcached.errors import ConfigError  # noqa: E402
from kvcached.kv_cache_manager import KVCacheManager, KVGeometry, Placement  # noqa: E402
from kvcached.ledger.events import BlockFree, BuildBoundary, PrefixCacheReset  # noqa: E402
from kvcached.vllm.engine_core.block_pool import install_page_aware_pool  # noqa: E402
from kvcached.vllm.engine_core.bridge import install_bridge  # noqa: E402

PAGE = 64 * 1024


def setup(num_blocks: int = 32, caching: bool = True, *, bridge: bool = False, **kw):
    metrics = kw.pop("metrics_collector", None)
    pool = vllm_block_pool.BlockPool(
        num_gpu_blocks=num_blocks, enable_caching=caching, hash_block_size=16, metrics_collector=metrics
    )
    geo = KVGeometry(num_blocks=num_blocks, block_bytes=16 * 1024, page_bytes=PAGE)  # 4 blocks a page
    m = KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE))
    m.placement = Placement.BEST_FIT  # the layouts below are best fit's; test_placement has the rules
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool), connector=None)
    if bridge:  # as an engine without a KV connector has it (engine_core.engine.assemble)
        install_bridge(scheduler, m.recorder, offloading=False)
    wrapper = install_page_aware_pool(scheduler, m, **kw)
    return pool, m, wrapper


class Sink:
    """The recorder's journal end, as a list of events."""

    def __init__(self) -> None:
        self.events: list = []

    def put(self, event) -> None:
        self.events.append(event)


def record(m, event) -> None:
    """Record an event from outside the manager as the bridge does: emit, then let pages go."""
    m.recorder.emit(event)
    m.drain_releasable()


def cache(pool, blocks) -> None:
    """What vLLM's cache_full_blocks does to a full block: give it a hash, index it."""
    for i, blk in enumerate(blocks):
        pool._insert_block_hash((b"h%d" % blk.block_id, 0), blk, num_tokens=16)
        assert blk.block_hash is not None, i


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_new_blocks_come_from_partly_used_pages_and_pages_empty_out() -> None:
    pool, m, _ = setup()
    a = pool.get_new_blocks(3)  # page 0 holds the null block and these
    assert ids(a) == [1, 2, 3]
    b = pool.get_new_blocks(4)
    assert {m.page_of(x) for x in ids(b)} == {1}
    pool.free_blocks(b)  # no hash: back to kvcached
    record(m, BuildBoundary(0))
    assert m.backend.mapped_count == 1  # page 1 went back, page 0 still in use
    assert pool.get_num_free_blocks() == 32 - 4
    assert m.recorder.ledger.violations == []


def test_cached_blocks_keep_their_page_until_evicted_or_reset() -> None:
    pool, m, w = setup()
    a = pool.get_new_blocks(4)  # 1, 2, 3 on page 0; 4 on page 1
    cache(pool, a)
    pool.free_blocks(a)
    record(m, BuildBoundary(0))
    assert m.backend.mapped_count == 2  # cached blocks hold their pages
    assert list(w.evictable) == [1, 2, 3, 4]
    pool.touch([a[0]])  # a prefix hit takes block 1 back
    assert list(w.evictable) == [2, 3, 4]
    assert pool.reset_prefix_cache() is False  # block 1 is in use
    pool.free_blocks([a[0]])
    assert pool.reset_prefix_cache() is True
    record(m, BuildBoundary(1))
    assert m.backend.mapped_count == 1 and len(w.evictable) == 0
    assert m.recorder.ledger.violations == []


def test_eviction_in_lru_order_when_kvcached_has_no_free_blocks() -> None:
    pool, m, _ = setup(num_blocks=8)
    a = pool.get_new_blocks(7)
    cache(pool, a)
    pool.free_blocks(a)
    assert m.available_size() == 0 and pool.get_num_free_blocks() == 7
    b = pool.get_new_blocks(2)
    assert ids(b) == ids(a[:2])  # the least recently freed cached blocks, as vLLM would pick
    assert b[0].block_hash is None  # evicted from the prefix cache
    assert pool.get_num_free_blocks() == 5


def test_a_lowered_limit_is_seen_by_the_scheduler() -> None:
    pool, m, _ = setup()
    m.set_limit_pages(2)
    assert pool.get_num_free_blocks() == 8 - 1  # two pages, minus the null block
    with pytest.raises(ValueError):
        pool.get_new_blocks(8)


def test_new_blocks_are_handed_out_by_vllms_own_code() -> None:
    """kvcached chooses the blocks; vLLM's get_new_blocks hands them out (its metrics see them)."""
    metrics = KVCacheMetricsCollector(sample_rate=1.0)
    pool, _, _ = setup(metrics_collector=metrics)
    a = pool.get_new_blocks(5)
    assert ids(a) == [1, 2, 3, 4, 5] and all(b.ref_cnt == 1 for b in a)
    assert set(metrics.block_metrics) == {1, 2, 3, 4, 5}  # vLLM's on_block_allocated ran
    assert pool.free_block_queue.num_free_blocks == 32 - 6
    with pytest.raises(ValueError, match="Cannot get 27 free blocks"):
        pool.get_new_blocks(27)


def test_a_reused_block_tells_its_watcher_through_vllms_code() -> None:
    """A block released with unpin_blocks stays readable until reused; handing it out (as the
    last evictable block) runs vLLM's own notification."""
    pool, _, w = setup(num_blocks=8)
    a = pool.get_new_blocks(7)
    reused = []
    pool.unpin_blocks([a[0]], reused.append)
    assert list(w.evictable) == [a[0].block_id]
    (b,) = pool.get_new_blocks(1)
    assert b is a[0] and reused == [a[0]]


def test_the_cache_cap_evicts_and_tells_watchers() -> None:
    pool, m, w = setup(max_cached_blocks=1)
    a = pool.get_new_blocks(3)
    reused = []
    pool.unpin_blocks([a[0]], reused.append)  # oldest evictable, being read until reused
    cache(pool, a[1:])
    pool.free_blocks(a[1:])  # three evictable, cap 1: the two oldest give their pages back
    assert reused == [a[0]] and a[1].block_hash is None and a[2].block_hash is not None
    assert list(w.evictable) == [a[2].block_id]
    assert m.num_allocated == 2  # the null block and a[2]


def test_a_prefix_cache_reset_is_recorded_by_the_bridge_before_the_frees_it_causes() -> None:
    pool, m, _ = setup(bridge=True)
    sink = Sink()
    m.recorder.sink = sink
    a = pool.get_new_blocks(4)
    cache(pool, a)
    pool.free_blocks(a)
    assert pool.reset_prefix_cache() is True
    assert sink.events[-2:] == [PrefixCacheReset(), BlockFree(0, tuple(ids(a)))]
    assert m.recorder.ledger.prefix_cache_resets == 1


def test_the_bridge_goes_on_before_the_page_aware_pool() -> None:
    pool, m, _ = setup()
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool), connector=None)
    with pytest.raises(ConfigError, match="before its page-aware pool"):
        install_bridge(scheduler, m.recorder, offloading=False)


def test_a_shrink_evicts_whole_pages_the_oldest_first_and_spares_pages_in_use() -> None:
    """Victims by page: a page vLLM still uses keeps its cached blocks (evicting them would free
    nothing); of the others, the one used longest ago goes first; vLLM's hash map forgets what
    went, and a watcher of a released block is told."""
    pool, m, w = setup()
    a = pool.get_new_blocks(11)  # page 0: null, 1-3; page 1: 4-7; page 2: 8-11
    cache(pool, a)
    reused = []
    live = a[3]  # block 4, on page 1: still in use
    pool.free_blocks([b for b in a if b is not live and b.block_id not in (8, 9)])
    pool.unpin_blocks([a[7], a[8]], reused.append)  # 8, 9: released, being read until reused
    assert set(w.evictable) == {1, 2, 3, 5, 6, 7, 8, 9, 10, 11}
    pool.touch([a[0]])  # block 1 used again: page 0 is the most recently used
    pool.free_blocks([a[0]])
    st = m.set_limit_pages(2)
    assert st.in_use == 3 and w.shrink() == 4  # page 2 only: page 1 has a live block, page 0 is newer
    assert reused == [a[7], a[8]] and all(pool.blocks[b].block_hash is None for b in (8, 9, 10, 11))
    index = pool.cached_block_hash_to_block
    assert [b for b in range(1, 12) if index.get_one_block((b"h%d" % b, 0)) is None] == [8, 9, 10, 11]
    assert {m.page_of(b) for b in w.evictable} == {0, 1} and m.state().in_use == 2
    assert w.disagreements() == []
