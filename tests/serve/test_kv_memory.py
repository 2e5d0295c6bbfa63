"""The worker's KV tensors on kvcached pages match vLLM's own allocation, block for page.

For kvcached PR #598's model kinds (full attention, MLA, sliding window with a full-attention group
beside it) and vLLM's layouts, KV cache configs are sized by vLLM's own code; vLLM's
``allocate_kv_cache`` and kvcached's ``allocate`` must give every layer the same shape, strides
and dtype; every block's bytes must lie in the backend page the manager's geometry names (so an
unmapped page holds no live block); writes read back; and after teardown no memory is held.
Layouts kvcached cannot serve are refused with the setting that fixes them. With a GPU, the
same runs on the CUDA backend (``-m gpu``)."""

from __future__ import annotations

import os
import uuid

import pytest
import torch
from kv_layouts import kv_config

from kvcached.errors import ConfigError
from kvcached.vllm import kv_layout
from kvcached.vllm.worker import kv_memory

KINDS = ("full", "mla", "sliding")
LAYOUTS = ("LBHNC", "BLHNC")
DEVICES = [pytest.param("cpu", id="host"), pytest.param("cuda", id="cuda", marks=pytest.mark.gpu)]


def _page_bytes(kind: str, device: str) -> int:
    # MLA's 576-wide latent makes a 64-token block 72 KiB, which divides no power of two: the
    # refusal names the page size that fits (tested below), and this is it.
    return (18 << 20) if kind == "mla" else (2 << 20)


def _offset(view: torch.Tensor, base: torch.Tensor) -> int:
    return view.data_ptr() - base.data_ptr()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", KINDS)
def test_views_match_vllm_and_sit_on_their_pages(kind: str, layout: str, device: str) -> None:
    from vllm.v1.worker.utils import allocate_kv_cache

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    cfg, lay = kv_config(kind, layout)
    dev = torch.device(device)
    native = allocate_kv_cache(cfg, dev, lay)
    page = _page_bytes(kind, device)
    key = f"test-{uuid.uuid4().hex[:8]}"
    if device == "cuda":
        free_before = torch.cuda.mem_get_info()[0]
    ours = kv_memory.allocate(cfg, dev, lay, None, page_bytes=page, backend="auto", key=key)
    backend = kv_memory.local_backend(key)
    assert backend is not None
    plan = kv_layout.plan(cfg, page)
    geo = plan.geometry
    try:
        assert ours.keys() == native.keys()
        for name, view in ours.items():
            assert view.shape == native[name].shape, name
            assert view.stride() == native[name].stride(), name
            assert view.dtype == native[name].dtype, name
            assert view.device.type == dev.type
        for i in range(backend.num_pages):
            backend.map_page(i)
        base = backend.tensor(torch.int8)
        for tensor in cfg.kv_cache_tensors:
            # Within one KV tensor, layers never share bytes; each block of each layer sits in
            # the page slot of its logical page (region r's copy of page b // blocks_per_page).
            for region, layer in enumerate(tensor.layers):
                view = ours[layer]
                for b in (0, 1, geo.blocks_per_page - 1, geo.blocks_per_page, cfg.num_blocks - 1):
                    if b >= cfg.num_blocks:
                        continue
                    blk = view[b]
                    start = _offset(blk, base)
                    end = start + blk.numel() * blk.element_size() - 1
                    slot = (region if geo.regions > 1 else 0) * geo.num_pages + b // geo.blocks_per_page
                    assert start // page == slot and end // page == slot, (layer, b, start, end, slot)
                    blk.view(torch.int8).fill_((7 * region + b) % 127 + 1)
            for region, layer in enumerate(tensor.layers):
                for b in sorted({0, min(geo.blocks_per_page, cfg.num_blocks - 1), cfg.num_blocks - 1}):
                    got = ours[layer][b].view(torch.int8)
                    assert bool((got == (7 * region + b) % 127 + 1).all()), (layer, b)
    finally:
        shared = getattr(backend, "shared", None)
        del ours
        kv_memory.release(key)
    assert backend.closed
    if shared:
        assert not os.path.exists(shared)
    if device == "cuda":
        torch.cuda.synchronize()
        assert torch.cuda.mem_get_info()[0] >= free_before - (2 << 20)
    else:
        assert backend.resident_bytes() == 0


def test_mla_block_refused_on_a_2mib_page_with_the_size_that_fits() -> None:
    cfg, _ = kv_config("mla", "LBHNC")
    with pytest.raises(ConfigError, match=r"KVCACHED_PAGE_SIZE_MB=18\b"):
        kv_layout.plan(cfg, 2 << 20)


def test_heads_outside_blocks_refused() -> None:
    cfg, _ = kv_config("full", "LHBNC")
    with pytest.raises(ConfigError, match="VLLM_KV_CACHE_LAYOUT=LBHNC"):
        kv_layout.plan(cfg, 2 << 20)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_plan_layouts(layout: str) -> None:
    cfg, _ = kv_config("full", layout)
    p = kv_layout.plan(cfg, 2 << 20)
    if layout == "LBHNC":  # a region per layer, each padded to whole pages
        assert p.regions == 4 and p.block_bytes == cfg.kv_cache_tensors[0].block_stride
        assert p.region_bytes % (2 << 20) == 0 and p.region_bytes >= cfg.num_blocks * p.block_bytes
    else:  # a block packs all layers
        assert p.regions == 1 and p.block_bytes == cfg.kv_cache_tensors[0].block_stride
    assert p.total_bytes >= cfg.kv_cache_tensors[0].size


def test_scheduler_attaches_to_the_workers_shared_memory() -> None:
    """Worker and scheduler in two processes: the scheduler's unmap frees the worker's bytes."""
    import subprocess
    import sys

    cfg, lay = kv_config("full", "LBHNC")
    key = f"test-{uuid.uuid4().hex[:8]}"
    views = kv_memory.allocate(cfg, torch.device("cpu"), lay, None, page_bytes=2 << 20, key=key)
    backend = kv_memory.local_backend(key)
    assert backend is not None
    try:
        for v in views.values():
            v.view(torch.int8)[:16].fill_(5)  # blocks 0..15 of every layer: page 0 of each region
        written = backend.resident_bytes()
        assert written >= 4 << 20  # 16 blocks of 64 KiB in each of 4 layers
        code = (
            "import sys; sys.path.insert(0, 'tests/serve');"
            "from kv_layouts import kv_config; from kvcached.vllm.worker import kv_memory;"
            "from kvcached.vllm import kv_layout;"
            f"cfg, _ = kv_config('full', 'LBHNC'); p = kv_layout.plan(cfg, 2 << 20);"
            f"b = kv_memory.attach(p, key='{key}');"
            "[b.map_page(s) for s in range(b.num_pages)]; [b.unmap_page(s) for s in range(b.num_pages)]"
        )
        subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)) + "/..")
        assert backend.resident_bytes() < written // 4
        assert int(next(iter(views.values())).view(torch.int8)[0].flatten()[0]) == 0  # reads zeros now
        assert not os.path.exists(kv_memory.shm_path(key))  # the scheduler removed the name
    finally:
        del views
        kv_memory.release(key)


FIXTURE = os.path.join(os.path.dirname(__file__), "..", "gpu", "kv_views.json")


def _fixture_entries() -> list[dict[str, object]]:
    entries = []
    for kind in KINDS:
        for layout in LAYOUTS:
            cfg, lay = kv_config(kind, layout)
            page = _page_bytes(kind, "cpu")
            key = f"fixture-{uuid.uuid4().hex[:8]}"
            views = kv_memory.allocate(cfg, torch.device("cpu"), lay, None, page_bytes=page, key=key)
            backend = kv_memory.local_backend(key)
            assert backend is not None
            try:
                plan = kv_layout.plan(cfg, page)
                rows = kv_memory.describe_views(views, backend.tensor(torch.int8))
                entries.append({"kind": kind, "layout": layout, "plan": msgspec_to_dict(plan), "views": rows})
            finally:
                del views
                kv_memory.release(key)
    return entries


def msgspec_to_dict(plan: kv_layout.KVPlan) -> dict[str, object]:
    import msgspec

    return msgspec.to_builtins(plan)  # type: ignore[no-any-return]


def test_gpu_fixture_is_what_vllm_gives() -> None:
    """tests/gpu/kv_views.json carries these views to the GPU machine, where vLLM cannot be
    installed; it must be exactly what vLLM's allocation code gives here (KVCACHED_WRITE_FIXTURE=1
    rewrites it)."""
    import json

    entries = _fixture_entries()
    if os.environ.get("KVCACHED_WRITE_FIXTURE") == "1":
        with open(FIXTURE, "w") as f:
            json.dump(entries, f, indent=1)
            f.write("\n")
    with open(FIXTURE) as f:
        assert json.load(f) == entries


def test_stale_kv_files_of_dead_servers_are_removed() -> None:
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = kv_memory.shm_path(f"{int(dead.stdout)}-{uuid.uuid4().hex[:12]}")
    live = kv_memory.shm_path(f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
    for path in (stale, live):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        kv_memory.remove_stale_files()
        assert not os.path.exists(stale)
        assert os.path.exists(live)  # this process is alive: its file stays
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)
