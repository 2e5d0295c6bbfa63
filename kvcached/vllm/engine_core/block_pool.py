"""vLLM's block pool, made page-aware: block ids come from kvcached's manager.

vLLM hands out free blocks from the head of one LRU queue, with no idea of pages, so a page
almost never empties and elastic memory never gives anything back. ``install_page_aware_pool``
wraps the scheduler's live ``BlockPool`` instance (vLLM's classes stay untouched). New blocks
come from the manager first, partly used pages first, and cached blocks are evicted by page, so
that whole pages empty; prefix caching and eviction otherwise behave as in vLLM.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ...errors import ConfigError, ConsistencyError
from ...kv_cache_manager import KVCacheManager, OutOfBlocksError
from .. import patches
from . import pool_seam
from .cached_blocks import CachedBlocks

# The rows naming KVCacheBlock's hash field over the releases (``patches.RELIED_ON``).
HASH_FIELD = ("block hash field", "block hash field (0.34)")

log = logging.getLogger("kvcached.vllm.engine_core")


class PoolAgreementError(ConsistencyError):
    """kvcached's manager and vLLM's block pool disagree on a block: raised by the call that
    would make them disagree (or hand a block out twice), before either side changes."""


class PageAwarePool:
    """The wrapper's state: which blocks kvcached holds, and the evictable (cached) ones.

    NOTE: a block is *held* by kvcached while vLLM uses it or while it sits in the prefix cache
    (free but cached, or released with ``unpin_blocks``, which stays readable until reused). A
    page with a cached block must stay mapped, or a prefix hit would read zeros.

    NOTE: the two views agree: kvcached's manager holds a block exactly while vLLM uses it or
    keeps it evictable (``disagreements`` lists any block where they do not). Each call checks
    the blocks it moves and raises ``PoolAgreementError`` before either side changes, rather
    than letting a block be handed out twice later.

    NOTE: the pool records no event of its own: the manager records the blocks it hands out and
    takes back, and the bridge records the prefix-cache reset (``reset_prefix_cache``)."""

    def __init__(
        self, pool: Any, manager: KVCacheManager, *, max_cached_blocks: int | None = None, eviction: str = "page"
    ) -> None:
        if eviction not in EVICTION:
            raise ConfigError(f"eviction must be one of {', '.join(EVICTION)}, got {eviction!r}")
        self.pool = pool
        self._queue = pool.free_block_queue
        self.manager = manager
        self.max_cached_blocks = max_cached_blocks
        self.eviction = eviction
        self.shrink_evictions = 0  # cached blocks evicted for a shrink (a counter for benchmarks)
        # Held blocks with ref_cnt 0 that vLLM may evict, oldest first (vLLM's LRU order).
        self.evictable = CachedBlocks(manager.page_of, manager.geometry.num_blocks)
        self._orig: dict[str, Callable[..., Any]] = {}
        self._marks = [False] * len(pool.blocks)  # pool_seam.hand_out's scratch, one a block
        # The block's hash, read as the field itself (its name per release: the patch table).
        self._hash_of = operator.attrgetter(patches.holding(*HASH_FIELD).attrs[0])
        # While vLLM's own code runs (its reset, its get_new_blocks), it checks its free count
        # against its own queue, which holds every free block, kvcached's or not.
        self._native = False

    # --- the wrapped calls --------------------------------------------------------------------

    def get_num_free_blocks(self) -> Any:  # an int: the object vLLM's queue holds, when it is the answer
        """What can really be handed out: the manager's available blocks plus the evictable cached
        ones, so that a lowered memory limit is seen by the scheduler."""
        # Asked ~200 times a prefill-heavy step: vLLM's queue is held (vLLM sets it once, in
        # BlockPool.__init__) rather than looked up, and its count is returned as the object it
        # is when it is the answer (typed int, the result was a new int object every call).
        queued = self._queue.num_free_blocks
        if self._native:
            return queued
        # Never more than vLLM's own queue holds: while the two views agree that is every block
        # kvcached counts, and anything beyond it could not be handed out (vLLM's tests force a
        # preemption by setting that count, e.g. offloading_connector's test_request_preemption).
        n: int = queued
        k = self.manager.available_size() + len(self.evictable)
        return queued if n <= k else k

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        """Blocks from kvcached's manager first (partly used pages first; the manager maps pages
        as needed and within its memory limit), and only then cached blocks in vLLM's own LRU
        order, so that prefix caching and eviction behave as in vLLM.

        NOTE: the choice is moved to the head of vLLM's free queue, and vLLM's own
        ``get_new_blocks`` hands it out. So eviction from the prefix cache, reuse watchers,
        reference counts and metrics stay vLLM's code (the seam and the private names it cannot
        avoid are in ``pool_seam``)."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks: list[Any] = self.pool.blocks
        take = min(num_blocks, self.manager.available_size())
        fresh = self.manager.alloc(take) if take else []
        chosen = [blocks[b] for b in fresh]
        evicted: list[int] = []
        while len(chosen) < num_blocks:  # evict cached blocks, least recently used first
            b, _ = self.evictable.popitem(last=False)
            evicted.append(b)
            chosen.append(blocks[b])

        def check_free(chosen: Sequence[Any]) -> None:
            # vLLM's queue holds exactly the blocks with ref_cnt 0; one that vLLM uses would be
            # handed out twice (vLLM's own remove() fails on it half-way through the queue).
            # ``hand_out`` calls this with the blocks it is about to move, before it moves any;
            # those already at the queue's head are in the queue, so vLLM does not use them (one
            # attribute read a block saved on nearly every call).
            for block in chosen:
                if block.ref_cnt:
                    source = "free in kvcached's manager" if block.block_id in fresh else "evictable in kvcached"
                    raise PoolAgreementError(
                        f"block {block.block_id} is {source} but in use by vLLM (ref_cnt {block.ref_cnt}): "
                        "vLLM took it without the page-aware pool's touch or get_new_blocks"
                    )

        try:
            self._native = True
            try:
                return pool_seam.hand_out(
                    self.pool, chosen, self._orig["get_new_blocks"], check_free, ids=fresh + evicted, marks=self._marks
                )
            finally:
                self._native = False
        except pool_seam.SeamError:
            raise  # vLLM handed out blocks of its own choosing: nothing here can set that right
        except BaseException:
            # vLLM handed nothing out: kvcached keeps no block vLLM did not receive.
            self.manager.free(fresh)
            for b in reversed(evicted):
                self.evictable.add(b)
                self.evictable.move_to_end(b, last=False)
            raise

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        """vLLM's free; a freed block with a hash joins the evictable ones, one without goes back
        to the manager: one ``BlockFree``, and its page goes when the ledger allows.

        NOTE: a block evicted (``evict_blocks``) or dropped by a prefix-cache reset
        (``reset_prefix_cache``) goes back to the manager the same way."""
        blocks = list(ordered_blocks)
        # The ids of this pool's own blocks, read while checking that kvcached holds them: after
        # vLLM's free only their reference counts (and hashes) need reading again. An attribute
        # of vLLM's block is a generic lookup (~240 instructions), and this runs for every block
        # a step frees (hundreds on a prefill-heavy step).
        ids = self._held(blocks, "free_blocks")
        # NOTE: evict_first (vLLM 0.34's BlockPool.free_blocks, for blocks another tier holds)
        # queues cached blocks at the head, to be evicted before the others; vLLM before 0.34
        # never passes it and its free_blocks does not take it.
        if evict_first:
            self._orig["free_blocks"](blocks, evict_first=True)
        else:
            self._orig["free_blocks"](blocks)
        pool = self.pool
        caching = bool(pool.enable_caching)  # read once: vLLM sets it at BlockPool.__init__
        hash_of = self._hash_of
        evictable = self.evictable
        first: list[int] = []  # cached blocks to evict before the others, in their order
        to_manager: dict[Any, None] = {}  # once each: a block may be listed once per reference
        for k in range(len(blocks)):
            b = ids[k]
            if b is False:  # the null block
                continue
            block = blocks[k]
            if block.ref_cnt:
                continue
            if b is None:  # not this pool's object (vLLM's tests' stand-ins): as vLLM tells it
                owner = block.pool
                if owner is not None and owner is not pool:
                    continue
                b = block.block_id
            # vLLM's free_blocks queues a block with a hash at the tail (evictable, LRU) and one
            # without at the head. Read only when caching, and as the field its ``block_hash``
            # property returns (``RELIED_ON``): the property's call is ~2/3 of this read's cost.
            if caching and hash_of(block) is not None:
                if evict_first:
                    first.append(b)
                else:
                    evictable.add(b)
            else:
                to_manager[b] = None
        for b in reversed(first):
            evictable.add(b)
            evictable.move_to_end(b, last=False)
        self.manager.free(list(to_manager))
        self._cap_cache()
        if self.manager.allocator.shrinking:
            self.shrink()

    def touch(self, blocks: Sequence[Any]) -> None:
        """NOTE: vLLM's touch takes every unused block out of its free queue. A cached one (a
        prefix hit) kvcached already holds. Any other one, a free block kvcached does not hold
        as cached, is taken from the manager first (its page put in use, mapped if need be), as
        vLLM takes it out of its queue. vLLM's tests of its issue #33775 touch such blocks,
        which the manager would otherwise hand out again."""
        hits: list[int] = []
        take: dict[int, None] = {}  # in order, once each (a block may be touched twice)
        for block in blocks:
            if block.is_null or block.ref_cnt:
                continue
            b = block.block_id
            if b in self.evictable:
                hits.append(b)
            elif self.manager.holds(b):
                raise PoolAgreementError(
                    f"vLLM touched free block {b}, which kvcached holds but does not count as cached"
                )
            else:
                take[b] = None
        if take:
            try:
                self.manager.take(list(take))
            except OutOfBlocksError as exc:
                raise OutOfBlocksError(f"vLLM's BlockPool.touch took a free block kvcached cannot back: {exc}") from exc
        try:
            self._orig["touch"](blocks)
        except BaseException:
            self.manager.free(list(take))
            raise
        for b in hits:
            self.evictable.discard(b)  # a prefix hit takes it back into use

    def unpin_blocks(self, blocks: Iterable[Any], on_reuse: Callable[[Any], None]) -> None:
        blocks = list(blocks)
        self._check_held(blocks, "unpin_blocks")
        self._orig["unpin_blocks"](blocks, on_reuse)
        for block in blocks:
            if block.ref_cnt == 0:
                self.evictable.add(block.block_id)  # readable until reused: keep its page
        if self.manager.allocator.shrinking:
            self.shrink()

    def evict_blocks(self, block_ids: set[int]) -> None:
        self._orig["evict_blocks"](block_ids)
        gone = [b for b in block_ids if b in self.evictable and self.pool.blocks[b].block_hash is None]
        for b in gone:
            del self.evictable[b]
        self.manager.free(gone)

    def reset_prefix_cache(self) -> bool:
        """NOTE: the bridge records the reset, not this pool: it wraps vLLM's reset underneath
        this pool, so that the reset comes before the frees it causes."""
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

    def _check_held(self, blocks: list[Any], call: str) -> None:
        """Before vLLM releases references: every block it holds, kvcached must hold too."""
        self._held(blocks, call)

    def _held(self, blocks: list[Any], call: str) -> list[Any]:
        """``_check_held``, returning what it read: for each of ``blocks``, its id (the object vLLM
        holds) if it is this pool's own block object, None if not, and False for the null block."""
        manager = self.manager
        pool = self.pool
        mine: list[Any] = pool.blocks
        null = pool.null_block  # this pool's own, by identity: one attribute read a call, not a block
        n = len(mine)
        ids: list[Any] = [False] * len(blocks)
        for k in range(len(blocks)):
            block = blocks[k]
            if block is null:
                continue
            b = block.block_id
            i: int = b  # native, for the checks; ``b`` stays the object (no new int to store)
            # Only this pool's own block objects: vLLM frees another pool's blocks through it
            # (BlockPool.free_blocks hands them on), and its tests free stand-in KVCacheBlocks.
            if i >= n or mine[i] is not block:
                ids[k] = False if block.is_null else None
                continue
            if not manager.holds(i):
                raise PoolAgreementError(
                    f"vLLM's {call} releases block {i} (ref_cnt {block.ref_cnt}), "
                    "which kvcached's manager does not hold"
                )
            ids[k] = b
        return ids

    def disagreements(self) -> list[str]:
        """Every block on which kvcached and vLLM disagree, one line each; empty when they agree.

        A block is held by kvcached's manager exactly while vLLM uses it (ref_cnt > 0) or keeps
        it evictable; O(blocks), for tests and diagnosis."""
        out = []
        for block in self.pool.blocks:
            if block.is_null:
                continue
            b, used, cached = block.block_id, block.ref_cnt > 0, block.block_id in self.evictable
            if used and cached:
                out.append(f"block {b}: in use by vLLM (ref_cnt {block.ref_cnt}) and evictable in kvcached")
            elif self.manager.holds(b) != (used or cached):
                held = "holds" if self.manager.holds(b) else "does not hold"
                out.append(f"block {b}: ref_cnt {block.ref_cnt}, evictable {cached}, kvcached's manager {held} it")
        return out

    def shrink(self) -> int:
        """While a shrink is pending, evict cached blocks until the pages in use fit the limit,
        whole pages at a time; returns how many blocks were evicted.

        NOTE: a shrink (a memory limit below what is mapped) evicts the cached blocks of pages
        none of whose blocks vLLM uses, so that an idle engine with a full prefix cache reaches
        its limit; otherwise the cache keeps every page in use and the limit is never reached.
        A shrink runs when the limit is set and, while it is pending, whenever blocks join the
        cache (a request that finishes).

        A page can only be given back once no block of it is held, so the victims are the
        cached blocks of pages on which vLLM uses no block (``_rank``). Evicting a cached block
        on a page vLLM still uses would cost a prefix hit and free no memory: such pages go
        once their requests end (their blocks join the cache, and this runs again). The
        emptied pages go back as the ledger lets them (a pin keeps a page mapped: grace for one
        build, a job's pages until it is reported; kvcached PR #598 and its review P2)."""
        alloc = self.manager.allocator
        over = alloc.in_use - alloc.limit  # pages in use beyond the limit must empty
        if over <= 0 or not self.evictable:
            return 0
        if self.eviction == "lru":
            victims = self._lru_victims(pages=over)
        else:
            whole = [p for live, p in self._rank() if not live][:over]
            victims = self._in_lru_order([b for p in whole for b in self.evictable.on_page[p]])
        self._evict(victims)
        self.shrink_evictions += len(victims)
        return len(victims)

    def _rank(self) -> list[tuple[int, int]]:
        """Pages with cached blocks, in the order their blocks are evicted, each with its count
        of live blocks: the fewest live blocks first (a page with none empties when its cached
        blocks go), then the oldest by the most recent use of any of its cached blocks (vLLM's
        LRU order, ``evictable``). O(pages with cached blocks), not O(cached blocks)."""
        held, cached = self.manager.allocated_on, self.evictable.on_page
        ranked = sorted((held(p) - len(bs), self.evictable.newest(p), p) for p, bs in cached.items())
        return [(live, p) for live, _, p in ranked]

    def _in_lru_order(self, victims: list[int]) -> list[int]:
        """``victims`` in vLLM's LRU order: evicting all of the cache then frees the blocks in
        the order it always did (the golden traces keep no cache, and stay the same bytes)."""
        if len(victims) == len(self.evictable):
            return list(self.evictable)
        return sorted(victims, key=self.evictable.stamp.__getitem__)

    def _lru_victims(self, *, pages: int = 0, blocks: int = 0) -> list[int]:
        """vLLM's order over blocks: the least recently used, until ``pages`` pages have emptied
        or ``blocks`` blocks are chosen."""
        page_of, held = self.manager.page_of, self.manager.allocated_on
        left: dict[int, int] = {}
        victims: list[int] = []
        emptied = 0
        for b in self.evictable:
            if (pages and emptied >= pages) or (blocks and len(victims) >= blocks):
                break
            p = page_of(b)
            n = left.setdefault(p, held(p)) - 1
            left[p] = n
            victims.append(b)
            emptied += not n
        return victims

    def _evict(self, victims: list[int]) -> None:
        """Evict cached blocks through vLLM (its hash map, events, metrics) and free them: a shrink
        and the cache cap both evict through vLLM's ``evict_blocks``."""
        if not victims:
            return
        evict = self._orig["evict_blocks"]  # vLLM's: _maybe_evict_cached_block for each
        blocks = self.pool.blocks
        for b in victims:
            del self.evictable[b]
            # A block released with unpin_blocks is read until reused: tell its watcher first.
            pool_seam.notify_reuse(self.pool, [blocks[b]])
            evict({b})
        self.manager.free(victims)

    def _cap_cache(self) -> None:
        """Upstream's KVCACHED_MAX_CACHED_TOKENS: beyond it, cached blocks give their pages back.

        As many blocks go as in vLLM's LRU order, but chosen by page (``_rank``: the fewest live
        blocks, then the least recently used), so that the blocks kept sit on as few pages as
        possible. An idle engine thus keeps the cap's blocks on about cap / blocks-per-page
        pages instead of one of every page it touched (upstream kvcached issue #359, fixed there
        by PR #390 in the same spirit)."""
        cap = self.max_cached_blocks
        if cap is None or len(self.evictable) <= cap:
            return
        k = len(self.evictable) - cap
        if self.eviction == "lru" or k == len(self.evictable):
            victims = self._lru_victims(blocks=k)
        else:
            victims = []
            for _, p in self._rank():
                for b in self.evictable.on_page[p]:  # a page's oldest cached blocks first
                    victims.append(b)
                    if len(victims) == k:
                        break
                if len(victims) == k:
                    break
            victims = self._in_lru_order(victims)
        self._evict(victims)


# How cached blocks are chosen for eviction. vLLM's LRU order over blocks takes a block of every
# page and empties few; "lru" keeps it, for benchmarks/bench_pages.py to compare with "page".
EVICTION = ("page", "lru")


def install_page_aware_pool(
    scheduler: Any, manager: KVCacheManager, *, max_cached_blocks: int | None = None, eviction: str = "page"
) -> PageAwarePool:
    """Back ``scheduler``'s block pool with ``manager``; call before the first request (and
    after ``install_bridge``, whose prefix-cache reset this pool's reset wraps)."""
    pool = scheduler.kv_cache_manager.block_pool
    patch = patches.by_name("page-aware block pool")
    patches.check_object(pool, patch)
    patches.check_object(pool, patches.by_name("pool seam"))
    patches.check_object(pool.free_block_queue, patches.by_name("free queue seam"))
    # free_blocks reads it after vLLM's own free has run: a vLLM without it is refused here.
    patches.check_object(pool.null_block, patches.holding(*HASH_FIELD))
    if pool.num_gpu_blocks != manager.geometry.num_blocks:
        raise ConfigError(
            f"vLLM's block pool has {pool.num_gpu_blocks} blocks, kvcached's manager {manager.geometry.num_blocks}"
        )
    if pool.free_block_queue.num_free_blocks != pool.num_gpu_blocks - 1 or manager.num_allocated:
        raise ConfigError("install the page-aware pool before the first request is scheduled")
    (null,) = manager.alloc(1)  # vLLM's null block: id 0, never freed
    if null != pool.null_block.block_id:
        raise ConfigError(f"kvcached gave block {null} for vLLM's null block {pool.null_block.block_id}")
    wrapper = PageAwarePool(pool, manager, max_cached_blocks=max_cached_blocks, eviction=eviction)
    calls = {name: getattr(wrapper, name) for name in patch.attrs}
    wrapper._orig.update(patches.shadow(pool, patch, calls))
    return wrapper
