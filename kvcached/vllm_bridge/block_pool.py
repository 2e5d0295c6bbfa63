"""vLLM's block pool, made page-aware: block ids come from kvcached's manager.

vLLM hands out free blocks from the head of one LRU queue, with no idea of pages, so a page
almost never empties and elastic memory never gives anything back. ``install_page_aware_pool``
wraps the scheduler's live ``BlockPool`` instance (vLLM's classes stay untouched) so that:

* a block is *held* by kvcached while vLLM uses it or while it sits in the prefix cache (free
  but cached, or released with ``unpin_blocks``, which stays readable until reused): a page
  with a cached block must stay mapped, or a prefix hit would read zeros;
* ``get_new_blocks`` chooses blocks from kvcached's manager first (partly used pages first; the
  manager maps pages as needed and within its memory limit), and only then cached blocks in
  vLLM's own LRU order, so prefix caching and eviction behave as in vLLM. It moves its choice
  to the head of vLLM's free queue and lets vLLM's own ``get_new_blocks`` hand it out, so
  eviction from the prefix cache, reuse watchers, reference counts and metrics stay vLLM's
  code (the seam and the private names it cannot avoid are in ``vllm_internals``);
* a block freed without a hash, evicted, or dropped by a prefix-cache reset goes back to the
  manager: one ``BlockFree``, and its page goes when the ledger allows;
* ``get_num_free_blocks`` counts what can really be handed out: the manager's available
  blocks plus the evictable cached ones (so a lowered memory limit is seen by the scheduler).

The pool records no event of its own: the manager records the blocks it hands out and takes
back, and the bridge records the prefix-cache reset (it wraps vLLM's reset underneath this
pool, so that the reset comes before the frees it causes).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import ConfigError
from ..kv_cache_manager import KVCacheManager
from . import vllm_internals

log = logging.getLogger("kvcached.vllm_bridge")


class PageAwarePool:
    """The wrapper's state: which blocks kvcached holds, and the evictable (cached) ones."""

    def __init__(self, pool: Any, manager: KVCacheManager, *, max_cached_blocks: int | None = None) -> None:
        self.pool = pool
        self.manager = manager
        self.max_cached_blocks = max_cached_blocks
        # Held blocks with ref_cnt 0 that vLLM may evict, oldest first (vLLM's LRU order).
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self._orig: dict[str, Callable[..., Any]] = {}
        # While vLLM's own code runs (its reset, its get_new_blocks), it checks its free count
        # against its own queue, which holds every free block, kvcached's or not.
        self._native = False

    # --- the wrapped calls --------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        if self._native:
            return int(self.pool.free_block_queue.num_free_blocks)
        return self.manager.available_size() + len(self.evictable)

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = self.pool.blocks
        take = min(num_blocks, self.manager.available_size())
        chosen = [blocks[b] for b in self.manager.alloc(take)] if take else []
        while len(chosen) < num_blocks:  # evict cached blocks, least recently used first
            b, _ = self.evictable.popitem(last=False)
            chosen.append(blocks[b])
        self._native = True
        try:
            return vllm_internals.hand_out(self.pool, chosen, self._orig["get_new_blocks"])
        finally:
            self._native = False

    def free_blocks(self, ordered_blocks: Iterable[Any]) -> None:
        blocks = list(ordered_blocks)
        self._orig["free_blocks"](blocks)
        to_manager: list[int] = []
        for block in blocks:
            if block.ref_cnt or block.is_null or (block.pool is not None and block.pool is not self.pool):
                continue
            if block.block_hash is not None and self.pool.enable_caching:
                self.evictable[block.block_id] = None
            else:
                to_manager.append(block.block_id)
        self.manager.free(to_manager)
        self._cap_cache()

    def touch(self, blocks: Sequence[Any]) -> None:
        for block in blocks:
            if not block.is_null and block.ref_cnt == 0:
                self.evictable.pop(block.block_id, None)  # a prefix hit takes it back into use
        self._orig["touch"](blocks)

    def unpin_blocks(self, blocks: Iterable[Any], on_reuse: Callable[[Any], None]) -> None:
        blocks = list(blocks)
        self._orig["unpin_blocks"](blocks, on_reuse)
        for block in blocks:
            if block.ref_cnt == 0:
                self.evictable[block.block_id] = None  # readable until reused: keep its page

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._orig["evict_blocks"](block_ids)
        gone = [b for b in block_ids if b in self.evictable and self.pool.blocks[b].block_hash is None]
        for b in gone:
            del self.evictable[b]
        self.manager.free(gone)

    def reset_prefix_cache(self) -> bool:
        self._native = True
        try:
            # vLLM's reset, under the bridge's wrapper when there is one (PrefixCacheReset).
            ok = bool(self._orig["reset_prefix_cache"]())
        finally:
            self._native = False
        if ok:
            gone = list(self.evictable)
            self.evictable.clear()
            self.manager.free(gone)
        return ok

    def _cap_cache(self) -> None:
        """Upstream's KVCACHED_MAX_CACHED_TOKENS: beyond it, cached blocks give their pages back."""
        cap = self.max_cached_blocks
        if cap is None or len(self.evictable) <= cap:
            return
        gone = []
        evict = self._orig["evict_blocks"]  # vLLM's: drops the hashes, with its events and metrics
        while len(self.evictable) > cap:
            b, _ = self.evictable.popitem(last=False)
            vllm_internals.notify_reuse(self.pool, [self.pool.blocks[b]])
            evict({b})
            gone.append(b)
        self.manager.free(gone)


WRAPPED = (
    "get_num_free_blocks",
    "get_new_blocks",
    "free_blocks",
    "touch",
    "unpin_blocks",
    "evict_blocks",
    "reset_prefix_cache",
)


def install_page_aware_pool(
    scheduler: Any, manager: KVCacheManager, *, max_cached_blocks: int | None = None
) -> PageAwarePool:
    """Back ``scheduler``'s block pool with ``manager``; call before the first request (and
    after ``install_bridge``, whose prefix-cache reset this pool's reset wraps)."""
    pool = scheduler.kv_cache_manager.block_pool
    if getattr(pool, "_kvcached_pool", None) is not None:
        raise ConfigError("kvcached's page-aware pool is already installed on this block pool")
    vllm_internals.check(pool)
    if pool.num_gpu_blocks != manager.geometry.num_blocks:
        raise ConfigError(
            f"vLLM's block pool has {pool.num_gpu_blocks} blocks, kvcached's manager {manager.geometry.num_blocks}"
        )
    if pool.free_block_queue.num_free_blocks != pool.num_gpu_blocks - 1 or manager.num_allocated:
        raise ConfigError("install the page-aware pool before the first request is scheduled")
    (null,) = manager.alloc(1)  # vLLM's null block: id 0, never freed
    if null != pool.null_block.block_id:
        raise ConfigError(f"kvcached gave block {null} for vLLM's null block {pool.null_block.block_id}")
    wrapper = PageAwarePool(pool, manager, max_cached_blocks=max_cached_blocks)
    for name in WRAPPED:
        wrapper._orig[name] = getattr(pool, name)
        setattr(pool, name, getattr(wrapper, name))
    pool._kvcached_pool = wrapper
    return wrapper
