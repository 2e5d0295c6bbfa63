"""How the page-aware pool has vLLM's own code hand out the blocks kvcached chose.

The page-aware pool (``block_pool``) decides which free blocks vLLM hands out and lets vLLM's
own ``BlockPool`` code do the handing out, so that it copies none of it. Two things that code
offers no public name for are used here, and declared with the names the seam relies on in the
patch table's ``RELIED_ON`` (``kvcached.vllm.patches``), so that a vLLM upgrade that changes them is
refused at engine build and fails ``tests/vllm_scheduler/test_patches.py``:

* the seam: ``BlockPool.get_new_blocks(n)`` hands out the first ``n`` blocks of its public
  ``free_block_queue`` (``FreeKVCacheBlockQueue.popleft_n``), in queue order. kvcached moves the
  blocks it chose to the head of that queue (``remove``, ``prepend_n``, both public; skipped when
  they are its head already, read from the queue's links, ``_at_head``), then calls
  vLLM's method, which drops their prefix-cache hashes, tells reuse watchers, counts
  references and metrics as it always does (``hand_out`` checks that it got what it chose);
* the private names: giving the pages of cached blocks back beyond ``KVCACHED_MAX_CACHED_TOKENS``
  evicts them without handing them out, and vLLM's public ``evict_blocks`` does not tell the
  watchers that ``unpin_blocks`` registered (vLLM's HiSparse reads such a block until it is
  reused). ``notify_reuse`` does what ``get_new_blocks`` and ``reset_prefix_cache`` do for that,
  through ``BlockPool._reuse_watchers`` and ``BlockPool._notify_reuse`` (vLLM 0.32 and 0.33,
  ``vllm/v1/core/block_pool.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..patches import PatchError, vllm_version


class SeamError(PatchError):
    """vLLM's ``get_new_blocks`` no longer hands out the head of its free queue: it handed out
    blocks kvcached did not choose, and this module must follow that vLLM."""


def hand_out(
    pool: Any,
    blocks: Sequence[Any],
    get_new_blocks: Callable[[int], list[Any]],
    check_free: Callable[[Sequence[Any]], None] | None = None,
) -> list[Any]:
    """Have vLLM's own ``get_new_blocks`` (the unwrapped method) hand out exactly ``blocks``.

    Each block must be in the free queue; the caller makes vLLM's free count its own queue's
    while this runs (vLLM checks it against ``get_num_free_blocks`` first). ``check_free`` is
    called with ``blocks`` before any is moved, unless they already are the queue's head (then
    each is in the queue: vLLM uses none of them); it raises if one is not free."""
    if not blocks:
        return []
    queue = pool.free_block_queue
    in_place = _at_head(queue, blocks)
    if not in_place:
        if check_free is not None:
            check_free(blocks)
        for block in blocks:
            queue.remove(block)
        queue.prepend_n(list(blocks))
    got = get_new_blocks(len(blocks))
    # First and last by identity: O(1), and enough to see a vLLM that pops from elsewhere.
    if len(got) != len(blocks) or got[0] is not blocks[0] or got[-1] is not blocks[-1]:
        raise SeamError(
            f"vLLM's BlockPool.get_new_blocks ({vllm_version()}) did not hand out the head of its free "
            "queue; kvcached/vllm/engine_core/pool_seam.py must follow it"
        )
    return got


def _at_head(queue: Any, blocks: Sequence[Any]) -> bool:
    """Whether ``blocks`` already are the head of vLLM's free queue, in order: then moving them
    there is a no-op. It is the common case (measured on benchmarks/bench_bridge.py: 98% of the
    blocks handed out on its prefill mix, all of them on its decode): the manager takes fresh
    pages' blocks in id order, the queue's order at start, and vLLM's ``free_blocks`` prepends
    the blocks it frees without a hash, which the manager tends to hand out again first. Reads the
    queue's links (``FreeKVCacheBlockQueue.fake_free_list_head``, ``KVCacheBlock.
    next_free_block``, vLLM 0.32 and 0.33, ``vllm/v1/core/kv_cache_utils.py``); a vLLM without
    them gets the move (and one that pops elsewhere fails ``hand_out``'s check either way)."""
    head = getattr(queue, "fake_free_list_head", None)
    cur = getattr(head, "next_free_block", None)
    if cur is None:
        return False
    for block in blocks:
        if cur is not block:
            return False
        cur = block.next_free_block
    return True


def notify_reuse(pool: Any, blocks: Sequence[Any]) -> None:
    """Tell the watchers of ``blocks`` (``unpin_blocks``' ``on_reuse``) that their bytes go."""
    if pool._reuse_watchers:
        pool._notify_reuse(blocks)
