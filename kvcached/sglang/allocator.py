"""SGLang's token allocators with kvcached choosing the slots, so that pages empty and go back.

SGLang's own token allocator spreads the slots of one request over the whole pool, so no page
ever empties. These subclasses ask the engine's ``KVCacheManager`` instead, which packs a request's
slots onto pages of its own and records every alloc and free in the ledger; a page is unmapped
when the ledger lets it go. They replace SGLang's classes through its plugin hooks
(``kvcached.sglang.hooks``), so the pool builder picks them without a change.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.utils import get_num_new_pages

from ..errors import ConfigError
from .boundary import refusing
from .engine import SglangEngine, engine_of


def _engine_over(kvcache: Any, page_size: int) -> SglangEngine:
    """The engine under ``kvcache``, for an allocator of ``page_size`` slots a page."""
    engine = engine_of(kvcache)
    if engine is None:
        raise ConfigError(
            f"kvcached under SGLang: the allocator's pool, {type(kvcache).__name__}, is not one kvcached puts on "
            "pages (hybrid models' pools are not supported yet); disable kvcached (ENABLE_KVCACHED=0) for this model"
        )
    if page_size != engine.page_size:
        # NOTE: SGLang's own unit tests build a page-size-1 TokenToKVPoolAllocator over a pool of
        # page_size 16; its server never does (ModelRunner builds both from --page-size). The
        # engine's blocks are the pool's pages, so such an allocator would hand out page ids as
        # slot indices: wrong KV rows, silently. Refused instead.
        raise ConfigError(
            f"kvcached under SGLang: an allocator of page size {page_size} over a {type(kvcache).__name__} of page "
            f"size {engine.page_size}; kvcached hands out the pool's pages, so both must use --page-size "
            f"{engine.page_size} (or disable kvcached: ENABLE_KVCACHED=0)"
        )
    return engine


class KvcachedTokenAllocator(TokenToKVPoolAllocator):  # type: ignore[misc]  # SGLang is untyped here
    """``TokenToKVPoolAllocator`` over a kvcached pool: slots are the engine's blocks.

    NOTE: SGLang's ``TokenToKVPoolAllocator`` (``mem_cache/allocator/token.py``, page_size 1) keeps
    its free slots in a tensor and hands out its head; freed slots go to its tail. Slots of one
    request end up spread over the whole pool and no page ever empties."""

    def __init__(self, size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool) -> None:
        with refusing():
            self._engine: SglangEngine = _engine_over(kvcache, 1)
        super().__init__(size, dtype, device, kvcache, need_sort)

    def clear(self) -> None:
        """NOTE: ``clear`` (``Scheduler.flush_cache``) frees every slot but the padding slot, so
        that the ledger sees the frees a reset makes (``engine.reset``, in both allocators)."""
        engine: SglangEngine | None = getattr(self, "_engine", None)
        self.free_group = None
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        if engine is not None:  # None: SGLang's __init__ calls clear() before anything is allocated
            engine.reset()

    def available_size(self) -> int:
        return self._engine.available_blocks()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        blocks = self._engine.alloc_blocks(need_size)
        return None if blocks is None else torch.tensor(blocks, dtype=torch.int64, device=self.device)

    def free(self, free_index: torch.Tensor) -> None:
        """NOTE: SGLang's free groups are kept as its base class defines them (``free_group_begin``
        / ``free_group_end``, ``allocator/base.py``): a free inside a group is held and freed at
        the end, in one ``free``."""
        if free_index.numel() == 0:
            return
        if self.free_group is not None:
            self.free_group.append(self._copy_for_free_group(free_index))
            return
        self._engine.bridge.free(free_index.tolist())

    def merge_and_sort_free(self) -> None:
        pass  # the manager keeps no unsorted release list


class KvcachedPagedAllocator(PagedTokenToKVPoolAllocator):  # type: ignore[misc]  # SGLang is untyped here
    """``PagedTokenToKVPoolAllocator`` over a kvcached pool: SGLang pages are the engine's blocks.

    NOTE: at ``--page-size`` above 1 SGLang builds ``PagedTokenToKVPoolAllocator``
    (``allocator/paged.py``): a request's slots are whole SGLang pages, each page a kvcached
    block. Its extend and decode placement (which slots of a request's last page come next, which
    new pages follow) is SGLang's own code. It runs over a ``free_pages`` tensor that holds
    exactly the pages kvcached allocated for the call (``get_num_new_pages`` says how many);
    frees of whole pages go to the ledger."""

    def __init__(
        self, size: int, page_size: int, dtype: torch.dtype, device: str, kvcache: Any, need_sort: bool
    ) -> None:
        with refusing():
            self._engine: SglangEngine = _engine_over(kvcache, page_size)
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)

    def clear(self) -> None:
        super().clear()
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)  # kvcached hands pages out
        engine: SglangEngine | None = getattr(self, "_engine", None)
        if engine is not None:  # None: SGLang's __init__ calls clear() before anything is allocated
            engine.reset()

    def available_size(self) -> int:
        return int(self._engine.available_blocks() * self.page_size)

    def _pages(self, n: int) -> bool:
        """Put ``n`` pages kvcached allocates into ``free_pages`` for SGLang's placement code."""
        pages = self._engine.alloc_blocks(n)
        if pages is None:
            return False
        self.free_pages = torch.tensor(pages, dtype=torch.int64, device=self.device)
        return True

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if not self._pages(need_size // self.page_size):
            return None
        out: torch.Tensor | None = super().alloc(need_size)
        return out

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: int | None = None,
    ) -> torch.Tensor | None:
        if num_new_pages is None:
            num_new_pages = int(
                get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu)
            )
        if not self._pages(num_new_pages):
            return None
        out: torch.Tensor | None = super().alloc_extend(
            prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages
        )
        return out

    def alloc_decode(
        self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
    ) -> torch.Tensor | None:
        if not self._pages(int(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True))):
            return None
        out: torch.Tensor | None = super().alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        return out

    def merge_and_sort_free(self) -> None:
        pass  # no staged pages: freed pages go to kvcached

    def _release_page_ids(self, *page_ids: torch.Tensor) -> None:
        pages = torch.cat(page_ids).tolist() if page_ids else []
        if pages:
            self._engine.bridge.free(pages)
