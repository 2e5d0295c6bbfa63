"""Run one kvsim case under one variant: vLLM's real scheduler and connector, kvcached below.

The harness (``kvcached.vllm.testing.harness``) runs vLLM 0.33's ``Scheduler`` or ``AsyncScheduler``
with the ``OffloadingConnector`` on both sides and a worker that copies real bytes. This module
puts under it what the variant asks for (``_Kvcached``) and plays the case's actions:

* ``ledger``: kvcached as shipped, on host backends in checking mode;
* ``legacy``: a page goes as soon as it is empty: the known-bad baseline every check must be able to trip on;
* ``never-unmap``: no page's memory is given back: a failure here too is not about unmapping;
* ``vllm``: vLLM alone: a failure here too is vLLM's.

The memory checks are in ``memory``; the ledger's own invariants are read from its violations.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from vllm.v1.request import RequestStatus

from kvcached.backends.host import HostBackend
from kvcached.errors import KvcachedError
from kvcached.kv_cache_manager import KVGeometry
from kvcached.ledger.events import Policy
from kvcached.ledger.findings import plural
from kvcached.vllm.engine_core.engine import Engine, EngineConfig, assemble
from kvcached.vllm.testing.harness import Harness, HarnessConfig
from kvsim.on_vllm.draw import (
    BLOCK_SIZE,
    KINDS,
    Abort,
    Add,
    Case,
    Limit,
    Reset,
    Step,
    groups,
    request_tokens,
)
from kvsim.on_vllm.memory import MemoryChecks
from kvsim.on_vllm.result import Coverage, Findings, SeedResult


class _KeepingBackend(HostBackend):
    """A host backend that never gives a page's memory back: the ``never-unmap`` variant."""

    def _unmap(self, index: int) -> None:
        return None


class _Kvcached:
    """kvcached under one harness, as the case's configuration says.

    NOTE: what each variant puts under the harness. ``ledger``: kvcached as shipped (page-aware
    pool, bridge, ledger policy) on host backends in checking mode, so an access to an unmapped
    page is detected. ``legacy``: the same with the legacy policy (a page goes as soon as it is
    empty). ``never-unmap``: the ledger policy over backends that keep every page's memory (an
    unmap is recorded but gives nothing back). ``vllm`` builds none: vLLM alone, with its own
    block pool over plain memory."""

    def __init__(self, case: Case, variant: str, journal: str | None) -> None:
        self.case, self.variant, self.journal = case, variant, journal
        self.backends: list[HostBackend] = []
        self.geometry: KVGeometry | None = None
        self.engine: Engine | None = None

    def kv_memory(self, num_blocks: int, block_bytes: int) -> torch.Tensor:
        if self.geometry is None:
            page = block_bytes * self.case.config.page_blocks
            self.geometry = KVGeometry(num_blocks=num_blocks, block_bytes=block_bytes, page_bytes=page)
        g = self.geometry
        if self.variant == "never-unmap":
            backend: HostBackend = _KeepingBackend(page_bytes=g.page_bytes)
        else:
            backend = HostBackend(page_bytes=g.page_bytes, checking=True)
        backend.reserve(g.backend_pages)
        self.backends.append(backend)
        return backend.tensor()[: num_blocks * block_bytes].view(num_blocks, block_bytes)

    def on_scheduler_built(self, scheduler: Any) -> None:
        assert self.geometry is not None
        c = self.case.config
        config = EngineConfig(
            policy=Policy.LEGACY if self.variant == "legacy" else Policy.LEDGER,
            min_reserved_pages=c.min_reserved_pages,
            max_reserved_pages=c.max_reserved_pages,
            max_cached_blocks=c.max_cached_blocks,
            journal_path=self.journal,
        )
        self.engine = assemble(scheduler, self.geometry, self.backends, config)

    def close(self) -> None:
        with contextlib.suppress(KvcachedError):
            if self.engine is not None:
                self.engine.close()
        for b in self.backends:
            b.close()


def harness_config(case: Case) -> HarnessConfig:
    c = case.config
    kind = KINDS[c.kind]
    # The CPU tier in GPU blocks of every group: 2 layers of 16 tokens x 1 head x 32 x K,V x fp16
    # for the default geometry, the kind's own otherwise (draw.KINDS).
    cpu_bytes = c.cpu_blocks * kind.group_block_bytes * groups(c) * c.tp
    return HarnessConfig(
        kind=c.kind,
        tp=c.tp,
        block_size=BLOCK_SIZE,
        num_layers=kind.layers,
        num_gpu_blocks=c.num_gpu_blocks,
        sliding_window=c.sliding_window,
        blocks_per_chunk=c.blocks_per_chunk,
        cpu_bytes_to_use=cpu_bytes,
        max_num_batched_tokens=c.max_num_batched_tokens,
        max_num_seqs=c.max_num_seqs,
        extra_config={"eviction_policy": c.eviction_policy},
        async_scheduling=c.async_scheduling,
        worker_at_schedule=c.worker_at_schedule,
    )


def step_bound(case: Case) -> int:
    """Steps a run may take: generous for any progress (a token per request per step, prefill
    chunks, waits on late ranks), small enough that a spinning engine shows as a hang."""
    adds = case.adds
    return 200 + sum(request_tokens(a, adds) for a in adds) + 4 * case.config.late_steps * len(adds)


class _Run:
    def __init__(self, case: Case, variant: str, journal: str | None) -> None:
        self.case, self.variant = case, variant
        self.f = Findings()
        self.kvc = _Kvcached(case, variant, journal) if variant != "vllm" else None
        kw: dict[str, Any] = {}
        if self.kvc is not None:
            kw = {"kv_memory": self.kvc.kv_memory, "on_scheduler_built": self.kvc.on_scheduler_built}
        self.h = Harness(harness_config(case), **kw)
        self.mem = MemoryChecks(self.h, self.kvc.backends if self.kvc and variant != "never-unmap" else None, self.f)
        if case.config.late_steps:
            self.h.delay_worker(case.config.tp - 1, case.config.late_steps)
        self.ids: list[str] = []
        self.prompts: list[list[int]] = []
        self.steps = 0
        self.bound = step_bound(case)
        self.cov: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.cov[what] = self.cov.get(what, 0) + 1

    def step(self) -> bool:
        """One engine step; False once the step bound is reached."""
        if self.steps >= self.bound:
            return False
        self.h.step()
        self.steps += 1
        return True

    def play(self) -> None:
        h = self.h
        for action in self.case.actions:
            if isinstance(action, Add):
                self.add(action)
            elif isinstance(action, Step):
                for _ in range(action.n):
                    if not h.busy() or not self.step():
                        break
            elif isinstance(action, Abort):
                self.abort(action.target)
            elif isinstance(action, Reset):
                self.reset(action)
            elif isinstance(action, Limit):
                self.limit(action.permille)
        while h.busy():
            if not self.step():
                running = len(h.scheduler.running)
                self.f.fail(
                    "hang",
                    h.step_index,
                    f"still busy after {self.bound} steps ({running} running, {len(h.scheduler.waiting)} waiting)",
                )
                return

    def reset(self, a: Reset) -> None:
        try:
            ok = self.h.scheduler.reset_prefix_cache(reset_running_requests=a.running, reset_connector=a.connector)
        except RuntimeError as e:
            # vLLM 0.33 refuses to reset with running requests that wait for a load ("not
            # supported yet", Scheduler.reset_prefix_cache): a refusal, as an engine sees it.
            if "waiting for remote KV transfer" not in str(e):
                raise
            self.count("resets_refused")
            return
        if ok:
            self.count("resets")

    def add(self, a: Add) -> None:
        h = self.h
        prompt: list[int] = []
        if a.follow_up >= 0:
            prompt += self.prompts[a.follow_up] + h.output_tokens(self.ids[a.follow_up])
        if a.shared >= 0:
            prompt += h.make_prompt(a.shared_len, seed=10_000_000 + 4 * self.case.seed + a.shared)
        prompt += h.make_prompt(a.length, seed=a.prompt_seed)
        stop = [h.model.continuation(prompt, a.stop_at)[-1]] if a.stop_at else []
        self.prompts.append(prompt)
        self.ids.append(h.add_request(prompt=prompt, max_tokens=a.max_tokens, stop_token_ids=stop))

    def abort(self, target: int) -> None:
        h = self.h
        rid = self.ids[target]
        req = h.scheduler.requests.get(rid)
        if req is None or req.is_finished():
            return
        self.count("aborts")
        if self._jobs_out(rid):
            self.count("aborts_in_flight")
        h.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def _jobs_out(self, rid: str) -> bool:
        h = self.h
        done: dict[int, int] = {}
        for rec in h.history:
            for j, n in rec.completed_jobs.items():
                done[j] = done.get(j, 0) + n
        return any(r == rid and done.get(j, 0) < self.case.config.tp for j, r in h.jobs().items())

    def limit(self, permille: int) -> None:
        if self.kvc is None or self.kvc.engine is None:
            return
        engine = self.kvc.engine
        assert engine.manager is not None and engine.pool is not None
        pages = engine.manager.geometry.num_pages
        limit = pages if permille >= 1000 else pages * permille // 1000
        before = engine.manager.state().mapped
        engine.manager.set_limit_pages(limit)
        engine.pool.shrink()
        if limit < before:
            self.count("shrinks")

    def finish(self) -> SeedResult:
        h, f = self.h, self.f
        if self.kvc is not None and self.kvc.engine is not None:
            led = self.kvc.engine.ledger
            # I5 (a store copies only its request's blocks) reads the ``RequestBlocks`` events that
            # kvcached's bridge records in each ``build_connector_meta``, as in a served engine's journal.
            for v in led.violations:
                f.fail("ledger", h.step_index, v.one_line(), request=v.request)
            if "hang" not in f.first and "crash" not in f.first:
                m = self.kvc.engine.manager
                left = []
                if led.pinned_pages:
                    left.append(plural(led.pinned_pages, "pinned page"))
                if led.outstanding_jobs():
                    left.append(f"{plural(led.outstanding_jobs(), 'job')} outstanding")
                if m is not None and m.state().shrink_pending:
                    left.append("a shrink pending")
                if left:
                    f.fail("leftover", h.step_index, "at the end: " + ", ".join(left))
        elif "hang" not in f.first and "crash" not in f.first:
            pending = [j for w in h.transfer_workers for j in w.pending_job_ids]
            if pending:
                f.fail("leftover", h.step_index, f"at the end: {plural(len(pending), 'job')} pending in the workers")
        cov = Coverage(
            steps=h.step_index,
            requests=len(self.ids),
            preemptions=sum(len(r.preempted_req_ids) for r in h.history),
            aborts=self.cov.get("aborts", 0),
            aborts_in_flight=self.cov.get("aborts_in_flight", 0),
            resets=self.cov.get("resets", 0),
            shrinks=self.cov.get("shrinks", 0),
            stores=sum(len(r.store_jobs) for r in h.history),
            loads=sum(len(r.load_jobs) for r in h.history),
            bytes_checked=self.mem.bytes_checked,
        )
        return SeedResult(
            seed=self.case.seed,
            variant=self.variant,
            failures=f.failures(),
            coverage=cov,
            config=self.case.describe(),
        )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.h.close()
        if self.kvc is not None:
            self.kvc.close()


def run_case(case: Case, variant: str, *, journal: str | None = None) -> SeedResult:
    """Run ``case`` under ``variant``; a failure is a result, never an exception."""
    try:
        run = _Run(case, variant, journal)
    except Exception as e:  # a configuration vLLM or kvcached refuses is a finding too
        f = Findings()
        f.fail("crash", 0, f"at construction: {type(e).__name__}: {e}".splitlines()[0][:300])
        return SeedResult(
            seed=case.seed, variant=variant, failures=f.failures(), coverage=Coverage(), config=case.describe()
        )
    try:
        try:
            run.play()
        except Exception as e:  # a crash out of vLLM or kvcached is a finding of the seed
            run.f.fail("crash", run.h.step_index, f"{type(e).__name__}: {e}".splitlines()[0][:300])
        return run.finish()
    finally:
        run.close()
