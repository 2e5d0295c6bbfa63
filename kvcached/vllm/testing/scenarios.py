"""Upstream kvcached PR #598's freed-block-copy scenarios on real vLLM, with kvcached's pages under the KV cache.

Each scenario drives vLLM 0.33's real ``Scheduler`` and ``OffloadingConnector`` through the
harness (real bytes, written by a model stand-in, stored to and loaded back from a CPU tier by
a worker of the project's own), with kvcached underneath (``Kvcached``), under ``legacy`` and
under ``ledger``. ``python -m kvcached.vllm.testing.scenarios --capture traces/`` runs every
scenario under both policies and writes their journals: the golden traces of ``traces/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcached.backends.host import HostBackend
from kvcached.kv_cache_manager import KVCacheManager, KVGeometry, Placement
from kvcached.ledger.events import Policy
from kvcached.ledger.ledger import Ledger
from kvcached.vllm.engine_core.block_pool import PageAwarePool
from kvcached.vllm.engine_core.bridge import Bridge
from kvcached.vllm.engine_core.engine import Engine, EngineConfig, assemble
from kvcached.vllm.testing.harness import Harness, HarnessConfig

PAGE_BLOCKS = 4  # blocks per kvcached page: small, so that pages empty out in small scenarios


class Kvcached:
    """kvcached under one harness: backends per rank, then the engine ``assemble`` builds.

    NOTE: the KV tensors are views of host backend pages, vLLM's block pool is page-aware, and the
    bridge turns connector calls into ledger events. Under ``legacy`` the allocator unmaps a page
    as soon as it is empty, as kvcached did before the offloading pins; under ``ledger`` it waits
    for the pins.
    """

    def __init__(self, policy: str, *, journal: str | None = None, max_reserved: int = 0) -> None:
        self.policy = Policy(policy)
        self.journal = journal
        self.max_reserved = max_reserved
        self.backends: list[HostBackend] = []
        self.geometry: KVGeometry | None = None
        self.engine: Engine | None = None

    def kv_memory(self, num_blocks: int, block_bytes: int) -> torch.Tensor:
        if self.geometry is None:
            page = block_bytes * PAGE_BLOCKS
            self.geometry = KVGeometry(num_blocks=num_blocks, block_bytes=block_bytes, page_bytes=page)
        g = self.geometry
        backend = HostBackend(page_bytes=g.page_bytes)
        backend.reserve(g.backend_pages)
        self.backends.append(backend)
        # One row per block from the start of the range: vLLM rebuilds packed blocks from
        # storage offset 0, and blocks never straddle pages because they divide a page.
        return backend.tensor()[: num_blocks * block_bytes].view(num_blocks, block_bytes)

    def on_scheduler_built(self, scheduler: Any) -> None:
        """Assemble the engine over the scheduler vLLM built.

        NOTE: upstream kvcached PR #598's reproduction settings are used: no cached blocks kept
        (``KVCACHED_MAX_CACHED_TOKENS=0``) and no reserved pages (``KVCACHED_MAX_RESERVED_PAGES=0``),
        so a freed page really goes back to the OS. So is upstream's placement (best fit,
        ``Placement.BEST_FIT``), whose layouts the cases were built on. Under this project's
        default, ``WHOLE_PAGES``, other pages empty, and legacy loses no byte and records no I1 in
        finished-store-next-build, finish-on-stop-token and preempt-shrink."""
        assert self.geometry is not None, "kv_memory runs before the scheduler is built"
        # Journaled inline: the same run gives the same bytes (the golden traces).
        config = EngineConfig(
            policy=self.policy, max_reserved_pages=self.max_reserved, max_cached_blocks=0, journal_path=self.journal
        )
        self.engine = assemble(scheduler, self.geometry, self.backends, config)
        if self.engine.manager is not None:  # upstream's placement (above); only the null block is placed yet
            self.engine.manager.placement = Placement.BEST_FIT

    @property
    def manager(self) -> KVCacheManager | None:
        return None if self.engine is None else self.engine.manager

    @property
    def pool(self) -> PageAwarePool | None:
        return None if self.engine is None else self.engine.pool

    @property
    def bridge(self) -> Bridge | None:
        return None if self.engine is None else self.engine.bridge

    @property
    def ledger(self) -> Ledger:
        assert self.engine is not None
        return self.engine.ledger

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        for b in self.backends:
            b.close()


@dataclass
class Outcome:
    scenario: str
    policy: str
    loads_checked: int
    wrong_blocks: int  # restored blocks whose bytes differ from what the model wrote
    zero_blocks: int  # ... of which read all zeros (the zero page / an unmapped page)
    violations: list[str]
    pinned_pages_left: int
    outstanding_jobs_left: int
    shrink_pending: bool
    steps: int
    notes: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        v = ", ".join(sorted(set(self.violations))) or "none"
        return (
            f"{self.scenario:28} {self.policy:6}: {self.loads_checked:3} restored blocks checked, "
            f"{self.wrong_blocks:3} wrong ({self.zero_blocks} all-zero); violations: {v}; "
            f"pins left {self.pinned_pages_left}, jobs left {self.outstanding_jobs_left}"
        )


# A scenario's body drives the harness; what it returns is kept as the outcome's notes.
Body = Callable[[Harness, Kvcached], "dict[str, Any] | None"]


def _run(name: str, policy: str, cfg: HarnessConfig, body: Body, journal: str | None) -> Outcome:
    kvc = Kvcached(policy, journal=journal)
    h = Harness(cfg, kv_memory=kvc.kv_memory, on_scheduler_built=kvc.on_scheduler_built)
    try:
        notes = body(h, kvc) or {}
        h.run_until_idle(max_steps=400)
        mism = h.verify_loads()
        assert kvc.manager is not None
        lg = kvc.ledger
        return Outcome(
            scenario=name,
            policy=policy,
            loads_checked=len(h.load_checks),
            wrong_blocks=len({(m.job_id, m.block_id, m.worker) for m in mism}),
            zero_blocks=len({(m.job_id, m.block_id, m.worker) for m in mism if m.all_zero}),
            violations=[f"{v.invariant} {v.code}" for v in lg.violations],
            pinned_pages_left=lg.pinned_pages,
            outstanding_jobs_left=lg.outstanding_jobs(),
            shrink_pending=kvc.manager.state().shrink_pending,
            steps=h.step_index,
            notes=notes,
        )
    finally:
        h.close()
        kvc.close()


def _twice(prompt_len: int, max_tokens: int, tp_delay: int = 0, with_output: bool = False) -> Body:
    """Store a prompt, reset the GPU prefix cache, send it again (``with_output``: followed by
    what the first request generated): its prefix loads from the CPU tier."""

    def body(h: Harness, kvc: Kvcached) -> None:
        if tp_delay:
            h.delay_worker(1, tp_delay)
        prompt = h.make_prompt(prompt_len, seed=1)
        first = h.add_request(prompt=prompt, max_tokens=max_tokens)
        h.run_until_idle()
        assert h.reset_prefix_cache()
        h.add_request(prompt=prompt + (h.output_tokens(first) if with_output else []), max_tokens=1)

    return body


def _stop_token(h: Harness, kvc: Kvcached) -> None:
    """Case 2's request, ended by a stop token instead of max_tokens (as by an EOS)."""
    prompt = h.make_prompt(70, seed=1)
    out = h.model.continuation(prompt, 11)
    assert out.index(out[10]) == 10, "the stop token must first come as the 11th output"
    first = h.add_request(prompt=prompt, max_tokens=30, stop_token_ids=[out[10]])
    h.run_until_idle()
    assert h.output_tokens(first) == out
    assert h.reset_prefix_cache()
    h.add_request(prompt=prompt + out, max_tokens=1)


def _preempt_shrink(h: Harness, kvc: Kvcached) -> dict[str, Any]:
    """Review comment P2 on kvcached PR #598: window holds of preempted requests while the limit
    is lowered and the cache reset."""
    prompts = [h.make_prompt(96, seed=s) for s in (11, 12, 13, 14)]
    for p in prompts:
        h.add_request(prompt=p, max_tokens=24)
    for _ in range(6):
        h.step()
    m, g = kvc.manager, kvc.geometry
    assert m is not None and g is not None
    limit = 9
    st = m.set_limit_pages(limit)  # another model on the GPU wants pages back
    h.reset_prefix_cache(reset_running_requests=True)  # preempts every running request
    h.step()
    after = m.state()
    h.run_until_idle(max_steps=400)  # must not deadlock: the holds go when matching drops them
    done = not m.state().shrink_pending  # before the limit is raised again
    m.set_limit_pages(g.num_pages)
    assert h.reset_prefix_cache()
    for p in prompts[:2]:
        h.add_request(prompt=p, max_tokens=2)
    return {
        "mapped_when_limited": st.mapped,
        "limit": limit,
        "shrink_after_preemption": after.waiting_on,
        "shrink_done": done,
    }


def _random_workload(seed: int, follow_up: bool = False) -> Body:
    """Twelve requests of random prompt and output lengths, half sharing a prefix, arriving
    while others run; then every prompt again after a prefix-cache reset (``follow_up``: followed
    by what its request generated, as a chat's next turn sends, so decode blocks load back too)."""

    def body(h: Harness, kvc: Kvcached) -> None:
        rng = random.Random(seed)
        shared = h.make_prompt(64, seed=seed)
        sent = []
        for i in range(12):
            p = (shared if rng.random() < 0.5 else []) + h.make_prompt(rng.randint(8, 120), seed=seed * 100 + i)
            sent.append((p, h.add_request(prompt=p, max_tokens=rng.choice((1, 1, 2, 5, 17)))))
            for _ in range(rng.randint(0, 2)):
                h.step()
        h.run_until_idle(max_steps=400)
        assert h.reset_prefix_cache()
        for p, req in sent:  # whatever reached the CPU tier is loaded back
            h.add_request(prompt=p + (h.output_tokens(req) if follow_up else []), max_tokens=1)
            h.step()

    return body


_WINDOW = HarnessConfig(sliding_window=16, max_num_batched_tokens=64)
_ASYNC = HarnessConfig(async_scheduling=True)
_BUSY = HarnessConfig(max_num_batched_tokens=128, num_gpu_blocks=96)
_BUSY_ASYNC = dataclasses.replace(_BUSY, async_scheduling=True)
_WINDOW_BUSY = HarnessConfig(sliding_window=16, max_num_batched_tokens=128, num_gpu_blocks=96)
SCENARIOS: dict[str, tuple[HarnessConfig, Body]] = {
    "finish-in-write-step": (HarnessConfig(), _twice(128, 1)),
    # Case 2 of kvcached PR #598. Under async scheduling a block is keyed only once the output of the step
    # before the one that fills it is processed (the token in its last slot comes from there),
    # so the last decode step's block (here block 5: 70 prompt + 10 fed outputs = 80 tokens)
    # would be stored by the next step; a request that reaches max_tokens is left out of that
    # step, so the store is built from finished_req_ids, in the build after the request freed
    # its blocks. (A request that stops on a stop token gets the extra step.)
    "finished-store-next-build": (_ASYNC, _twice(70, 11, with_output=True)),
    # The same request ended by a stop token: the scheduler cannot foresee it, so the request is in
    # the next step, whose build stores the block while it runs, and vLLM defers the free of its
    # blocks (defer_block_free) until that step's output is processed: case 1 again, async.
    "finish-on-stop-token": (_ASYNC, _stop_token),
    "sliding-window": (_WINDOW, _twice(111, 1)),
    "preempt-shrink": (_WINDOW_BUSY, _preempt_shrink),
    "tp2-late-report": (HarnessConfig(tp=2), _twice(128, 1, tp_delay=2)),
    **{f"random-workload-{seed}": (_BUSY, _random_workload(seed)) for seed in (1, 2, 3)},
    **{f"random-workload-async-{seed}": (_BUSY_ASYNC, _random_workload(seed, follow_up=True)) for seed in (4, 5, 6)},
}


def as_expected(out: Outcome) -> bool:
    """Legacy: a wrong restored block and an I1; ledger: every byte right, nothing violated, no pin left."""
    if out.policy == "legacy":
        return out.wrong_blocks > 0 and any(v.startswith("I1") for v in out.violations)
    return out.wrong_blocks == 0 and not out.violations and out.pinned_pages_left == 0 and not out.shrink_pending


def run(name: str, policy: str, journal: str | None = None, **config: Any) -> Outcome:
    """Run one scenario; ``config`` replaces fields of its HarnessConfig (``async_scheduling=True``)."""
    cfg, body = SCENARIOS[name]
    return _run(name, policy, dataclasses.replace(cfg, **config), body, journal)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run the real-vLLM freed-block-copy scenarios under both policies.")
    ap.add_argument("scenario", nargs="*", choices=[*SCENARIOS, []])
    ap.add_argument("--capture", metavar="DIR", help="write each run's journal to DIR/<scenario>.<policy>.kvj")
    args = ap.parse_args(argv)
    bad = 0
    for name in args.scenario or list(SCENARIOS):
        for policy in ("legacy", "ledger"):
            journal = str(Path(args.capture) / f"{name}.{policy}.kvj") if args.capture else None
            out = run(name, policy, journal)
            print(out.line())
            bad += not as_expected(out)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
