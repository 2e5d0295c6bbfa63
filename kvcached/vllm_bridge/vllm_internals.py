"""The one place where kvcached depends on vLLM's block pool beyond its public methods.

The page-aware pool (``block_pool``) decides which free blocks vLLM hands out and lets vLLM's
own ``BlockPool`` code do the handing out, so that it copies none of it. Two things that code
offers no public name for are kept here, so that a vLLM upgrade that changes them breaks in one
module, at startup (``check``) and in ``tests/vllm_scheduler/test_vllm_internals.py``:

* the seam: ``BlockPool.get_new_blocks(n)`` hands out the first ``n`` blocks of its public
  ``free_block_queue`` (``FreeKVCacheBlockQueue.popleft_n``), in queue order. kvcached moves the
  blocks it chose to the head of that queue (``remove``, ``prepend_n``, both public), then calls
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

from ..errors import ConfigError, KvcachedError

# Private attributes of vLLM's BlockPool instance that kvcached reads or calls.
PRIVATE_NAMES = ("_reuse_watchers", "_notify_reuse")
# Public names the seam relies on, for the same startup check.
SEAM_NAMES = ("free_block_queue", "get_new_blocks", "evict_blocks", "blocks", "null_block")
QUEUE_NAMES = ("remove", "prepend_n", "popleft_n", "num_free_blocks")


class SeamError(KvcachedError):
    """vLLM's ``get_new_blocks`` no longer hands out the head of its free queue: it handed out
    blocks kvcached did not choose, and this module must follow that vLLM."""


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # a stand-in pool in a test, or a broken install: the names say enough
        return "unknown"


def check(pool: Any) -> None:
    """Refuse, with one line naming the vLLM version, a block pool without what kvcached uses."""
    missing = [n for n in (*PRIVATE_NAMES, *SEAM_NAMES) if not hasattr(pool, n)]
    queue = getattr(pool, "free_block_queue", None)
    if queue is not None:
        missing += [f"free_block_queue.{n}" for n in QUEUE_NAMES if not hasattr(queue, n)]
    if missing:
        raise ConfigError(
            f"kvcached's page-aware pool does not know this vLLM's BlockPool ({_vllm_version()}): "
            f"{', '.join(missing)} missing; kvcached/vllm_bridge/vllm_internals.py must follow it, or disable kvcached"
        )


def hand_out(pool: Any, blocks: Sequence[Any], get_new_blocks: Callable[[int], list[Any]]) -> list[Any]:
    """Have vLLM's own ``get_new_blocks`` (the unwrapped method) hand out exactly ``blocks``.

    Each block must be in the free queue; the caller makes vLLM's free count its own queue's
    while this runs (vLLM checks it against ``get_num_free_blocks`` first)."""
    if not blocks:
        return []
    queue = pool.free_block_queue
    for block in blocks:
        queue.remove(block)
    queue.prepend_n(list(blocks))
    got = get_new_blocks(len(blocks))
    # First and last by identity: O(1), and enough to see a vLLM that pops from elsewhere.
    if len(got) != len(blocks) or got[0] is not blocks[0] or got[-1] is not blocks[-1]:
        raise SeamError(
            f"vLLM's BlockPool.get_new_blocks ({_vllm_version()}) did not hand out the head of its free "
            "queue; kvcached/vllm_bridge/vllm_internals.py must follow it"
        )
    return got


def notify_reuse(pool: Any, blocks: Sequence[Any]) -> None:
    """Tell the watchers of ``blocks`` (``unpin_blocks``' ``on_reuse``) that their bytes go."""
    if pool._reuse_watchers:
        pool._notify_reuse(blocks)
