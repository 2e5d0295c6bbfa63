"""A synthetic serving workload, as events: for benchmarks and for traces of any length.

Real traces come from vLLM (the bridge's scenarios); this generator stands in where a trace
must be long (ten million events) or produced without vLLM. It follows the order of one
engine step described in ``shared/notes/vllm-offloading.md``: the scheduler allocates blocks
(prefill in chunks, one block per 16 decoded tokens), the build returns one store job per
request with newly filled blocks, the workers report the previous step's jobs, and finished or
preempted requests free their blocks, their last block stored in the next build. Block ids
come lowest-first, as a page-aware pool hands them out.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterator

from kvcached.ledger.events import (
    BlockAlloc,
    BlockFree,
    BuildBoundary,
    Event,
    Header,
    JobBuilt,
    JobKind,
    JobReported,
    PoolGeometry,
    PrefixCacheReset,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
)

# Qwen2.5-0.5B in kvcached's contiguous layout: 16 tokens x 24 layers x K,V x 2 heads x 64 x bf16.
BLOCK_BYTES = 16 * 24 * 2 * 2 * 64 * 2
PAGE_BYTES = 2 << 20


def header(num_blocks: int = 8192, workers: int = 1) -> Header:
    return Header(
        page_bytes=PAGE_BYTES,
        pools=(PoolGeometry(block_bytes=BLOCK_BYTES, num_blocks=num_blocks),),
        workers=workers,
        meta={"producer": "kvcached.testing.synth"},
    )


class _Req:
    __slots__ = ("blocks", "filled", "prompt", "stored", "todo")

    def __init__(self, prompt: int, todo: int) -> None:
        self.prompt = prompt  # prompt blocks still to prefill
        self.todo = todo  # decode blocks still to produce
        self.blocks: list[int] = []
        self.filled = 0
        self.stored = 0


def workload(
    seed: int = 0,
    *,
    num_blocks: int = 8192,
    max_running: int = 64,
    workers: int = 1,
    prefill_chunk: int = 32,
    preempt_every: int = 500,
    reset_every: int = 5000,
) -> Iterator[Event]:
    """Yield input events (no allocator decisions) forever; slice what you need."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    heapq.heapify(free)
    running: dict[int, _Req] = {}
    pending: list[int] = []  # jobs built in the previous step, reported in this one
    last_stores: list[tuple[int, int]] = []  # (req, block) of requests finished last step
    # Freed blocks go back to the free list after the next build, as vLLM's connector drops or
    # fences a reallocated block's pending store: the generator never asks for that case.
    released: list[int] = []
    next_req = next_job = 0
    step = 0

    def take(n: int) -> list[int]:
        return [heapq.heappop(free) for _ in range(min(n, len(free)))]

    while True:
        # schedule(): admit, prefill in chunks, decode one block per step for a few.
        while len(running) < max_running and len(free) > 4 * prefill_chunk:
            req = next_req
            next_req += 1
            running[req] = _Req(prompt=rng.randint(1, 64), todo=rng.randint(1, 32))
            yield RequestAdded(req, f"cmpl-{seed:x}-{req:08x}")
        for r in running.values():
            n = min(r.prompt, prefill_chunk) if r.prompt else (1 if rng.random() < 0.25 and r.todo else 0)
            got = take(n)
            if got:
                r.blocks += got
                yield BlockAlloc(0, tuple(got))
            if r.prompt:
                r.prompt -= len(got)
            elif got:
                r.todo -= 1
            r.filled = len(r.blocks)
        # build_connector_meta(): stores of newly filled blocks and of finished requests' last blocks.
        jobs: list[int] = []
        for req, block in last_stores:
            yield JobBuilt(next_job, JobKind.STORE, req, ((block,),), workers)
            jobs.append(next_job)
            next_job += 1
        for req, _ in last_stores:
            yield RequestFinished(req)
        last_stores = []
        for req, r in running.items():
            if r.filled - 1 > r.stored:
                blocks = tuple(r.blocks[r.stored : r.filled - 1])
                r.stored = r.filled - 1
                yield JobBuilt(next_job, JobKind.STORE, req, (blocks,), workers)
                jobs.append(next_job)
                next_job += 1
        yield BuildBoundary(step)
        step += 1
        for b in released:
            heapq.heappush(free, b)
        released = []
        # update_from_output(): the workers report last step's jobs; requests finish or are preempted.
        for job in pending:
            for _ in range(workers):
                yield JobReported(job, 1)
        pending = jobs
        done = [req for req, r in running.items() if not r.prompt and not r.todo]
        if preempt_every and step % preempt_every == 0 and running:
            victim = rng.choice(list(running))
            yield RequestPreempted(victim)
            if victim not in done:  # it may have finished in this very step
                done.append(victim)
        for req in done:
            r = running.pop(req)
            if r.blocks:
                yield BlockFree(0, tuple(r.blocks))
                released += r.blocks
                last_stores.append((req, r.blocks[-1]))
            else:
                yield RequestFinished(req)
        if reset_every and step % reset_every == 0:
            yield PrefixCacheReset()
