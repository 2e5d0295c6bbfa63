"""The worker's KV tensors on CUDA pages, for kvcached PR #598's model kinds, on the GPU machine.

vLLM cannot be installed there, so ``kv_views.json`` (beside this file) carries what vLLM's own
allocation code gives on vLLM's CPU build for full attention, MLA and sliding window in the
layer- and block-outermost layouts (``tests/serve/test_kv_memory.py`` checks the file against
vLLM on every run). Here the worker-side path of the CUDA backend (``kv_memory.worker_backend``:
a VMM range of the plan's pages) takes those views: every layer gets vLLM's shape and strides,
each block's bytes lie in the VMM page its logical page names, writes read back through the
views, and closing the backend returns every byte of GPU memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gpu_env import free_bytes, require_gpu

torch = require_gpu()
pytestmark = pytest.mark.gpu

from kvcached.vllm import kv_layout  # noqa: E402
from kvcached.vllm.worker import kv_memory  # noqa: E402

ENTRIES = json.loads((Path(__file__).parent / "kv_views.json").read_text())


@pytest.mark.parametrize("entry", ENTRIES, ids=[f"{e['kind']}-{e['layout']}" for e in ENTRIES])
def test_vllm_views_on_vmm_pages(entry: dict[str, Any]) -> None:
    plan = kv_layout.KVPlan(**entry["plan"])
    geo = plan.geometry
    free_before = free_bytes()
    backend = kv_memory.worker_backend(plan, device=torch.device("cuda", 0), backend="auto", key="gpu-test")
    assert backend.kind == "cuda" and backend.num_pages == geo.backend_pages
    assert backend.mapped_count == backend.num_pages  # mapped for vLLM's warm-up
    base = backend.tensor(torch.int8)
    views = kv_memory.rebuild_views(base, entry["views"])
    try:
        assert kv_memory.describe_views(views, base) == entry["views"]  # vLLM's shapes and strides
        layers = [row["layer"] for row in entry["views"]]
        for idx, name in enumerate(layers):
            # Views come tensor by tensor; within a tensor, layer k lives in region k.
            region = idx % geo.regions
            view = views[name]
            for b in sorted({0, min(geo.blocks_per_page, geo.num_blocks - 1), geo.num_blocks - 1}):
                blk = view[b]
                start = blk.data_ptr() - base.data_ptr()
                end = start + blk.numel() * blk.element_size() - 1
                slot = region * geo.num_pages + b // geo.blocks_per_page
                assert start // plan.page_bytes == slot == end // plan.page_bytes, (name, b)
                blk.view(torch.int8).fill_((7 * idx + b) % 127 + 1)
                assert bool((blk.view(torch.int8) == (7 * idx + b) % 127 + 1).all())
        torch.cuda.synchronize()
        # The scheduler's attach (same process, uni executor) hands every page back.
        assert kv_memory.attach(plan, key="gpu-test") is backend
        assert backend.mapped_count == 0
        assert free_bytes() >= free_before - (2 << 20)  # every page went back
        assert not bool(views[layers[0]][0].view(torch.int8).any())  # unmapped: the zero page reads
    finally:
        del views, base
        kv_memory.release("gpu-test")
    assert free_bytes() >= free_before - (2 << 20)
