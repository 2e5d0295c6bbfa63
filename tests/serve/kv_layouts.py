"""KV cache configs of kvcached PR #598's model kinds, made by vLLM's own sizing code."""

from __future__ import annotations

from typing import Any

import torch


def kv_config(kind: str, layout: str, *, layers: int = 4, memory: int = 48 << 20) -> tuple[Any, Any]:
    """(KVCacheConfig, KVCacheLayout) for ``kind`` in full / mla / sliding, as vLLM sizes it."""
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    vc = VllmConfig()
    vc.cache_config.kv_cache_layout = layout
    names = [f"model.layers.{i}.attn" for i in range(layers)]
    if kind == "full":
        groups = [KVCacheGroupSpec(names, FullAttentionSpec(16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16))]
    elif kind == "mla":
        groups = [KVCacheGroupSpec(names, MLAAttentionSpec(64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16))]
    elif kind == "sliding":  # gpt-oss style: full and windowed layers alternate, one group each
        full = FullAttentionSpec(16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
        window = SlidingWindowSpec(16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16, sliding_window=128)
        groups = [KVCacheGroupSpec(names[0::2], full), KVCacheGroupSpec(names[1::2], window)]
    else:
        raise ValueError(kind)
    return get_kv_cache_config_from_groups(vc, groups, memory), vc.cache_config.get_resolved_kv_cache_layout()
