"""The model kinds the scheduler harness builds, as vLLM 0.33 would lay out their KV cache.

vLLM serves more than one full-attention group: sliding windows, MLA latents and Gated DeltaNet
states too (``layer_specs``). This module turns a kind into per-layer ``KVCacheSpec``s and lets
vLLM's own planner make the rest (``plan_kv_cache``), so the harness's KV cache is the one vLLM
would plan, and what vLLM 0.33 refuses is refused here the same way, by vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import torch
from vllm.config import VllmConfig
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = ["KINDS", "KVPlan", "hybrid_block_size", "plan_kv_cache"]

# The kinds, by the model they stand for. "full" with ``sliding_window`` set keeps the harness's
# first two-group layout ([full attention, sliding window], one group each).
KINDS: Final = ("full", "gemma3", "gpt-oss", "sliding", "mla", "qwen3-next")
DEFAULT_WINDOW: Final = {"gemma3": 32, "gpt-oss": 128, "sliding": 32}
MLA_HEAD_SIZE: Final = 576  # DeepSeek-V2's kv_lora_rank 512 + qk_rope_head_dim 64
# Gated DeltaNet heads per TP rank of the tiny Qwen3-Next stand-in (key heads, value heads, head
# dims, conv kernel): its state (7,680 bytes in fp16) needs a 64-token attention block.
GDN: Final = {"k_heads": 2, "v_heads": 12, "head_dim": 16, "conv_kernel": 4}


@dataclass(frozen=True)
class KVPlan:
    """The KV cache of one kind: vLLM's config and where each layer's page sits in a block."""

    kv_cache_config: KVCacheConfig
    block_size: int  # tokens per block, the same in every group here
    block_bytes: int  # one block row: every layer slot's page
    page_bytes: int  # one layer's page (uniform across groups, as vLLM's hybrid allocator wants)
    group_layer_names: list[list[str]]
    group_offsets: list[list[int]]  # [group][layer]: the page's byte offset in a block row
    real_bytes: list[int]  # per group: the bytes of a page the model writes (no padding)
    state_groups: frozenset[int]  # Mamba groups: a block holds a state, not tokens


def hybrid_block_size(attn_page_per_token: int, mamba_page: int, kernel_block: int) -> int:
    """vLLM's ``Platform._align_hybrid_block_size``: the smallest multiple of the kernel block
    whose attention page holds a whole Mamba state."""
    return int(kernel_block * cdiv(mamba_page, kernel_block * attn_page_per_token))


def _gdn_spec(tp: int, block_size: int, mode: str, page_padded: int | None) -> MambaSpec:
    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    # Total heads scale with TP as the harness's attention heads do: each rank holds the same.
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp, GDN["k_heads"] * tp, GDN["v_heads"] * tp, GDN["head_dim"], GDN["head_dim"], GDN["conv_kernel"]
    )
    dtypes = MambaStateDtypeCalculator.gated_delta_net_state_dtype(torch.float16, "auto")
    return MambaSpec(
        shapes=tuple(tuple(s) for s in shapes),
        dtypes=tuple(dtypes),
        block_size=block_size,
        page_size_padded=page_padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=mode,
    )


def kind_block_size(kind: str, tp: int, block_size: int, num_kv_heads: int, head_size: int) -> int:
    """Tokens per block of ``kind``: the configured size, or the hybrid alignment's.

    NOTE: for the hybrid kind the attention block size and the Mamba page padding are those of
    vLLM's ``Platform._align_hybrid_block_size`` (the attention page must hold a whole state; the
    state page is padded to it), and the state shapes come from vLLM's
    ``MambaStateShapeCalculator`` (``_gdn_spec``)."""
    if kind != "qwen3-next":
        return block_size
    per_token = FullAttentionSpec(block_size=1, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.float16)
    state = _gdn_spec(tp, -1, "align", None).page_size_bytes
    return max(block_size, hybrid_block_size(per_token.page_size_bytes, state, block_size))


def layer_specs(
    kind: str,
    *,
    tp: int,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    sliding_window: int | None,
    mamba_cache_mode: str,
) -> dict[str, KVCacheSpec]:
    """Each layer's spec, in model order (vLLM groups layers by spec, so the order only names
    them). ``num_layers`` is layers per group, i.e. repeats of the kind's layer pattern.

    NOTE: Gemma3 alternates sliding-window and full layers (5:1), gpt-oss alternates full and
    128-token-window layers, Mistral has sliding layers only, DeepSeek-V2 stores one MLA latent
    vector per token (576 bytes x dtype: a block whose size is no power of two), and Qwen3-Next
    puts Gated DeltaNet state groups (``MambaSpec``) beside full attention.

    NOTE: what vLLM 0.33 refuses is refused here the same way, by vLLM. ``mamba_cache_mode`` is
    ``Literal["align", "none"]`` in ``CacheConfig`` (there is no "all"). ``MambaManager`` asserts
    "Mamba prefix caching requires mamba_cache_mode='align'" when prefix caching is on, which the
    harness always turns on (see docs/kvsim.md; vLLM's CPU build 0.32.0, which the suite also
    runs on, has no such assert)."""
    attn: dict[str, Any] = {
        "block_size": block_size,
        "num_kv_heads": num_kv_heads,
        "head_size": head_size,
        "dtype": torch.float16,
    }
    window = sliding_window or DEFAULT_WINDOW.get(kind)
    pattern: list[KVCacheSpec]
    if kind == "full":
        pattern = [FullAttentionSpec(**attn)]
        if sliding_window is not None:  # the first two-group layout: all full layers, then the sliding ones
            full = [FullAttentionSpec(**attn)] * num_layers
            sw = [SlidingWindowSpec(sliding_window=sliding_window, **attn)] * num_layers
            return {f"model.layers.{i}.self_attn.attn": s for i, s in enumerate(full + sw)}
    elif kind == "gemma3":  # five sliding layers, then one full (Gemma3's sliding_window_pattern 6)
        pattern = [SlidingWindowSpec(sliding_window=window, **attn)] * 5 + [FullAttentionSpec(**attn)]
    elif kind == "gpt-oss":  # sliding and full alternating, a 128-token window
        pattern = [SlidingWindowSpec(sliding_window=window, **attn), FullAttentionSpec(**attn)]
    elif kind == "sliding":  # Mistral: every layer sliding, one group
        pattern = [SlidingWindowSpec(sliding_window=window, **attn)]
    elif kind == "mla":  # one latent vector per token, no separate V (MLAAttentionSpec.head_size_v = 0)
        mla = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=MLA_HEAD_SIZE, dtype=torch.float16)
        pattern = [mla]
    elif kind == "qwen3-next":  # three Gated DeltaNet layers, then one full attention layer
        full = FullAttentionSpec(**attn)
        # vLLM pads the state page to the attention page (cache_config.mamba_page_size_padded).
        gdn = _gdn_spec(tp, block_size, mamba_cache_mode, full.page_size_bytes)
        pattern = [gdn, gdn, gdn, full]
    else:
        raise ValueError(f"harness: unknown model kind {kind!r}; choose from {', '.join(KINDS)}")
    layers = pattern * num_layers
    return {
        f"model.layers.{i}.{'linear_attn' if isinstance(s, MambaSpec) else 'self_attn.attn'}": s
        for i, s in enumerate(layers)
    }


def plan_kv_cache(vllm_config: VllmConfig, specs: dict[str, KVCacheSpec], num_blocks: int) -> KVPlan:
    """vLLM's grouping and layout of ``specs`` over ``num_blocks`` blocks, block-outermost.

    NOTE: ``get_kv_cache_groups`` groups the layers (one group per layer of the repeating
    pattern, so Gemma3's 5:1 is six groups). ``get_kv_cache_config_from_groups`` lays them out
    block-outermost (``BLHNC``, kvcached's contiguous layout): a block is one row holding a page
    per layer slot, and the groups overlay the same slots."""
    get_kv_cache_config_from_groups, get_kv_cache_groups = _planner()
    cache = vllm_config.cache_config
    cache.kv_cache_layout = "BLHNC"  # block-outermost: kvcached's contiguous layout
    groups = get_kv_cache_groups(vllm_config, dict(specs))
    pages = {s.page_size_bytes for g in groups for s in _specs_of(g)}
    if len(pages) != 1:
        raise ValueError(f"harness: KV groups of different page sizes {sorted(pages)} are not modelled")
    (page,) = pages
    per_block = page * max(len(g.layer_names) for g in groups)
    config = get_kv_cache_config_from_groups(vllm_config, groups, per_block * num_blocks)
    if config.num_blocks != num_blocks:
        raise ValueError(f"harness: vLLM planned {config.num_blocks} blocks, not {num_blocks}")
    offsets: dict[str, int] = {}
    block_bytes = 0
    for t in config.kv_cache_tensors:
        block_bytes = int(t.block_stride)
        for i, name in enumerate(t.layers):
            offsets[name] = int(t.offset) + i * int(t.layer_stride)
    real = []
    for g in groups:
        spec = g.kv_cache_spec
        real.append(int(spec.real_page_size_bytes))
    return KVPlan(
        kv_cache_config=config,
        block_size=int(groups[0].kv_cache_spec.block_size),
        block_bytes=block_bytes,
        page_bytes=page,
        group_layer_names=[list(g.layer_names) for g in groups],
        group_offsets=[[offsets[n] for n in g.layer_names] for g in groups],
        real_bytes=real,
        state_groups=frozenset(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)),
    )


def _planner() -> tuple[Any, Any]:
    """vLLM's ``get_kv_cache_config_from_groups`` and ``get_kv_cache_groups``, wherever this vLLM
    keeps them: 0.33 moved them to ``vllm.v1.core.kv_cache_planning``; 0.32 (0.32.0, the CPU
    build the suite also runs on) has the same two functions, same signatures, in
    ``vllm.v1.core.kv_cache_utils``."""
    try:
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:  # vLLM 0.32
        from vllm.v1.core import kv_cache_utils as planning
    return planning.get_kv_cache_config_from_groups, planning.get_kv_cache_groups


def _specs_of(group: Any) -> list[KVCacheSpec]:
    from vllm.v1.kv_cache_interface import iter_layer_specs

    return list(iter_layer_specs(group.kv_cache_spec))
