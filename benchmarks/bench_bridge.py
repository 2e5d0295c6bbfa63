"""Scheduler step time with the bridge: vLLM 0.33's ``schedule()`` + ``update_from_output()``
with 256 running requests and offloading on, side by side in one process:

* ``vllm``: vLLM's own scheduler and block pool, no kvcached;
* ``bridge``: the connector bridge feeding a ledger (journaling off), vLLM's own pool;
* ``bridge+journal``: the same, events handed to the journal service (``interval`` durability);
* ``kvcached``: the bridge and the page-aware pool over kvcached's manager (journaling off);
* ``kvcached+journal``: all of it, journaled.

Only the two scheduler calls are timed (wrapped with a counter); the harness's worker and model
stand-in run between them untimed. Every variant runs the same requests (decode steady state:
256 requests, 64-token prompts, long outputs). Run with the vLLM environment:

    .venv-vllm/bin/python benchmarks/bench_bridge.py [--steps 60] [--runs 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcached.backends.host import HostBackend
from kvcached.kv_cache_manager import KVGeometry
from kvcached.service.ledger_service import ServiceConfig
from kvcached.testing.harness import Harness, HarnessConfig
from kvcached.vllm_bridge.engine import EngineConfig, assemble

CFG = HarnessConfig(
    max_num_seqs=256, max_num_batched_tokens=8192, num_gpu_blocks=8192, max_model_len=2048, cpu_bytes_to_use=64 << 20
)
N_REQ = 256


class Timed:
    """Wraps schedule() and update_from_output() of one scheduler instance with a clock."""

    def __init__(self, scheduler: Any) -> None:
        self.total = 0.0
        self.steps = 0
        for name in ("schedule", "update_from_output"):
            orig = getattr(scheduler, name)
            setattr(scheduler, name, self._wrap(orig))

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t0

        return timed


def run_variant(variant: str, steps: int, tmp: str) -> float:
    state: dict[str, Any] = {}

    def built(scheduler: Any) -> None:
        if variant == "vllm":
            return
        g = KVGeometry(num_blocks=CFG.num_gpu_blocks, block_bytes=state["block_bytes"], page_bytes=2 << 20)
        paged = variant.startswith("kvcached")
        journal = ServiceConfig(journal=f"{tmp}/{variant}.kvj") if variant.endswith("+journal") else None
        backends = [HostBackend(page_bytes=g.page_bytes)] if paged else []
        state["backends"] = backends
        config = EngineConfig(page_aware=paged, max_reserved_pages=8, journal_service=journal)
        state["engine"] = assemble(scheduler, g, backends, config)

    def memory(num_blocks: int, block_bytes: int) -> Any:
        import torch

        state["block_bytes"] = block_bytes
        return torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)

    h = Harness(CFG, kv_memory=memory, on_scheduler_built=built)
    h._forward = lambda rank, so: None  # type: ignore[method-assign]  # the model stand-in is not what we time
    try:
        for i in range(N_REQ):
            h.add_request(prompt=h.make_prompt(64, seed=i), max_tokens=10_000)
        while len(h.scheduler.running) < N_REQ:  # prefill all, untimed
            h.step()
        for _ in range(3):
            h.step()
        timer = Timed(h.scheduler)
        gc.collect()
        for _ in range(steps):
            h.step()
        return timer.total / steps * 1e3
    finally:
        if "engine" in state:
            state["engine"].close()
        h.close()
        for b in state.get("backends", ()):
            b.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    variants = ["vllm", "bridge", "bridge+journal", "kvcached", "kvcached+journal"]
    samples: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.runs):  # interleaved, so that drift hits every variant alike
            for v in variants:
                samples[v].append(run_variant(v, args.steps, tmp))
    base = statistics.median(samples["vllm"])
    print(f"schedule()+update_from_output() per step, {N_REQ} running requests, offloading on; "
          f"median of {args.runs} runs x {args.steps} steps")
    for v in variants:
        med = statistics.median(samples[v])
        print(f"{v:18} {med:8.2f} ms   {100 * (med / base - 1):+6.1f}% vs vllm   runs: "
              + ", ".join(f"{x:.2f}" for x in samples[v]))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
