"""A tiny llama made on the spot: random weights and a locally trained tokenizer, no hub.

The end-to-end tests and the serving benchmark need a model that vLLM's CPU build can load in
seconds and that runs the real attention kernels, so the shapes are chosen for the CPU backend
(head size 64 is one it supports; 16 is not). Weights are seeded, so two servers started on the
same directory compute the same logits, and greedy decoding is deterministic run to run. The
tokenizer is a byte-level BPE trained on generated text, saved with ``tokenizer.json`` and a
``tokenizer_config.json`` so that ``transformers.AutoTokenizer`` (hence vLLM) loads it offline.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

WORDS = [
    "river",
    "stone",
    "cloud",
    "paper",
    "signal",
    "window",
    "garden",
    "engine",
    "silver",
    "harbor",
    "lantern",
    "meadow",
    "copper",
    "forest",
    "letter",
    "market",
    "bridge",
    "candle",
    "planet",
    "orbit",
    "thunder",
    "valley",
    "mirror",
    "ribbon",
    "anchor",
    "castle",
    "violet",
    "marble",
    "canyon",
    "feather",
    "island",
    "pepper",
    "rocket",
    "saddle",
    "tunnel",
    "velvet",
    "whistle",
    "yellow",
]


def corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 24))) + "." for _ in range(n_lines)]


def train_tokenizer(out: Path, *, seed: int = 0, vocab: int = 1024, max_positions: int = 4096) -> Any:
    """Train the byte-level BPE on ``corpus(seed=seed)`` and save it where transformers finds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus(seed=seed), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": max_positions,
                "add_bos_token": False,
            }
        )
    )
    return tok


def build(
    path: str | Path,
    *,
    hidden: int = 512,
    layers: int = 8,
    heads: int = 8,
    kv_heads: int = 8,
    vocab: int = 1024,
    max_positions: int = 4096,
    seed: int = 0,
) -> Path:
    """Write a LlamaForCausalLM with random weights and its tokenizer to ``path`` (idempotent)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    if (out / "model.safetensors").exists() and (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out, seed=seed, vocab=vocab, max_positions=max_positions)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            # Wider than the default init so that logits are not all ties: greedy tokens and
            # top-5 logprobs then depend on every KV byte, and a wrong block shows.
            p.normal_(0.0, 0.08)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    import sys

    print(build(sys.argv[1] if len(sys.argv) > 1 else "/tmp/kvcached-tiny-llama"))
