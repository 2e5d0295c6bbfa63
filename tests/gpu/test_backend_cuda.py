"""CudaVmmBackend on a real GPU: granularity, map/unmap through a torch view, the zero page behind unmapped
slots, the freed-block copy reproduced physically (a late device-to-host copy of an unmapped, re-backed page
reads the new owner's bytes; a pinned page keeps the old ones), rollback of a failing map without a leak, no
device memory left after teardown, and mapping from a thread that has no CUDA context.

Skipped without a visible GPU or without cuda-python. Reads of a slot are guarded by the backend's own slot
state first: reading an unbacked slot would fault and take the CUDA context (and every later test) down.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvcached.backends import CudaVmmBackend, make_backend
from kvcached.backends.cuda import _REAL, _ZERO, load_driver
from kvcached.errors import BackendError, ConfigError

# scripts/gpu_check.sh sets KVCACHED_REQUIRE_GPU=1: on the GPU machine a skip would read as a pass.
_REQUIRED = os.environ.get("KVCACHED_REQUIRE_GPU") == "1"
try:
    import torch
except ImportError:  # pragma: no cover - torch is in the test environment
    if _REQUIRED:
        raise
    pytest.skip("torch is not installed", allow_module_level=True)

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    if _REQUIRED:
        raise RuntimeError("KVCACHED_REQUIRE_GPU=1 but torch sees no CUDA GPU")
    pytest.skip("no CUDA GPU visible", allow_module_level=True)
try:
    cu: Any = load_driver()
except ConfigError as _e:
    if _REQUIRED:
        raise
    pytest.skip(f"cuda-python missing: {_e}", allow_module_level=True)


def _ok(result: Any) -> Any:
    err = result[0] if isinstance(result, tuple) else result
    assert int(err) == 0, f"driver call failed: {err}"
    return result[1:] if isinstance(result, tuple) else None


def free_bytes() -> int:
    """Device free memory after everything queued finished and torch's cache gave back what it holds."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    free, _total = _ok(cu.cuMemGetInfo())
    return int(free)


def values(t: torch.Tensor) -> list[int]:
    """Distinct byte values of a device slice, computed on the host so no device memory is allocated."""
    return sorted(set(torch.unique(t.cpu()).tolist()))


@pytest.fixture(scope="module", autouse=True)
def _cuda_warm() -> Iterator[None]:
    # First use of a kernel or of pinned memory loads modules and allocates driver memory; do it once here so
    # that the free-memory comparisons below see only what the backend does.
    torch.zeros(1, device="cuda")  # initialises CUDA and makes the primary context current here
    b = CudaVmmBackend(num_pages=2)
    t = b.tensor()
    b.map_page(0)
    t[: b.page_bytes].fill_(1)
    host = torch.empty(b.page_bytes, dtype=torch.uint8, pin_memory=True)
    host.copy_(t[: b.page_bytes], non_blocking=True)
    torch.cuda.synchronize()
    values(t[: b.page_bytes])
    b.unmap_page(0)
    del t, host
    b.close()
    free_bytes()
    yield


def test_granularity_and_page_size_check() -> None:
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    minimum = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    (gran,) = _ok(cu.cuMemGetAllocationGranularity(prop, minimum))
    with CudaVmmBackend() as b:
        assert b.granularity == int(gran) == b.page_bytes
    with pytest.raises(ConfigError, match="KVCACHED_PAGE_SIZE_MB"):
        CudaVmmBackend(page_bytes=int(gran) + 4096)
    with CudaVmmBackend(page_bytes=2 * int(gran), num_pages=3) as b2:
        t = b2.tensor()
        b2.map_page(1)
        p = b2.page_bytes
        t[p : 2 * p].fill_(9)
        assert values(t[p : 2 * p]) == [9]
        del t


def test_map_unmap_and_errors() -> None:
    with CudaVmmBackend(num_pages=8) as b:
        assert b.num_pages == 8 and b.mapped_count == 0
        b.map_page(3)
        assert b.is_mapped(3) and b.mapped_count == 1 and b.resident_bytes() == b.page_bytes
        with pytest.raises(BackendError, match="already mapped"):
            b.map_page(3)
        with pytest.raises(BackendError, match="not mapped"):
            b.unmap_page(4)
        with pytest.raises(BackendError, match="out of range"):
            b.map_page(8)
        b.unmap_page(3)
        assert not b.is_mapped(3) and b.mapped_count == 0
    b.close()  # idempotent
    with pytest.raises(BackendError, match="closed"):
        b.map_page(0)
    with make_backend("cuda", num_pages=1) as made:
        assert isinstance(made, CudaVmmBackend)
    with make_backend("auto", num_pages=1) as auto:
        assert isinstance(auto, CudaVmmBackend)


def test_view_writes_and_reads_through_the_range() -> None:
    with CudaVmmBackend(num_pages=8) as b:
        p = b.page_bytes
        t = b.tensor()
        assert t.is_cuda and t.numel() == 8 * p and t.data_ptr() == b._res.base
        for i in range(4):
            b.map_page(i)
        for i in range(4):
            t[i * p : (i + 1) * p].fill_(i + 1)
        torch.cuda.synchronize()
        for i in range(4):
            assert values(t[i * p : (i + 1) * p]) == [i + 1]
        h = b.tensor(torch.float16)  # a typed view of the same memory
        assert h.data_ptr() == t.data_ptr() and h.numel() == 8 * p // 2
        h[: p // 2].fill_(1.0)  # 0x3C00 little-endian: bytes 0x00, 0x3C
        assert values(t[:p]) == [0x00, 0x3C]
        # Neighbours mapping and unmapping do not disturb a mapped page.
        b.map_page(5)
        torch.cuda.synchronize()
        b.unmap_page(5)
        assert values(t[p : 2 * p]) == [2]
        del t, h


def test_unmapped_slot_reads_zeros() -> None:
    with CudaVmmBackend(num_pages=6) as b:
        p = b.page_bytes
        t = b.tensor()
        assert b._res.slots[5] == _ZERO
        assert values(t[5 * p : 6 * p]) == [0]  # never mapped: the zero page
        b.map_page(2)
        t[2 * p : 3 * p].fill_(0x5A)
        torch.cuda.synchronize()
        b.unmap_page(2)
        assert b._res.slots[2] == _ZERO
        assert values(t[2 * p : 3 * p]) == [0]  # unmapped: zeros, not the old bytes, and no fault
        del t


def test_freed_block_copy_reproduced_physically() -> None:
    with CudaVmmBackend(num_pages=4) as b:
        p = b.page_bytes
        t = b.tensor()
        host = torch.empty(p, dtype=torch.uint8, pin_memory=True)

        def late_copy(i: int, t: torch.Tensor = t, host: torch.Tensor = host) -> list[int]:
            host.copy_(t[i * p : (i + 1) * p], non_blocking=True)  # the store job that was built, not yet run
            torch.cuda.synchronize()
            return sorted(set(torch.unique(host).tolist()))

        # Legacy policy: request A's block on page 0 is freed, the emptied page unmapped at once.
        b.map_page(0)
        t[:p].fill_(7)
        torch.cuda.synchronize()
        b.unmap_page(0)
        assert late_copy(0) == [0]  # copy after the unmap: zeros (the zero page), A's KV is lost
        b.map_page(0)  # the page is re-backed for a new owner, who writes its own KV
        t[:p].fill_(42)
        torch.cuda.synchronize()
        assert late_copy(0) == [42]  # the late copy stores someone else's bytes as A's: wrong
        b.unmap_page(0)

        # Ledger policy: the job pins page 1, so it stays mapped; the new owner gets another page.
        b.map_page(1)
        t[p : 2 * p].fill_(7)
        torch.cuda.synchronize()
        b.map_page(2)
        t[2 * p : 3 * p].fill_(42)
        torch.cuda.synchronize()
        assert late_copy(1) == [7]  # the late copy reads A's bytes: right
        del late_copy, t, host


@pytest.mark.parametrize("failing", ["cuMemSetAccess", "cuMemMap"])
def test_failing_map_rolls_back_without_leak(monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    with CudaVmmBackend(num_pages=8) as b:
        p = b.page_bytes
        t = b.tensor()
        b.map_page(0)
        before = free_bytes()
        count = b.mapped_count
        real: Callable[..., Any] = getattr(cu, failing)
        calls = {"n": 0}

        def fail_once(*args: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                return (cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
            return real(*args)

        monkeypatch.setattr(cu, failing, fail_once)
        with pytest.raises(BackendError, match=rf"{failing} failed with CUDA_ERROR_OUT_OF_MEMORY.*page 1"):
            b.map_page(1)
        monkeypatch.undo()
        assert calls["n"] >= 2  # the rollback put the zero page back through the real call
        assert b.mapped_count == count and not b.is_mapped(1)
        after = free_bytes()
        assert abs(after - before) < p, f"free memory {before} -> {after}: the failed page leaked"
        assert b._res.slots[1] == _ZERO
        assert values(t[p : 2 * p]) == [0]
        b.map_page(1)  # and the slot works afterwards
        assert b._res.slots[1] == _REAL
        t[p : 2 * p].fill_(3)
        assert values(t[p : 2 * p]) == [3]
        del t


def test_no_device_memory_left_after_teardown() -> None:
    # Three full cycles, so that a leak of even a third of a page per backend (the zero page, a handle) adds up
    # past the one-page tolerance, while one-time driver bookkeeping (page tables for a reused address range)
    # does not. Cycles 0 and 2 close with a view still alive (the deferred path), cycle 1 without.
    before = free_bytes()
    allocated = torch.cuda.memory_allocated()
    p = 0
    for cycle in range(3):
        b = CudaVmmBackend(num_pages=16)
        p = b.page_bytes
        t = b.tensor()
        for i in range(8):
            b.map_page(i)
        t[: 8 * p].fill_(1)
        mapped = free_bytes()
        assert before - mapped >= 8 * p, f"cycle {cycle}: 8 mapped pages not in cuMemGetInfo: {before} -> {mapped}"
        b.unmap_page(0)
        if cycle == 1:
            del t
            b.close()
            continue
        b.close()  # a view is alive: the pages go back now, the zero page and the range stay for the view
        closed = free_bytes()
        assert before - closed <= p + p // 2, f"cycle {cycle}: only the zero page may remain: {before} -> {closed}"
        assert values(t[3 * p : 4 * p]) == [0]  # the stale view reads zeros, without a fault
        del t  # the last view: the range and the zero page go now
    after = free_bytes()
    assert abs(before - after) < p, f"device memory not back after 3 cycles: {before} -> {after}"
    assert torch.cuda.memory_allocated() == allocated


def test_map_from_a_thread_without_context() -> None:
    with CudaVmmBackend(num_pages=4) as b:
        p = b.page_bytes
        t = b.tensor()
        out: dict[str, Any] = {}

        def work() -> None:
            try:
                out["ctx_before"] = int(_ok(cu.cuCtxGetCurrent())[0])
                b.map_page(2)
                b.map_page(3)
                b.unmap_page(3)
            except BaseException as e:
                out["error"] = e

        th = threading.Thread(target=work)
        th.start()
        th.join()
        assert "error" not in out, f"{out['error']!r} (thread started with context {out.get('ctx_before')})"
        assert b.is_mapped(2) and not b.is_mapped(3)
        t[2 * p : 3 * p].fill_(11)
        assert values(t[2 * p : 3 * p]) == [11]
        assert b._res.slots[3] == _ZERO
        assert values(t[3 * p : 4 * p]) == [0]
        del t
