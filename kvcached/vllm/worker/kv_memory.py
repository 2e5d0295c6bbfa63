"""The worker's KV cache tensors, as views of kvcached pages, and the scheduler's handle on them.

vLLM allocates the KV cache as one ``torch.zeros`` buffer and cuts it into per-layer views
(``allocate_kv_cache`` in ``vllm/v1/worker/utils.py``). kvcached serves that buffer from a
backend range instead, with the views vLLM would have made (``allocate``). The scheduler, which
decides when a page goes, runs in the engine-core process. Each worker owns its range
(``worker_backend``) and applies the scheduler's decisions to it; ``attach`` is the scheduler's
handle on that range.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
from typing import TYPE_CHECKING, Any

from ...backends import Backend, HostBackend, make_backend
from ...errors import ConfigError
from ..kv_layout import KVPlan, plan, server_key
from . import step_receiver

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"

# key -> the backend this process allocated (worker side), for a scheduler in the same process.
_LOCAL: dict[str, Backend] = {}


def shm_path(key: str) -> str:
    return os.path.join(SHM_DIR, f"kvcached-kv-{key}")


def remove_stale_files() -> None:
    """Remove KV files of servers that are gone: a worker killed before the scheduler attached
    (vLLM kills workers at a failed start) leaves its file named, and tmpfs keeps it until reboot.
    The key starts with the pid of the process that made it (the API server)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        if not name.startswith("kvcached-kv-"):
            continue
        pid = name.removeprefix("kvcached-kv-").split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
        except PermissionError:
            pass  # alive, someone else's


def check_shm_room(nbytes: int) -> None:
    """Refuse at startup, not with SIGBUS mid-request, when the tmpfs cannot hold the KV cache."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError as e:
        raise ConfigError(
            f"kvcached: the host backend shares KV memory through {SHM_DIR}, which is unusable: {e}"
        ) from e
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise ConfigError(
            f"kvcached: {SHM_DIR} has {free >> 20} MiB free, the KV cache needs {nbytes >> 20} MiB; "
            "enlarge /dev/shm (docker --shm-size) or lower --kv-cache-memory-bytes"
        )


def worker_backend(p: KVPlan, *, device: torch.device, backend: str, key: str) -> Backend:
    """The range the worker's views point into: shared host memory on a CPU, VMM on a GPU.

    NOTE: each worker (one per tensor-parallel rank) owns its range and applies the scheduler's
    decisions to it before each step (``step_channel``: they ride vLLM's ``SchedulerOutput``). So
    no process but the worker touches its memory, on a CPU as on a GPU. On vLLM's CPU build the
    host backend keeps the range in a ``/dev/shm`` file named by a key every process of one
    server inherits (``SERVER_KEY_ENV``) and the worker's pid. The worker drops the name at the
    first step (``attach`` is for tests and tools that open a range from another process).
    """
    pages = p.geometry.backend_pages
    if device.type == "cpu":
        if backend == "cuda":
            raise ConfigError("kvcached: KVCACHED_BACKEND=cuda, but this vLLM worker runs on the CPU; use host or auto")
        remove_stale_files()
        check_shm_room(p.total_bytes)
        b: Backend = HostBackend(p.page_bytes, shared=shm_path(key))
        b.reserve(pages)
        atexit.register(_unlink_quietly, b)
        _LOCAL[key] = b
        return b
    if backend == "host":
        raise ConfigError(f"kvcached: KVCACHED_BACKEND=host, but this vLLM worker runs on {device}; use cuda or auto")
    b = make_backend("cuda", page_bytes=p.page_bytes, device=device.index or 0)
    b.reserve(pages)
    # vLLM profiles and warms up (CUDA graphs included) on the KV cache before any scheduler
    # exists; those writes need real pages, not the shared zero page. The scheduler's attach
    # gives them all back before the first request.
    for i in range(pages):
        b.map_page(i)
    _LOCAL[key] = b
    return b


def _unlink_quietly(b: Backend) -> None:
    if isinstance(b, HostBackend):
        b.unlink()


def allocate(
    kv_cache_config: Any,
    device: torch.device,
    layout: Any,
    kernel_block_sizes: list[int] | None,
    *,
    page_bytes: int,
    page_set: bool = True,
    backend: str = "auto",
    key: str | None = None,
) -> dict[str, torch.Tensor]:
    """What vLLM's ``allocate_kv_cache`` returns (same layers, shapes, strides), on kvcached pages.
    ``page_set``: ``page_bytes`` is the user's (``Settings.page_bytes_set``); if not, the plan may
    choose another page for the block, as the engine core's does (both know the backend's kind).

    NOTE: in vLLM's views, block ``b`` of layer ``l`` of a tensor starts at
    ``offset + l * layer_stride + b * block_stride``. kvcached builds the views with vLLM's own
    ``create_kv_cache_views``, so every layer gets the shape and strides vLLM would have given it.
    Two layouts occur:
    block-outermost (a block packs all layers: one *contiguous* region, a kvcached page holds
    whole packed blocks) and layer-outermost (each layer its own region: kvcached's *per-layer*
    layout, logical page ``p`` mapped in every region at once).

    NOTE: in the per-layer layout each layer's region is padded to whole pages, which moves where
    each layer's view starts and nothing else. The offloading worker reads storage offsets and
    strides from the views themselves, so it follows. Anything else (layers interleaved inside a
    block, groups at different offsets, host-resident tensors, blocks that do not divide a page)
    is refused with one line. A page could then hold bytes of blocks that are not all free when
    the ledger lets it go."""
    import torch
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, create_kv_cache_views

    if not kv_cache_config.kv_cache_tensors:
        return {}
    dev = torch.device(device)
    p = plan(kv_cache_config, page_bytes, backend="host" if dev.type == "cpu" else "cuda", page_set=page_set)
    served = key is None
    # Served: one range per worker process (tensor-parallel ranks share the server's key).
    key = key or f"{server_key()}-w{os.getpid()}"
    b = worker_backend(p, device=dev, backend=backend, key=key)
    if served:
        step_receiver.install_worker(b, p)
    buf = b.tensor(torch.int8)
    kv_caches: dict[str, torch.Tensor] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        placed = dataclasses.replace(tensor, size=p.total_bytes)
        if p.regions > 1:
            placed = dataclasses.replace(placed, layer_stride=p.region_bytes)
        layer_name = tensor.layers[0]
        group_id, group = next(
            (i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups) if layer_name in g.layer_names
        )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layer_name]
        if not spec.has_layer_views:
            kv_caches.update((name, buf) for name in tensor.layers)
            continue
        kernel = kernel_block_sizes[group_id] if kernel_block_sizes and group_id < len(kernel_block_sizes) else None
        # NOTE: vLLM 0.30 and 0.31's MLA specs may name a storage block size, which their
        # allocate_kv_cache views the cache with in place of the kernel's; 0.32 dropped the field.
        storage = getattr(spec, "storage_block_size", None)
        if storage is not None:
            kernel = storage
        views = create_kv_cache_views(
            buf, spec, kv_cache_config.num_blocks_of(tensor), layout, placed, kernel_block_size=kernel
        )
        kv_caches.update(zip(tensor.layers, views, strict=True))
    return kv_caches


def describe_views(kv_caches: dict[str, torch.Tensor], base: torch.Tensor) -> list[dict[str, Any]]:
    """Each layer's view as plain data (byte offset into the range, shape, strides, dtype), so a
    machine without vLLM (the GPU one) can rebuild exactly the views vLLM's code made here."""
    out = []
    for name, v in kv_caches.items():
        out.append(
            {
                "layer": name,
                "offset": v.data_ptr() - base.data_ptr(),
                "shape": list(v.shape),
                "stride": list(v.stride()),
                "dtype": str(v.dtype).removeprefix("torch."),
            }
        )
    return out


def rebuild_views(base: torch.Tensor, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The inverse of ``describe_views`` over another range of the same plan."""
    import torch

    out = {}
    for r in rows:
        dtype = getattr(torch, r["dtype"])
        size = torch.empty((), dtype=dtype).element_size()
        typed = base.view(dtype)
        out[r["layer"]] = torch.as_strided(typed, r["shape"], r["stride"], r["offset"] // size)
    return out


def local_backend(key: str) -> Backend | None:
    """The backend ``allocate`` made in this process under ``key``, if any."""
    return _LOCAL.get(key)


def release(key: str) -> None:
    """Close and forget the backend made under ``key`` (tests, and engines torn down in-process)."""
    b = _LOCAL.pop(key, None)
    if b is not None:
        _unlink_quietly(b)
        b.close()


def attach(p: KVPlan, *, key: str) -> Backend:
    """The scheduler's handle on the worker's range: the same object in one process, else the
    shared file, whose name is removed once attached (both mappings keep it alive)."""
    local = _LOCAL.get(key)
    if local is not None:
        if isinstance(local, HostBackend):  # one process on the CPU build (uni executor)
            local.unlink()
            local.unmap_all()
            return local
        import torch

        torch.cuda.synchronize()  # the warm-up's kernels are done with the pages
        for i in local.mapped_pages():  # what the worker mapped for warm-up; the manager maps anew
            local.unmap_page(i)
        return local
    path = shm_path(key)
    if not os.path.exists(path):
        raise ConfigError(
            f"kvcached: the worker's KV memory ({path}) is not there; the executor must be vLLM's "
            "multiprocessing or uniprocess one, with the worker started by this engine"
        )
    b = HostBackend(p.page_bytes, shared=path, create=False)
    b.reserve(p.geometry.backend_pages)
    b.unlink()
    # vLLM's warm-up may have written pages no block was allocated on; start from nothing.
    b.unmap_all()
    return b
