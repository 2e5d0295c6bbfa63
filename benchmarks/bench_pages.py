"""How many pages empty out: vLLM's own block pool against the page-aware pool, same workload.

vLLM hands out block ids from the head of its LRU free queue without regard to pages, so the
blocks of running requests end up scattered over the whole range and few pages are ever
entirely free; kvcached's page-aware pool fills partly used pages first. Both runs drive vLLM
0.33's real scheduler through the same seeded workload (requests arriving and finishing, random
lengths, prefix caching on) and count, after every step, the pages of ``PAGE_BLOCKS`` blocks
that hold no block in use or cached: pages an elastic allocator could give back.

Then eviction, page-aware against vLLM's LRU order over blocks (``eviction="lru"``), side by
side on one workload with shared prefixes (system prompts) and staggered decode lengths, which
upstream kvcached found to scatter cached blocks over pages (its issue #359): with a cache cap,
the idle footprint (pages still mapped once the load ends and the pins drain) against the
packed floor; with a memory limit lowered mid-load and again when idle, the blocks each
evicts to reach it; and for both, the prefix-cache hit rate (prompt tokens found in the GPU
prefix cache, from vLLM's own lookup) over the load.

Then placement: the manager's rules for which pages a run of blocks goes to
(``kvcached.kv_cache_manager.Placement``) side by side on decode-shaped traffic, where
fragmentation comes from: up to 128 requests decoding at once with staggered lengths (16..600
tokens), arriving for ``--steps`` steps and then finishing with no more arrivals, no prefix
cache kept (upstream's ``KVCACHED_MAX_CACHED_TOKENS=0``), 4096 blocks on 256 pages. Per rule,
over ``--seeds`` seeds: the footprint (pages mapped) while the load drains, its mean and its
sum at the end, and the same load with a memory limit lowered as the arrivals stop: the steps
until the pages mapped are within it (as many as the run if never), vLLM's preemptions, and
the tokens scheduled. Upstream kvcached's rule (the fullest page that holds the run, its
PR #390) and this project's old one (the lowest page) are rows.

    .venv-vllm/bin/python benchmarks/bench_pages.py [--seed 0] [--steps 300] [--part placement]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from typing import Any

import torch

from kvcached.backends.host import HostBackend
from kvcached.kv_cache_manager import KVGeometry, Placement
from kvcached.vllm.engine_core.engine import EngineConfig, assemble
from kvcached.vllm.testing.harness import Harness, HarnessConfig

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
    return int(-(-pool.num_gpu_blocks // page_blocks) - len(busy))


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
    rng = random.Random(seed)
    counts = []
    try:
        for i in range(steps):
            for _ in range(rng.choice((0, 0, 1, 2))):
                h.add_request(
                    prompt=h.make_prompt(rng.randint(16, 400), seed=rng.randrange(10**6)),
                    max_tokens=rng.randint(1, 120),
                )
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


# --- eviction: page-aware against vLLM's LRU order -----------------------------------------------

FAMILIES = 6  # shared system prompts


class Run:
    """One engine under the eviction workload, its figures."""

    def __init__(self, eviction: str, seed: int, cap: int | None) -> None:
        self.eviction, self.seed, self.cap = eviction, seed, cap
        self.state: dict[str, Any] = {}
        self.hits: dict[str, int] = {}  # request -> local prefix-cache hit tokens, last lookup
        self.prompt_tokens = 0
        self.h = Harness(CFG, kv_memory=self._memory, on_scheduler_built=self._built)
        kvm = self.h.scheduler.kv_cache_manager
        for name in ("get_computed_blocks", "get_computed_blocks_for_connector"):
            orig = getattr(kvm, name)

            def lookup(request: Any, *a: Any, _orig: Any = orig, **k: Any) -> Any:
                out = _orig(request, *a, **k)
                self.hits[request.request_id] = int(out[1])
                return out

            setattr(kvm, name, lookup)

    def _memory(self, num_blocks: int, block_bytes: int) -> torch.Tensor:
        self.state["block_bytes"] = block_bytes
        return torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)

    def _built(self, scheduler: Any) -> None:
        bb = self.state["block_bytes"]
        g = KVGeometry(num_blocks=CFG.num_gpu_blocks, block_bytes=bb, page_bytes=bb * PAGE_BLOCKS)
        backend = self.state["backend"] = HostBackend(page_bytes=g.page_bytes)
        self.engine = assemble(scheduler, g, [backend], EngineConfig(max_cached_blocks=self.cap))
        assert self.engine.pool is not None
        self.engine.pool.eviction = self.eviction

    def load(self, steps: int, *, limit_at: int | None = None, limit_pages: int = 0) -> None:
        """Requests with one of a few system prompts; some continue an earlier conversation
        (its prompt, what it generated, a new turn), whose blocks hit only if still cached."""
        rng = random.Random(self.seed)
        systems = [self.h.make_prompt(rng.randint(64, 256), seed=1000 + f) for f in range(FAMILIES)]
        earlier: list[tuple[list[int], str]] = []
        for i in range(steps):
            for _ in range(rng.choice((0, 0, 1, 2))):
                turn = self.h.make_prompt(rng.randint(8, 120), seed=rng.randrange(10**6))
                if earlier and rng.random() < 0.5:
                    prev, rid = earlier[-rng.randint(1, min(len(earlier), 40))]
                    prompt = prev + self.h.output_tokens(rid) + turn
                else:
                    prompt = systems[rng.randrange(FAMILIES)] + turn
                prompt = prompt[: CFG.max_model_len - 130]
                self.prompt_tokens += len(prompt)
                earlier.append((prompt, self.h.add_request(prompt=prompt, max_tokens=rng.randint(1, 120))))
            if i == limit_at:
                self.engine.set_limit_bytes(limit_pages * self.engine.page_bytes)
            self.h.step()
        self.h.run_until_idle(max_steps=2000)

    @property
    def hit_rate(self) -> float:
        return sum(self.hits.values()) / max(1, self.prompt_tokens)

    @property
    def evicted(self) -> int:
        assert self.engine.pool is not None
        return self.engine.pool.shrink_evictions

    def close(self) -> None:
        self.engine.close()
        self.h.close()
        self.state["backend"].close()


def eviction_rows(seed: int, steps: int) -> None:
    total = -(-CFG.num_gpu_blocks // PAGE_BLOCKS)
    cap = 128
    floor = -(-cap // PAGE_BLOCKS) + 1  # the cap's blocks packed, and the null block's page
    print(
        f"\neviction by page vs vLLM's LRU order over blocks (seed {seed}, {steps} steps of load, {FAMILIES} "
        f"shared system prompts, decode lengths 1..120; {total} pages of {PAGE_BLOCKS} blocks)"
    )
    print(f"{'':34}{'page-aware':>14}{'LRU':>14}")
    runs = {e: Run(e, seed, cap) for e in ("page", "lru")}
    try:
        for r in runs.values():
            r.load(steps)
        idle = {e: r.engine.memory().mapped for e, r in runs.items()}
        head = f"cap {cap} blocks: idle pages mapped"
        print(f"{head:34}{idle['page']:14d}{idle['lru']:14d}   (packed floor {floor})")
        print(f"{'  pages given back':34}{total - idle['page']:14d}{total - idle['lru']:14d}")
        hit = {e: r.hit_rate for e, r in runs.items()}
        print(f"{'  prefix-cache hit rate':34}{hit['page']:14.1%}{hit['lru']:14.1%}")
    finally:
        for r in runs.values():
            r.close()
    limit = total // 4
    runs = {e: Run(e, seed, None) for e in ("page", "lru")}
    try:
        for r in runs.values():
            r.load(steps, limit_at=steps // 2, limit_pages=limit)
        for e, r in runs.items():
            assert not r.engine.memory().shrink_pending, (e, r.engine.memory().describe())
        ev = {e: r.evicted for e, r in runs.items()}
        print(f"{f'limit {limit} pages mid-load: evicted':34}{ev['page']:14d}{ev['lru']:14d}   blocks, both reach it")
        hit = {e: r.hit_rate for e, r in runs.items()}
        print(f"{'  prefix-cache hit rate':34}{hit['page']:14.1%}{hit['lru']:14.1%}")
        kept = {e: len(r.engine.pool.evictable) for e, r in runs.items()}  # type: ignore[union-attr]
        print(f"{'  cached blocks kept at the end':34}{kept['page']:14d}{kept['lru']:14d}")
        for r in runs.values():  # idle with a full cache: a lower limit still
            r.engine.set_limit_bytes(None)
        before = {}
        for e, r in runs.items():
            r.seed += 1
            r.load(steps // 3)
            before[e] = len(r.engine.pool.evictable)  # type: ignore[union-attr]
            r.engine.pool.shrink_evictions = 0  # type: ignore[union-attr]
            r.engine.set_limit_bytes(limit // 2 * r.engine.page_bytes)
            r.h.run_until_idle()
            assert r.engine.memory().mapped <= limit // 2
        kept = {e: len(r.engine.pool.evictable) for e, r in runs.items()}  # type: ignore[union-attr]
        print(f"{f'idle, limit {limit // 2} pages: cached before':34}{before['page']:14d}{before['lru']:14d}   blocks")
        print(f"{'  cached blocks kept':34}{kept['page']:14d}{kept['lru']:14d}")
    finally:
        for r in runs.values():
            r.close()


# --- placement: which pages a run of blocks goes to -----------------------------------------------

DECODE = HarnessConfig(max_num_seqs=128, max_num_batched_tokens=2048, num_gpu_blocks=4096, max_model_len=2048)


def decode_run(placement: Placement, seed: int, load: int, drain: int, limit: int | None) -> dict[str, Any]:
    """One engine under decode-shaped traffic: arrivals (one in three steps) for ``load`` steps,
    then none for ``drain`` steps; ``limit`` pages from the end of the arrivals on, if given."""
    state: dict[str, Any] = {}

    def memory(num_blocks: int, block_bytes: int) -> torch.Tensor:
        state["block_bytes"] = block_bytes
        return torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)

    def built(scheduler: Any) -> None:
        bb = state["block_bytes"]
        g = KVGeometry(num_blocks=DECODE.num_gpu_blocks, block_bytes=bb, page_bytes=bb * PAGE_BLOCKS)
        backend = state["backend"] = HostBackend(page_bytes=g.page_bytes)
        engine = state["engine"] = assemble(scheduler, g, [backend], EngineConfig(max_cached_blocks=0))
        assert engine.manager is not None
        engine.manager.placement = placement

    h = Harness(DECODE, kv_memory=memory, on_scheduler_built=built)
    engine = state["engine"]
    rng = random.Random(seed)
    out: dict[str, Any] = {"footprint": [], "reached": load + drain, "preempted": 0, "tokens": 0}
    try:
        for i in range(load + drain):
            if i < load and rng.random() < 1 / 3:
                prompt = h.make_prompt(rng.randint(16, 300), seed=rng.randrange(10**6))
                h.add_request(prompt=prompt, max_tokens=rng.randint(16, 600))
            if i == load and limit is not None:
                engine.set_limit_bytes(limit * engine.page_bytes)
            rec = h.step()
            if rec is not None:
                out["preempted"] += len(rec.preempted_req_ids)
                out["tokens"] += sum(rec.num_scheduled_tokens.values())
            if i >= load:
                mapped = engine.memory().mapped
                out["footprint"].append(mapped)
                if limit is not None and mapped <= limit and out["reached"] == load + drain:
                    out["reached"] = i - load
        return out
    finally:
        engine.close()
        h.close()
        state["backend"].close()


def placement_rows(seeds: list[int], load: int, drain: int, limit: int) -> None:
    names = {
        Placement.WHOLE_PAGES: "whole pages, rest best fit (default)",
        Placement.BEST_FIT: "best fit (upstream #390)",
        Placement.FULLEST: "fullest page",
        Placement.LOWEST: "lowest page (the old rule)",
    }
    total = -(-DECODE.num_gpu_blocks // PAGE_BLOCKS)
    print(
        f"\nplacement on decode-shaped traffic ({load} steps of arrivals, then {drain} without; seeds "
        f"{','.join(map(str, seeds))}; {total} pages of {PAGE_BLOCKS} blocks, no prefix cache kept)"
    )
    print(f"{'':38}{'no limit':>21}{f'limit {limit} pages as the arrivals stop':>52}")
    print(f"{'rule':38}{'mean':>10}{'end':>11}{'mean':>10}{'end':>8}{'steps to it':>14}{'preempted':>11}{'tokens':>9}")
    for placement, name in names.items():
        free = [decode_run(placement, s, load, drain, None) for s in seeds]
        held = [decode_run(placement, s, load, drain, limit) for s in seeds]
        reached = [r["reached"] for r in held]
        print(
            f"{name:38}{statistics.mean(statistics.mean(r['footprint']) for r in free):10.1f}"
            f"{sum(r['footprint'][-1] for r in free):11d}"
            f"{statistics.mean(statistics.mean(r['footprint']) for r in held):10.1f}"
            f"{sum(r['footprint'][-1] for r in held):8d}"
            f"{statistics.mean(reached):9.0f} ({sum(r < load + drain for r in reached)}/{len(seeds)})"
            f"{sum(r['preempted'] for r in held):11d}{sum(r['tokens'] for r in held):9d}",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--part", choices=("all", "empty", "eviction", "placement"), default="all")
    ap.add_argument("--seeds", type=int, default=6, help="placement: seeds from --seed on")
    args = ap.parse_args()
    if args.part == "eviction":
        eviction_rows(args.seed, args.steps)
        return 0
    seeds = list(range(args.seed, args.seed + args.seeds))
    if args.part == "placement":
        placement_rows(seeds, args.steps, 400, 80)
        return 0
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
    if args.part == "all":
        eviction_rows(args.seed, args.steps)
        placement_rows(seeds, args.steps, 400, 80)
    return 0


if __name__ == "__main__":
    sys.exit(main())
