"""One SGLang engine serving the validation load, for the end-to-end tests (tests only).

``python -m kvcached.sglang.testing.serve MODEL`` starts SGLang's offline ``Engine`` on the tiny
llama, sends the load, and prints one JSON line per request: its output tokens and where its
cached tokens came from (``device``, ``host``). With ``ENABLE_KVCACHED=1`` in the environment,
kvcached's plugin puts the pool on its pages.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path


def tiny_mla(out: str | Path) -> Path:
    """The tiny DeepSeek-V2 (MLA) of ``kvcached.testing.tiny_kinds``, its config as SGLang's CPU path
    builds it: a YaRN rope of factor 1 (plain rope; ``get_rope_cpu`` has DeepSeek's YaRN only) and
    ``moe_layer_freq`` (SGLang's DeepSeek reads it; every layer is dense here anyway)."""
    from kvcached.testing.tiny_kinds import build

    path = build(out, "deepseek_v2")
    config = json.loads((path / "config.json").read_text())
    config["moe_layer_freq"] = 1
    config["rope_parameters"] = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


# The load is kvcached PR #598's validation load at tiny scale: prompts of 60 tokens, 8 greedy
# tokens each, A B C A B A (A and B come back from the host), then a flush right after a request
# (its backup may still be acknowledged later) and A again.
WORDS = ("river", "stone", "cloud", "paper", "signal", "window", "garden", "engine", "silver", "harbor")
ORDER = ("A", "B", "C", "A", "B", "A")


def prompt(name: str, n: int = 60) -> str:
    r = random.Random(name)
    return " ".join(r.choice(WORDS) for _ in range(n))


def main() -> None:
    """Serve the load and print a JSON line per request.

    NOTE: the engine runs on the CPU with ``torch_native`` attention, page_size 1 and HiCache on
    (write-through, direct copies, layer-first host pool). Its device pool is small enough that
    serving three prompts evicts the first to the host tier. ``--hold FILE`` keeps the engine up
    after the load until FILE exists, so that a test can steer it with ``kvctl``. ``--page-size N``
    serves with SGLang pages of N slots (its paged allocator) and a pool of as many slots.
    """
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--hold", metavar="FILE")
    parser.add_argument("--page-size", type=int, default=1)
    args = parser.parse_args()
    import sglang as sgl

    engine = sgl.Engine(
        model_path=args.model,
        device="cpu",
        attention_backend="torch_native",
        disable_cuda_graph=True,
        page_size=args.page_size,
        max_total_tokens=160,
        grammar_backend="none",
        log_level="warning",
        enable_hierarchical_cache=True,
        hicache_io_backend="direct",
        hicache_mem_layout="layer_first",
    )
    params = {"max_new_tokens": 8, "temperature": 0}
    try:
        for i, name in enumerate((*ORDER, "flush", "A")):
            if name == "flush":
                engine.flush_cache()
                continue
            out = engine.generate(prompt(name), params)
            meta = out["meta_info"]
            details = meta.get("cached_tokens_details") or {}
            print(
                json.dumps(
                    {
                        "i": i,
                        "name": name,
                        "output": out["output_ids"],
                        "cached": meta["cached_tokens"],
                        "device": details.get("device", 0),
                        "host": details.get("host", 0),
                    }
                ),
                flush=True,
            )
        if args.hold:  # stay up (for kvctl) until the file exists, 120 s at most
            print(json.dumps({"held": os.getpid()}), flush=True)
            deadline = time.monotonic() + 120
            while not os.path.exists(args.hold) and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
