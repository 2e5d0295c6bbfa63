"""Tiny random models of every kind kvcached PR #598's GPU matrix served, for vLLM's CPU build.

The PR validated five model kinds on a GPU (Qwen2.5 full attention, Qwen3.5 with Gated DeltaNet,
DeepSeek-V2-Lite MLA, Gemma-4 full + sliding window, gpt-oss full + 128-token window); the served
tests here need the same kinds in seconds on two CPU cores with no hub. ``KINDS`` has those kinds
and a few more at a toy size, and ``build`` writes one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .tiny_model import train_tokenizer

# Head size 64: one the CPU attention backend supports (vllm-cpu-serve.md: 32, 64, 80, ...).
_HIDDEN, _HEADS, _KV_HEADS, _HEAD = 256, 4, 2, 64
WINDOW = 32  # tokens; well below the validation prompts' shared prefix, so blocks leave the window


@dataclass(frozen=True)
class Kind:
    """One model kind: a transformers config class at a toy size, and what vLLM builds for it.

    NOTE: each kind is one of transformers' own config classes at a toy size, so that vLLM builds
    the real model class and the real KV cache groups for it. Those are two groups for a
    sliding/full mix, one sliding group for Mistral, an MLA latent cache for DeepSeek-V2, Gated
    DeltaNet state groups beside attention for Qwen3-Next, Mamba2 states alone.
    """

    name: str
    model_type: str  # transformers' config class is found by it
    what: str  # what vLLM builds for it, in words
    config: Callable[[dict[str, Any]], dict[str, Any]]  # the common fields -> this kind's config
    std: float = 0.15  # weight init of the projections; see ``_init``


def _attention(c: dict[str, Any]) -> dict[str, Any]:
    return {
        **c,
        "hidden_size": _HIDDEN,
        "intermediate_size": 2 * _HIDDEN,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD,
    }


def _alternating(n: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "qwen2",
            "qwen2",
            "full attention (GQA), one KV group",
            lambda c: {**_attention(c), "num_hidden_layers": 4},
        ),
        Kind(
            "gemma3",
            "gemma3_text",
            f"sliding window ({WINDOW}) and full attention alternating: two KV groups",
            lambda c: {
                **_attention(c),
                "num_hidden_layers": 4,
                "sliding_window": WINDOW,
                "layer_types": _alternating(4),
                "query_pre_attn_scalar": _HEAD,
            },
        ),
        Kind(
            "gpt_oss",
            "gpt_oss",
            f"sliding window ({WINDOW}) with attention sinks and full attention, MoE: two KV groups",
            lambda c: {
                **_attention(c),
                "intermediate_size": _HIDDEN,
                "num_hidden_layers": 4,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "sliding_window": WINDOW,
                "layer_types": _alternating(4),
                # vLLM's gpt-oss reads YaRN's fields from the rope parameters (as the real checkpoint has them).
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "original_max_position_embeddings": 4096,
                    "truncate": False,
                },
            },
        ),
        Kind(
            "mistral",
            "mistral",
            f"sliding window ({WINDOW}) on every layer: one sliding-window KV group",
            lambda c: {**_attention(c), "num_hidden_layers": 4, "sliding_window": WINDOW},
        ),
        Kind(
            "deepseek_v2",
            "deepseek_v2",
            "MLA (one 576-wide latent per token and layer), dense MLP",
            lambda c: {
                **_attention(c),
                "num_hidden_layers": 2,
                "num_key_value_heads": _HEADS,
                "kv_lora_rank": 512,
                "q_lora_rank": None,
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 64,
                "v_head_dim": 64,
                "head_dim": 64,
                "first_k_dense_replace": 2,  # every layer dense: the experts are never built
                "n_routed_experts": 4,
                "n_shared_experts": 1,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 128,
            },
        ),
        Kind(
            "qwen3_next",
            "qwen3_next",
            "hybrid: 3 Gated DeltaNet layers and 1 full attention layer, MoE",
            lambda c: {
                **_attention(c),
                "num_hidden_layers": 4,
                "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 64,
                "linear_value_head_dim": 64,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 128,
                "shared_expert_intermediate_size": 128,
                "decoder_sparse_step": 1,
            },
        ),
        Kind(
            "mamba2",
            "mamba2",
            "Mamba2 states only (vLLM turns prefix caching off for it)",
            lambda c: {
                **c,
                "hidden_size": _HIDDEN,
                "num_hidden_layers": 2,
                "num_heads": 8,
                "head_dim": 64,
                "state_size": 64,
                "n_groups": 1,
                "expand": 2,
                "conv_kernel": 4,
                "chunk_size": 64,
            },
        ),
    )
}


def _init(model: Any, std: float) -> None:
    """Projections wide, embeddings narrower, norms and Mamba's decay as transformers made them.

    With transformers' init (0.02) a tiny model's next token follows from the last prompt token
    alone (the validation prompts all end in "."), so every prompt gets the same answer and a
    wrong KV block changes nothing. Wider projections make attention (and the state updates)
    outweigh the token's own embedding; norms at their init keep activations in range, and
    Mamba's ``A_log``/``dt_bias``/``D`` at theirs keep its recurrence stable.

    NOTE: the weights are seeded and wider than transformers' init so that different prompts give
    different greedy tokens (tests/serve/test_model_kinds.py checks it on each model): a witness
    that answers every prompt alike would hide a wrong KV block.
    """
    import torch

    keep = ("A_log", "dt_bias", ".D")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(keep):
                continue
            p.normal_(0.0, std / 2 if "embed" in name else std)


def build(path: str | Path, kind: str, *, seed: int = 0, max_positions: int = 4096) -> Path:
    """Write a random-weight model of ``kind`` and the shared tokenizer to ``path`` (idempotent).

    NOTE: the tokenizer is ``tiny_model``'s, so prompts tokenize the same for every kind."""
    import torch
    import transformers

    if kind not in KINDS:
        raise ValueError(f"unknown model kind {kind!r}; one of {', '.join(KINDS)}")
    out = Path(path)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out, seed=seed, max_positions=max_positions)
    k = KINDS[kind]
    common = {
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": max_positions,
        "bos_token_id": tok.token_to_id("<s>"),
        "eos_token_id": tok.token_to_id("</s>"),
        "pad_token_id": tok.token_to_id("</s>"),
        "tie_word_embeddings": False,
    }
    config = transformers.AutoConfig.for_model(k.model_type, **k.config(common))
    config.torch_dtype = "bfloat16"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _init(model, k.std)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "kvcached-kind.json").write_text(json.dumps({"kind": kind, "what": k.what, "seed": seed}))
    return out


if __name__ == "__main__":
    import sys

    print(build(sys.argv[2] if len(sys.argv) > 2 else f"/tmp/kvcached-tiny-{sys.argv[1]}", sys.argv[1]))
