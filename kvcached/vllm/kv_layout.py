"""Where vLLM's KV blocks sit in kvcached's pages: the plan every vLLM process agrees on.

``plan`` reads vLLM's KV cache layout from its ``KVCacheConfig`` and says how kvcached's range
holds it, or refuses it with one line. The API server (its startup checks), the engine core (the
manager's geometry) and each worker (its views) compute the same plan from the same config, so
they agree on which page a block is on without talking.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import msgspec

from ..errors import ConfigError
from ..kv_cache_manager import KVGeometry, Layout
from ..page_size import PageChoice, choose_page

SERVER_KEY_ENV = "KVCACHED_SERVER_KEY"


class KVPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Where vLLM's blocks sit in kvcached's range."""

    num_blocks: int
    block_bytes: int  # bytes of one block in one region (the whole packed block if contiguous)
    page_bytes: int
    regions: int  # 1 (contiguous) or the number of layers (per-layer)
    vllm_size: int  # the backing size vLLM asked for

    @property
    def geometry(self) -> KVGeometry:
        layout = Layout.PER_LAYER if self.regions > 1 else Layout.CONTIGUOUS
        return KVGeometry(
            num_blocks=self.num_blocks,
            block_bytes=self.block_bytes,
            page_bytes=self.page_bytes,
            num_layers=self.regions,
            layout=layout,
        )

    @property
    def region_bytes(self) -> int:
        return self.geometry.num_pages * self.page_bytes

    @property
    def total_bytes(self) -> int:
        return self.region_bytes * self.regions

    def describe(self) -> str:
        g = self.geometry
        kind = f"per-layer x{self.regions}" if self.regions > 1 else "contiguous"
        return f"{g.num_blocks} blocks of {self.block_bytes} B on {g.num_pages} pages ({kind})"


def plan(kv_cache_config: Any, page_bytes: int, *, backend: str = "cuda", page_set: bool = True) -> KVPlan:
    """Check vLLM's KV cache layout against kvcached's and say where each block lives.

    ``backend`` ("host" or "cuda") is where the pages live; ``page_set`` says ``page_bytes`` is
    the user's page (``Settings.page_bytes_set``), else it is the default and kvcached may choose
    another that fits the block (``page_size.choose_page``). The defaults take the page as given,
    as tests and tools that name a page mean it.

    NOTE: vLLM allocates the KV cache as one buffer cut into per-layer views
    (``allocate_kv_cache`` in ``vllm/v1/worker/utils.py``): block ``b`` of layer ``l`` of a tensor
    starts at ``offset + l * layer_stride + b * block_stride``. kvcached's range holds it
    block-outermost (a block packs all layers: one *contiguous* region, a page holds whole packed
    blocks) or layer-outermost (each layer its own region, logical page ``p`` mapped in every
    region at once). Anything else is refused with one line, because a page could then hold
    bytes of blocks that are not all free when the ledger lets it go.

    NOTE: the processes agree on the page itself too: it is the user's ``KVCACHED_PAGE_SIZE_MB``
    or, when that is unset and the block does not divide the default page, one
    ``page_size.choose_page`` picks for the backend the pages live on (every process passes the
    same backend and setting)."""
    return plan_page(kv_cache_config, page_bytes, backend=backend, page_set=page_set)[0]


def plan_page(
    kv_cache_config: Any, page_bytes: int, *, backend: str = "cuda", page_set: bool = True
) -> tuple[KVPlan, PageChoice]:
    """``plan``, and the page choice behind it (what the engine core logs)."""
    tensors = list(kv_cache_config.kv_cache_tensors)
    if not tensors:
        raise ConfigError("kvcached: this model has no KV cache tensors to serve; disable kvcached (ENABLE_KVCACHED=0)")
    if any(getattr(t, "host_resident", False) for t in tensors):
        raise ConfigError("kvcached: host-resident KV tensors (HiSparse) are not supported; disable kvcached")
    strides = {(int(t.layer_stride), int(t.block_stride)) for t in tensors}
    offsets = {int(t.offset) for t in tensors}
    if len(strides) != 1 or offsets != {0}:
        raise ConfigError(
            f"kvcached: KV tensors with different strides or offsets ({sorted(strides)}, offsets {sorted(offsets)}) "
            "are not supported; set VLLM_KV_CACHE_LAYOUT to a layer-outermost layout (e.g. LBHNC) or disable kvcached"
        )
    ((layer_stride, block_stride),) = strides
    layers = max(len(t.layers) for t in tensors)
    n = int(kv_cache_config.num_blocks)
    page_l = max(_layer_page_bytes(kv_cache_config, t.layers[0]) for t in tensors)
    if page_l > min(block_stride, layer_stride if layers > 1 else block_stride):
        raise ConfigError(
            f"kvcached: this KV layout splits one layer's block ({page_l} B) into pieces {block_stride} B apart "
            "(heads outside blocks); set VLLM_KV_CACHE_LAYOUT=LBHNC or disable kvcached"
        )
    if layers == 1 or layer_stride < block_stride:
        regions, block_bytes = 1, block_stride  # a block packs every layer
        if layers > 1 and (layers - 1) * layer_stride >= block_stride:
            raise ConfigError(
                f"kvcached: KV layout with layer stride {layer_stride} and block stride {block_stride} "
                "interleaves blocks; set VLLM_KV_CACHE_LAYOUT=LBHNC or disable kvcached"
            )
    elif layer_stride >= n * block_stride:
        regions, block_bytes = layers, block_stride
    else:
        raise ConfigError(
            f"kvcached: KV layout with layer stride {layer_stride} < {n} blocks x {block_stride} B interleaves "
            "layers inside a block; set VLLM_KV_CACHE_LAYOUT=LBHNC or disable kvcached"
        )
    # vLLM puts a region's blocks end to end, so a page must be a multiple of the block.
    choice = choose_page(
        block_bytes, backend=backend, page_bytes=page_bytes, page_set=page_set, tokens=_scaling_tokens(kv_cache_config)
    )
    p = KVPlan(
        num_blocks=n,
        block_bytes=block_bytes,
        page_bytes=choice.page_bytes,
        regions=regions,
        vllm_size=max(int(t.size) for t in tensors),
    )
    return p, choice


def _scaling_tokens(kv_cache_config: Any) -> int | None:
    """The block size in tokens if every group's block grows with it (unpadded attention), so
    that a smaller ``--block-size`` makes a smaller block; None otherwise (a Mamba state's size
    does not depend on it, and vLLM pads hybrid models' pages to one size)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, UniformTypeKVCacheSpecs

    sizes = set()
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        specs = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        for s in specs:
            if not isinstance(s, AttentionSpec) or s.page_size_padded is not None:
                return None
            if getattr(s, "tokens_per_state", 1) != 1:
                return None
            sizes.add(int(s.block_size))
    return sizes.pop() if len(sizes) == 1 else None


def _layer_page_bytes(kv_cache_config: Any, layer: str) -> int:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    for group in kv_cache_config.kv_cache_groups:
        if layer in group.layer_names:
            spec = group.kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[layer]
            return int(spec.page_size_bytes)
    raise ConfigError(f"kvcached: KV tensor layer {layer} is in no KV cache group")


def server_key() -> str:
    """The key naming this server's shared KV memory; made once and inherited by child processes.

    NOTE: it names one server's shared host memory; it is made in the API server and inherited
    by every child."""
    key = os.environ.get(SERVER_KEY_ENV)
    if not key:
        key = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        os.environ[SERVER_KEY_ENV] = key
    return key
