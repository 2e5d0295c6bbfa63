"""Cost of a page map and unmap through CudaVmmBackend against the raw driver calls, side by side in one run.

Four variants, each mapping then unmapping N pages of one range, in alternating order over several repetitions
(so drift in the driver or the clock hits all of them alike), median per-page microseconds reported:

- ``raw``: cuMemCreate + cuMemMap + cuMemSetAccess / cuMemUnmap + cuMemRelease, exactly as ``vmm_probe.py``;
- ``raw_zero``: the same plus the zero-page steps the backend does (map: cuMemUnmap of the zero page first;
  unmap: cuMemMap + cuMemSetAccess of the zero page after), i.e. the same driver work as the backend;
- ``backend``: ``CudaVmmBackend.map_page`` / ``unmap_page`` (zero page on, the default);
- ``backend_nozero``: the backend with ``zero_page=False``, i.e. the same driver work as ``raw``.

How to read it. The zero page is a real cost, not overhead of the Python wrapper: an unmap pays one more
map + access and a map one more unmap, so "backend vs raw" is expected well above 1.2x (the probe's figures
suggest ~1.4x for map and ~2x for unmap) and is reported as is, as "unmap incl. zero-page remap". The wrapper's
own overhead (locking, checks, the per-call context check) is "backend vs raw_zero" and "backend_nozero vs raw",
which is what the 1.2x target is about. Upstream kvcached pays the same zero-page steps (its FTensor::map unmaps
the zero page, FTensor::unmap maps it back). Ways to take them off the hot path, none done here: remap the zero
page lazily from a background thread (a stale read in the window would fault), skip it for pages the ledger
proves no late copy can reach (with the pins, I1 holds and the zero page is only a safety net), or keep a
pool of created handles so that map skips cuMemCreate and unmap skips cuMemRelease (upstream's page allocator
pre-creates pages for the same reason).

Prints a table and a JSON object; writes the JSON to $OUT/bench_backend_cuda.json too when $OUT is set.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

N_PAGES = 512
REPS = 7
TARGET = 1.2


class RawVmm:
    """The probe's calls on a range of its own; ``zero_page`` adds the backend's zero-page steps."""

    def __init__(self, cu: Any, page: int, n: int, zero_page: bool) -> None:
        self.cu, self.page, self.n, self.zero_page = cu, page, n, zero_page
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        acc = cu.CUmemAccessDesc()
        acc.location = prop.location
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.prop, self.acc = prop, [acc]
        self.va = self.ck(cu.cuMemAddressReserve(page * n, 0, 0, 0))
        self.base = int(self.va)
        self.handles: list[Any] = [None] * n
        self.zero: Any = None
        if zero_page:
            self.zero = self.ck(cu.cuMemCreate(page, prop, 0))
            for i in range(n):
                self._map_at(i, self.zero)
            self.ck(cu.cuMemsetD8(self.base, 0, page))
            self.ck(cu.cuCtxSynchronize())

    @staticmethod
    def ck(r: Any) -> Any:
        if int(r[0]) != 0:
            raise RuntimeError(f"CUDA error {r[0]}")
        return r[1] if len(r) == 2 else None

    def _map_at(self, i: int, h: Any) -> None:
        ptr = self.base + i * self.page
        self.ck(self.cu.cuMemMap(ptr, self.page, 0, h, 0))
        self.ck(self.cu.cuMemSetAccess(ptr, self.page, self.acc, 1))

    def map(self, i: int) -> None:
        h = self.ck(self.cu.cuMemCreate(self.page, self.prop, 0))
        if self.zero_page:
            self.ck(self.cu.cuMemUnmap(self.base + i * self.page, self.page))
        self._map_at(i, h)
        self.handles[i] = h

    def unmap(self, i: int) -> None:
        self.ck(self.cu.cuMemUnmap(self.base + i * self.page, self.page))
        self.ck(self.cu.cuMemRelease(self.handles[i]))
        self.handles[i] = None
        if self.zero_page:
            self._map_at(i, self.zero)

    def close(self) -> None:
        cu = self.cu
        for i in range(self.n):
            if self.handles[i] is not None or self.zero_page:
                self.ck(cu.cuMemUnmap(self.base + i * self.page, self.page))
            if self.handles[i] is not None:
                self.ck(cu.cuMemRelease(self.handles[i]))
        if self.zero is not None:
            self.ck(cu.cuMemRelease(self.zero))
        self.ck(cu.cuMemAddressFree(self.va, self.page * self.n))


def time_pass(map_fn: Callable[[int], None], unmap_fn: Callable[[int], None], n: int) -> tuple[float, float]:
    """Map pages 0..n-1, then unmap them; per-page microseconds for each half."""
    t0 = time.perf_counter()
    for i in range(n):
        map_fn(i)
    t1 = time.perf_counter()
    for i in range(n):
        unmap_fn(i)
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench_backend_cuda: no CUDA GPU visible; nothing to measure")
        return 1 if os.environ.get("KVCACHED_REQUIRE_GPU") == "1" else 0
    torch.zeros(1, device="cuda")  # CUDA initialised and the primary context current, as in a serving process
    from kvcached.backends.cuda import CudaVmmBackend, load_driver

    cu = load_driver()
    t = time.perf_counter()
    backend = CudaVmmBackend(num_pages=N_PAGES)
    reserve_us = (time.perf_counter() - t) * 1e6
    page = backend.page_bytes
    nozero = CudaVmmBackend(page_bytes=page, num_pages=N_PAGES, zero_page=False)
    raw = RawVmm(cu, page, N_PAGES, zero_page=False)
    raw_zero = RawVmm(cu, page, N_PAGES, zero_page=True)
    variants: dict[str, tuple[Callable[[int], None], Callable[[int], None]]] = {
        "raw": (raw.map, raw.unmap),
        "backend": (backend.map_page, backend.unmap_page),
        "raw_zero": (raw_zero.map, raw_zero.unmap),
        "backend_nozero": (nozero.map_page, nozero.unmap_page),
    }
    names = list(variants)
    samples: dict[str, dict[str, list[float]]] = {k: {"map": [], "unmap": []} for k in names}
    gc.disable()  # a collection inside one variant's loop would be charged to it alone
    try:
        for name in names:  # warm-up pass, not counted
            time_pass(*variants[name], N_PAGES)
        for rep in range(REPS):
            for name in names if rep % 2 == 0 else names[::-1]:
                m_us, u_us = time_pass(*variants[name], N_PAGES)
                samples[name]["map"].append(m_us)
                samples[name]["unmap"].append(u_us)
    finally:
        gc.enable()
    t = time.perf_counter()
    backend.close()
    close_us = (time.perf_counter() - t) * 1e6
    nozero.close()
    raw.close()
    raw_zero.close()

    med = {k: {op: round(statistics.median(v), 2) for op, v in ops.items()} for k, ops in samples.items()}

    def ratio(a: str, b: str, op: str) -> float:
        return round(med[a][op] / med[b][op], 3)

    ratios = {
        "map_backend_vs_raw": ratio("backend", "raw", "map"),
        "unmap_incl_zero_page_remap_backend_vs_raw": ratio("backend", "raw", "unmap"),
        "map_backend_vs_raw_zero": ratio("backend", "raw_zero", "map"),
        "unmap_backend_vs_raw_zero": ratio("backend", "raw_zero", "unmap"),
        "map_backend_nozero_vs_raw": ratio("backend_nozero", "raw", "map"),
        "unmap_backend_nozero_vs_raw": ratio("backend_nozero", "raw", "unmap"),
    }
    wrapper = [k for k in ratios if "raw_zero" in k or "nozero" in k]
    try:
        import cuda.bindings as cb

        bindings_version = str(getattr(cb, "__version__", "?"))
    except ImportError:
        bindings_version = "?"
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda_bindings": bindings_version,
        "page_bytes": page,
        "n_pages": N_PAGES,
        "reps": REPS,
        "median_us_per_page": med,
        "samples_us_per_page": {k: {op: [round(x, 2) for x in xs] for op, xs in v.items()} for k, v in samples.items()},
        "ratios": ratios,
        "target": TARGET,
        "wrapper_overhead_within_target": all(ratios[k] <= TARGET for k in wrapper),
        "backend_reserve_us_incl_zero_page_setup": round(reserve_us, 1),
        "backend_close_us": round(close_us, 1),
    }
    print(f"{'variant':<16}{'map us/page':>14}{'unmap us/page':>16}")
    for k in names:
        print(f"{k:<16}{med[k]['map']:>14.2f}{med[k]['unmap']:>16.2f}")
    for k, v in ratios.items():
        flag = "" if k not in wrapper else ("  ok" if v <= TARGET else f"  ABOVE {TARGET}x")
        print(f"{k:<44}{v:>7.3f}x{flag}")
    print("JSON " + json.dumps(result))
    out = os.environ.get("OUT")
    if out:
        Path(out, "bench_backend_cuda.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
