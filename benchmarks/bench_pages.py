"""How many pages empty out: vLLM's own block pool against the page-aware pool, same workload.

vLLM hands out block ids from the head of its LRU free queue without regard to pages, so the
blocks of running requests end up scattered over the whole range and few pages are ever
entirely free; kvcached's page-aware pool fills partly used pages first. Both runs drive vLLM
0.33's real scheduler through the same seeded workload (requests arriving and finishing, random
lengths, prefix caching on) and count, after every step, the pages of ``PAGE_BLOCKS`` blocks
that hold no block in use or cached: pages an elastic allocator could give back.

    .venv-vllm/bin/python benchmarks/bench_pages.py [--seed 0] [--steps 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from typing import Any

import torch

from kvcached.backends.host import HostBackend
from kvcached.kv_cache_manager import KVGeometry
from kvcached.testing.harness import Harness, HarnessConfig
from kvcached.vllm_bridge.engine import EngineConfig, assemble

CFG = HarnessConfig(max_num_seqs=32, max_num_batched_tokens=1024, num_gpu_blocks=1024, max_model_len=2048)
# The harness's tiny model has 4 KiB blocks; pages of 16 blocks keep the block-to-page ratio of a
# small real model on 2 MiB pages (Qwen2.5-0.5B: 196 KiB blocks, 10 a page).
PAGE_BLOCKS = 16


def empty_pages(pool: Any, page_blocks: int) -> int:
    """Pages none of whose blocks is in use or in the prefix cache."""
    busy = set()
    for b in pool.blocks:
        if b.ref_cnt > 0 or b.block_hash is not None or b.is_null:
            busy.add(b.block_id // page_blocks)
    return -(-pool.num_gpu_blocks // page_blocks) - len(busy)


def run(paged: bool, seed: int, steps: int, max_cached_blocks: int | None = None) -> list[int]:
    state: dict[str, Any] = {}

    def memory(num_blocks: int, block_bytes: int) -> torch.Tensor:
        state["block_bytes"] = block_bytes
        return torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)

    def built(scheduler: Any) -> None:
        state["page_blocks"] = PAGE_BLOCKS
        if not paged:
            return
        bb = state["block_bytes"]
        g = KVGeometry(num_blocks=CFG.num_gpu_blocks, block_bytes=bb, page_bytes=bb * PAGE_BLOCKS)
        backend = HostBackend(page_bytes=g.page_bytes)
        state["backend"] = backend
        state["engine"] = assemble(scheduler, g, [backend], EngineConfig(max_cached_blocks=max_cached_blocks))

    h = Harness(CFG, kv_memory=memory, on_scheduler_built=built)
    h._forward = lambda rank, so: None  # type: ignore[method-assign]  # bytes do not matter here
    rng = random.Random(seed)
    counts = []
    try:
        for i in range(steps):
            for _ in range(rng.choice((0, 0, 1, 2))):
                h.add_request(prompt=h.make_prompt(rng.randint(16, 400), seed=rng.randrange(10**6)),
                              max_tokens=rng.randint(1, 120))
            h.step()
            counts.append(empty_pages(h.scheduler.kv_cache_manager.block_pool, state["page_blocks"]))
            del i
        assert not paged or state["engine"].pool.pool is h.scheduler.kv_cache_manager.block_pool
        return counts
    finally:
        if "engine" in state:
            state["engine"].close()
        h.close()
        if "backend" in state:
            state["backend"].close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    rows = {
        "vLLM's own pool": run(False, args.seed, args.steps),
        "page-aware, cache kept": run(True, args.seed, args.steps),
        "page-aware, cache cap 64 blocks": run(True, args.seed, args.steps, max_cached_blocks=64),
        "page-aware, no cache (PR #598's repro)": run(True, args.seed, args.steps, max_cached_blocks=0),
    }
    total = -(-CFG.num_gpu_blocks // PAGE_BLOCKS)
    print(f"pages with no block in use or cached, over {args.steps} steps (seed {args.seed}; {total} pages in all)")
    for name, c in rows.items():
        print(f"{name:36} mean {statistics.mean(c):6.1f}   median {statistics.median(c):5.0f}   min {min(c):4d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
