"""SGLang's paged allocator on kvcached (``--page-size`` above 1): SGLang's own placement, kvcached's pages.

``KvcachedPagedAllocator`` runs SGLang's extend and decode placement code over exactly the pages
kvcached allocated for the call. So it must place a batch as SGLang's own allocator does: the same
slot within a page for every token, the same tokens sharing a page; only which pages differ. And
the pages it hands out must be the manager's, freed through the ledger.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from kvcached.ledger.events import Policy
from kvcached.sglang.allocator import KvcachedPagedAllocator, KvcachedTokenAllocator
from kvcached.sglang.engine import engine_of
from kvcached.sglang.hooks import pools_on_kvcached
from kvcached.sglang.testing import gpu_only
from kvcached.sglang.testing.scenarios import config

PS = 16  # SGLang page: 16 slots of 2 heads x 8 x fp32 = 1 KiB a region; 4 to a 4 KiB kvcached page


def _pool() -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=511, page_size=PS, dtype=torch.float32, head_num=2, head_dim=8, layer_num=2, device="cpu",
        enable_memory_saver=False, enable_alt_stream=False,
    )  # fmt: skip


def _shape(out: torch.Tensor, lens: list[int]) -> list[list[tuple[int, int]]]:
    """Per request, (which of its pages, slot in the page) for each token: placement without page ids."""
    rows, start = [], 0
    for n in lens:
        pages: dict[int, int] = {}
        rows.append([(pages.setdefault(int(i) // PS, len(pages)), int(i) % PS) for i in out[start : start + n]])
        start += n
    return rows


@pytest.mark.skipif(gpu_only() is not None, reason=str(gpu_only()))
def test_it_places_a_batch_as_sglangs_allocator_does_on_pages_kvcached_maps() -> None:
    with pools_on_kvcached(msgspec.structs.replace(config(Policy.LEDGER))):
        pool = _pool()
    engine = engine_of(pool)
    assert engine is not None
    try:
        ours = KvcachedPagedAllocator(511, PS, torch.float32, "cpu", pool, need_sort=False)
        theirs = PagedTokenToKVPoolAllocator(511, PS, torch.float32, "cpu", _pool(), need_sort=False)
        engine.bridge.step()
        baseline = engine.manager.state().mapped  # the padding page, and the partial last one
        prefix, seq = torch.tensor([0, 0, 0]), torch.tensor([20, 40, 3])
        last = torch.tensor([-1, -1, -1])
        outs = [a.alloc_extend(prefix, prefix, seq, seq, last, 63) for a in (ours, theirs)]
        assert all(o is not None for o in outs)
        lens = [20, 40, 3]
        assert _shape(outs[0], lens) == _shape(outs[1], lens)
        manager = engine.manager
        pages = sorted({int(i) // PS for i in outs[0]})
        assert len(pages) == 2 + 3 + 1 and all(manager.holds(p) for p in pages)
        # One decode token each: the 40-token request's fills its third page, the others' go on.
        seq2 = seq + 1
        lasts = []
        for o in outs:
            ends = torch.cumsum(torch.tensor(lens), 0) - 1
            lasts.append(o[ends])
        dec = [a.alloc_decode(seq2, seq2, lo) for a, lo in zip((ours, theirs), lasts, strict=True)]
        assert all(d is not None for d in dec)
        assert [int(i) % PS for i in dec[0]] == [int(i) % PS for i in dec[1]] == [4, 8, 3]
        assert manager.state().mapped > baseline
        # The requests end: their pages go to the ledger, and the kvcached pages they emptied go
        # at the next step (no reserve).
        for o, d in zip(outs[:1], dec[:1], strict=True):
            ours.free(torch.cat((o, d)))
        assert not any(manager.holds(p) for p in pages)
        engine.bridge.step_done()
        engine.bridge.step()
        assert manager.state().mapped == baseline
        assert engine.ledger.violations == []
    finally:
        engine.close()


def test_an_allocator_whose_page_size_is_not_its_pools_is_refused() -> None:
    """SGLang's own unit tests build a page-size-1 token allocator over a pool of page size 16.
    kvcached hands out the pool's pages, so that allocator answered in pages as if they were
    slots: ``available_size()`` 16 where SGLang says 256, ``alloc(32)`` None, ``alloc(3)`` page
    ids. Refused in one line, for both of SGLang's allocators."""
    with pools_on_kvcached(msgspec.structs.replace(config(Policy.LEDGER))):
        pool = _pool()
    engine = engine_of(pool)
    assert engine is not None
    try:
        with pytest.raises(SystemExit) as info:
            KvcachedTokenAllocator(511, torch.float32, "cpu", pool, need_sort=False)
        assert "page size 1 over a MHATokenToKVPool of page size 16" in str(info.value)
        assert "\n" not in str(info.value)
        with pytest.raises(SystemExit, match="page size 8 over a MHATokenToKVPool of page size 16"):
            KvcachedPagedAllocator(511, 8, torch.float32, "cpu", pool, need_sort=False)
    finally:
        engine.close()
