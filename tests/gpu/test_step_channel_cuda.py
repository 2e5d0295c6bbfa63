"""Tensor parallel on CUDA pages: two worker processes follow the scheduler's decisions.

vLLM's ``mp`` executor runs each tensor-parallel rank in a process of its own; the CUDA pages of
its KV cache live there, and the scheduler (engine core) cannot map or unmap them. kvcached sends
its decisions with each step (``kvcached.vllm.step_channel``): here the engine side is the real
chain (``DecisionBackend`` per rank under a ``KVCacheManager``, the ``PageLog``), the workers are
two spawned processes that each make their range with ``kv_memory.worker_backend`` (all pages
mapped for vLLM's warm-up, as in a server) and apply each batch with ``WorkerPages``, and the
batches travel pickled through a queue, as vLLM's broadcast queue carries ``SchedulerOutput``
(vLLM itself cannot be installed on the GPU machine; the CPU build's TP=2 server test covers
vLLM's side). Checked: batch 1 gives back the warm-up pages; a mapped block takes writes and
reads them back on both ranks; device memory goes back when the scheduler frees blocks; a batch
out of sequence is refused.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
from gpu_env import free_bytes, require_gpu

torch = require_gpu()
pytestmark = pytest.mark.gpu

from kvcached.kv_cache_manager import KVCacheManager  # noqa: E402
from kvcached.vllm import kv_layout, step_channel  # noqa: E402
from kvcached.vllm.engine_core import step_sender  # noqa: E402
from kvcached.vllm.worker import kv_memory, step_receiver  # noqa: E402

PAGE = 2 << 20
PLAN = kv_layout.KVPlan(num_blocks=64, block_bytes=256 << 10, page_bytes=PAGE, regions=4, vllm_size=64 * (256 << 10))


def _worker(rank: int, inbox: Any, outbox: Any) -> None:
    """One rank: its own range, the batches applied before each 'step', the step's writes."""
    import torch

    from kvcached.vllm import step_channel

    backend = kv_memory.worker_backend(PLAN, device=torch.device("cuda", 0), backend="auto", key=f"tp-rank{rank}")
    base = backend.tensor(torch.uint8)
    base[: backend.nbytes].fill_(1)  # vLLM's warm-up writes over the whole cache
    torch.cuda.synchronize()
    pages = step_receiver.WorkerPages(backend, PLAN)
    outbox.put(("ready", backend.mapped_count))
    g = PLAN.geometry
    while True:
        message, blocks = inbox.get()
        if message is None:
            break
        try:
            pages.apply(message)
        except step_channel.ChannelError as e:
            outbox.put(("refused", str(e)))
            continue
        ok = True
        for b in blocks:  # the step writes its blocks in every layer's region, then reads them
            page, slot = divmod(b, g.blocks_per_page)
            for r in range(g.regions):
                start = (r * g.num_pages + page) * PAGE + slot * g.block_bytes
                view = base[start : start + g.block_bytes]
                view.fill_((b + r + rank) % 250 + 1)
                ok &= bool((view == (b + r + rank) % 250 + 1).all())
        torch.cuda.synchronize()
        outbox.put(("step", ok, backend.mapped_count))
    del base
    kv_memory.release(f"tp-rank{rank}")
    outbox.put(("closed", 0))


def test_two_ranks_follow_the_scheduler_through_the_step() -> None:
    ctx = mp.get_context("spawn")  # CUDA in children needs spawn, as vLLM's mp executor uses
    g = PLAN.geometry
    log = step_channel.PageLog(g.blocks_per_page)
    backends = [step_sender.DecisionBackend(PAGE, "cuda", g.num_pages, log if r == 0 else None) for r in range(2)]
    for b in backends:
        b.reserve(g.backend_pages)
    manager = KVCacheManager.standalone(g, backends[0], replicas=backends[1:], workers=2, policy="legacy")
    assert manager.page_cost == PAGE * g.regions * 2  # a page costs its bytes on both ranks
    queues = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    procs = [ctx.Process(target=_worker, args=(r, *queues[r])) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for _, outbox in queues:
            assert outbox.get(timeout=120) == ("ready", g.backend_pages)  # warm-up: every page mapped

        def step(blocks: list[int]) -> list[tuple[Any, ...]]:
            message = log.take()  # what Scheduler.schedule() attaches to SchedulerOutput
            for inbox, _ in queues:
                inbox.put((message, blocks))
            return [outbox.get(timeout=120) for _, outbox in queues]

        idle = free_bytes()
        blocks = manager.alloc(40)  # 40 blocks of 8 per page: 5 pages
        got = step(blocks)
        mapped = 5 * g.regions
        assert got == [("step", True, mapped)] * 2, got  # warm-up pages gone, 5 pages mapped, bytes right
        with_pages = free_bytes()
        unmapped = 2 * (g.backend_pages - mapped) * PAGE  # the warm-up pages no block is on, both ranks
        assert with_pages - idle >= unmapped - (2 << 20), (idle, with_pages)
        manager.free(blocks)  # legacy: the pages go at once
        got = step([])
        assert got == [("step", True, 0)] * 2, got
        back = free_bytes()
        assert back - with_pages >= 2 * mapped * PAGE - (2 << 20), (with_pages, back)  # both ranks' pages back
        # A batch that skips one is refused on every rank: the memory would leave the ledger's view.
        log.take()
        got = step([])
        assert all(kind == "refused" and "after batch" in text for kind, text in got), got
    finally:
        for inbox, _ in queues:
            inbox.put((None, []))
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
