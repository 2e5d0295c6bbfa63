"""The KV cache manager on CUDA pages, driven by the ledger: the freed-block copy with a real
device-to-host copy under ``legacy``, and none under ``ledger``; no GPU memory left afterwards.

This is case 1 of kvcached PR #598 on a GPU: a one-token request's blocks are written, the store job is built,
the request frees its blocks, and only then does the worker copy them to host memory. Under
``legacy`` the page is unmapped at the free (the zero page shows through, as it would after the
memory went to another model); under ``ledger`` the job pin keeps it until the job is reported.
Needs msgspec on the GPU machine (scripts/gpu_check.sh installs the carried wheel).
"""

from __future__ import annotations

import pytest
from gpu_env import free_bytes, require_gpu

torch = require_gpu()
pytestmark = pytest.mark.gpu

from kvcached.backends.cuda import CudaVmmBackend  # noqa: E402
from kvcached.kv_cache_manager import KVCacheManager, KVGeometry  # noqa: E402
from kvcached.ledger.events import BuildBoundary, JobBuilt, JobKind, JobReported  # noqa: E402

MiB = 1 << 20


@pytest.mark.parametrize("policy", ["legacy", "ledger"])
def test_freed_block_copy_on_gpu(policy: str) -> None:
    before = free_bytes()
    geo = KVGeometry(num_blocks=64, block_bytes=512 * 1024, page_bytes=2 * MiB)  # 4 blocks a page
    backend = CudaVmmBackend(page_bytes=2 * MiB)
    m = KVCacheManager.standalone(geo, backend, policy=policy)
    rec, ledger = m.recorder, m.recorder.ledger
    host = None
    try:
        blocks = m.alloc(4)
        for b in blocks:
            m.block_view(b).fill_(0x5A)  # the model writes the request's KV
        torch.cuda.synchronize()
        rec.emit(JobBuilt(0, JobKind.STORE, 0, (tuple(blocks),), 1))
        rec.emit(BuildBoundary(0))
        m.free(blocks)  # finished after one token
        host = torch.empty((len(blocks), geo.block_bytes), dtype=torch.uint8, pin_memory=True)
        for i, b in enumerate(blocks):  # step 1: the worker submits the store
            host[i].copy_(m.block_view(b), non_blocking=True)
        torch.cuda.synchronize()
        rec.emit(BuildBoundary(1))
        rec.emit(JobReported(0, 1))
        values = sorted(torch.unique(host).tolist())
        print(f"{policy}: late device-to-host copy read {values}; violations {[v.code for v in ledger.violations]}")
        if policy == "legacy":
            assert values != [0x5A]
            assert [v.code for v in ledger.violations] == ["unmap-under-job"]
        else:
            assert values == [0x5A]
            assert ledger.violations == []
        assert backend.mapped_count == 0  # given back in the end, either way
    finally:
        del host
        m._bytes.clear()
        backend.close()
    after = free_bytes()
    assert abs(before - after) <= 2 * MiB, f"GPU memory not returned: {before - after} bytes"
