"""How the page-aware pool has vLLM's own code hand out the blocks kvcached chose.

The page-aware pool (``block_pool``) decides which free blocks vLLM hands out and lets vLLM's
own ``BlockPool`` code do the handing out, so that it copies none of it. Two things that code
offers no public name for are used here (``hand_out``, ``notify_reuse``), and declared with the
names the seam relies on in the patch table's ``RELIED_ON`` (``kvcached.vllm.patches``), so that
a vLLM upgrade that changes them is refused at engine build and fails
``tests/vllm_scheduler/test_patches.py``.
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
    *,
    ids: list[int] | None = None,
    marks: list[bool] | None = None,
) -> list[Any]:
    """Have vLLM's own ``get_new_blocks`` (the unwrapped method) hand out exactly ``blocks``.

    Each block must be in the free queue; the caller makes vLLM's free count its own queue's
    while this runs (vLLM checks it against ``get_num_free_blocks`` first). The blocks that
    already lead the queue stay where they are and the others are moved in front of them, so
    the result holds ``blocks`` in another order where some were moved: which of a request's
    fresh blocks comes first means nothing to vLLM, and a move costs vLLM's ``remove`` and
    ``prepend_n`` (about 2,000 instructions a block). ``check_free`` is called with the blocks
    to move before any is moved (those left in place are in the queue: vLLM uses none of them);
    it raises if one is not free. ``ids`` (the blocks' ids, in order) and ``marks`` (one false
    item a block of the pool, left so; a list, whose items mypyc reads and sets natively) let
    it find the blocks that lead the queue out of order; without them only those leading it in
    order stay.

    NOTE: the seam: ``BlockPool.get_new_blocks(n)`` hands out the first ``n`` blocks of its
    public ``free_block_queue`` (``FreeKVCacheBlockQueue.popleft_n``), in queue order. kvcached
    moves the blocks it chose to the head of that queue (``remove``, ``prepend_n``, both public;
    skipped for those that lead it already, read from the queue's links, ``_to_move``). Then it
    calls vLLM's method, which drops their prefix-cache hashes, tells reuse watchers, counts
    references and metrics as it always does (``hand_out`` checks that it got what it chose).
    """
    if not blocks:
        return []
    queue = pool.free_block_queue
    moved, first, last = _to_move(queue, blocks, ids, marks)
    if moved:
        if check_free is not None:
            check_free(moved)
        for block in moved:
            queue.remove(block)
        queue.prepend_n(moved)
    got = get_new_blocks(len(blocks))
    # First and last by identity, and the count: O(1), and enough to see a vLLM that pops
    # elsewhere, or a run that ``_to_move`` misjudged.
    if len(got) != len(blocks) or got[0] is not first or got[-1] is not last:
        raise SeamError(
            f"vLLM's BlockPool.get_new_blocks ({vllm_version()}) did not hand out the head of its free "
            "queue; kvcached/vllm/engine_core/pool_seam.py must follow it"
        )
    return got


def _to_move(
    queue: Any, blocks: Sequence[Any], ids: list[int] | None, marks: list[bool] | None
) -> tuple[list[Any], Any, Any]:
    """Which of ``blocks`` to move to the head of vLLM's free queue, and the blocks vLLM will then
    hand out first and last: those not among the blocks that lead the queue (its first blocks up to the
    first one not in ``blocks``) are moved; none when the queue starts with all of them, in any
    order.

    That is most calls (measured on benchmarks/bench_bridge.py's prefill mix): the manager
    takes fresh pages' blocks in id order, the queue's order at start, and vLLM's
    ``free_blocks`` prepends the blocks it frees without a hash, which the manager tends to hand
    out again first; under ``WHOLE_PAGES`` a run's whole pages come first and the holes it
    fills after them often lead the queue, the same blocks in another order. Reads the queue's
    links (``FreeKVCacheBlockQueue.fake_free_list_head``, ``KVCacheBlock.next_free_block``,
    vLLM 0.32 and 0.33, ``vllm/v1/core/kv_cache_utils.py``); a vLLM without them gets every
    block moved (and one that pops elsewhere fails ``hand_out``'s check)."""
    head = getattr(queue, "fake_free_list_head", None)
    cur = getattr(head, "next_free_block", None)
    if cur is None:
        return list(blocks), blocks[0], blocks[-1]
    lead_block = cur  # what vLLM hands out first when nothing moves
    # In order first, by identity: the common case reads one link a block and marks nothing.
    n = len(blocks)
    k = 0
    last: Any = None
    while k < n and cur is blocks[k]:
        last = cur
        cur = cur.next_free_block
        k += 1
    if k == n:
        return [], lead_block, last
    if ids is None or marks is None:
        return list(blocks[k:]), blocks[k], last if k else blocks[-1]
    for i in range(k, n):
        marks[ids[i]] = True
    lead = k
    # The queue ends in a sentinel block with id -1 (``fake_free_list_tail``), whose
    # ``next_free_block`` is None: not a block of the pool (marks[-1] is the last one's mark).
    while lead < n and cur is not None:
        b: int = cur.block_id
        if b < 0 or not marks[b]:
            break
        marks[b] = False
        last = cur
        cur = cur.next_free_block
        lead += 1
    moved: list[Any] = []
    if lead < n:
        for i in range(k, n):
            b = ids[i]
            if marks[b]:
                marks[b] = False
                moved.append(blocks[i])
        if not lead:
            last = moved[-1]
    return moved, moved[0] if moved else lead_block, last


def notify_reuse(pool: Any, blocks: Sequence[Any]) -> None:
    """Tell the watchers of ``blocks`` (``unpin_blocks``' ``on_reuse``) that their bytes go.

    NOTE: the private names: giving the pages of cached blocks back beyond
    ``KVCACHED_MAX_CACHED_TOKENS`` evicts them without handing them out, and vLLM's public
    ``evict_blocks`` does not tell the watchers that ``unpin_blocks`` registered (vLLM's HiSparse
    reads such a block until it is reused). This does what ``get_new_blocks`` and
    ``reset_prefix_cache`` do for that, through ``BlockPool._reuse_watchers`` and
    ``BlockPool._notify_reuse`` (vLLM 0.32 and 0.33, ``vllm/v1/core/block_pool.py``)."""
    if pool._reuse_watchers:
        pool._notify_reuse(blocks)
