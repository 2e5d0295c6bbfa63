"""The real-vLLM harness with vLLM's own block pool and plain torch.zeros KV memory.

These pin what the freed-block-copy tests stand on: bytes written by the model stand-in go to
the CPU tier and come back byte for byte; stores are submitted one step after they are built
and reported at the end of that step; a delayed TP worker copies and reports late; and the
check fails when the bytes a store reads were lost (the negative control).
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvcached.errors import ConfigError
from kvcached.vllm.offload.cpu import KvcachedCPUOffloadingWorker
from kvcached.vllm.testing.harness import Harness, HarnessConfig

pytestmark = pytest.mark.vllm

BS = 16


def _store_then_reload(h: Harness, prompt_len: int, max_tokens: int = 1) -> tuple[str, str]:
    prompt = h.make_prompt(prompt_len, seed=7)
    first = h.add_request(prompt=prompt, max_tokens=max_tokens)
    h.run_until_idle(50)
    assert h.reset_prefix_cache()
    second = h.add_request(prompt=prompt, max_tokens=2)
    h.run_until_idle(50)
    return first, second


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_prompt_comes_back_from_the_cpu_tier_byte_for_byte(blocks_per_chunk: int) -> None:
    with Harness(HarnessConfig(blocks_per_chunk=blocks_per_chunk)) as h:
        first, second = _store_then_reload(h, prompt_len=72)
        # Timing the bug depends on: the store is built in step 0, where the request also finishes
        # and frees its blocks; the worker submits it at the start of step 1 and reports it there.
        ((job, (req, ids)),) = h.history[0].store_jobs.items()
        assert req == first and len(ids) == 4
        assert h.request(first).is_finished()
        assert first in h.history[1].finished_req_ids and h.history[1].completed_jobs == {job: 1}
        assert [(c.step, c.job_id) for c in h.freed_block_copies] == [(1, job)]  # vLLM's pool: harmless
        # The reload restored the four full blocks (64 of 72 tokens) and every byte matched.
        checks = [c for c in h.load_checks if c.req_id == second]
        assert sorted(c.block_index for c in checks) == [0, 1, 2, 3]
        assert h.verify_loads() == []
        assert h.output_tokens(second)[0] == h.output_tokens(first)[0]


def test_tp2_with_one_worker_reporting_two_steps_late() -> None:
    calls: list[object] = []

    def kv_memory(num_blocks: int, block_bytes: int) -> torch.Tensor:
        calls.append((num_blocks, block_bytes))
        return torch.zeros((num_blocks, block_bytes), dtype=torch.uint8)

    with Harness(HarnessConfig(tp=2), kv_memory=kv_memory, on_scheduler_built=calls.append) as h:
        # One KV memory per rank, both served by the provider before the scheduler exists.
        assert calls == [(64, h.block_bytes), (64, h.block_bytes), h.scheduler]
        h.delay_worker(1, 2)
        _, second = _store_then_reload(h, prompt_len=72)
        ((job, _),) = h.history[0].store_jobs.items()
        # Each rank counts once, in different steps; the job completes only with the second.
        reports = [(r.step, r.completed_jobs[job]) for r in h.history if job in r.completed_jobs]
        assert reports == [(1, 1), (3, 1)]
        # The late rank also copies late, which is what a pin must outlast.
        assert sorted((c.worker, c.step) for c in h.freed_block_copies) == [(0, 1), (1, 3)]
        assert {c.worker for c in h.load_checks if c.req_id == second} == {0, 1}
        assert h.verify_loads() == []
        # Ranks hold different heads: their KV bytes differ.
        assert not torch.equal(h.kv_memory[0], h.kv_memory[1])


def test_sliding_window_blocks_are_stored_after_they_leave_the_window() -> None:
    cfg = HarnessConfig(sliding_window=16, num_layers=1, max_num_batched_tokens=64)
    with Harness(cfg) as h:
        first, second = _store_then_reload(h, prompt_len=111, max_tokens=3)
        # Step 1 prefills tokens 64..110 and builds a store holding the window block for 80..95;
        # step 2's schedule drops that block from the window (frees it) before the worker
        # submits the store, while the request still runs: the sliding-window freed-block copy.
        assert [c.job_id for c in h.freed_block_copies if c.req_id == first and c.step == 2] == [1]
        assert first not in h.history[2].finished_req_ids  # still running when the copy ran
        groups = {c.group for c in h.load_checks if c.req_id == second}
        assert groups == {0, 1}
        assert h.verify_loads() == []


def test_async_scheduling_stores_the_last_decode_block_after_the_finish() -> None:
    """vLLM's AsyncScheduler in the engine's batch-queue order: 70 prompt tokens and 10 fed
    outputs fill block 5 in the last decode step. The block's last token was sampled by the step
    before, whose output the scheduler processes only after it scheduled the last step, so no
    build keys the block while the request runs; the step after leaves the request out (its
    max_tokens is reached), and the store is built from finished_req_ids over blocks vLLM's pool
    already holds as free (case 2 of kvcached PR #598), with the worker side run late or at schedule."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    outputs = {}
    for async_scheduling, at_schedule in ((False, False), (True, False), (True, True)):
        cfg = HarnessConfig(async_scheduling=async_scheduling, worker_at_schedule=at_schedule)
        with Harness(cfg) as h:
            assert isinstance(h.scheduler, AsyncScheduler) == async_scheduling
            prompt = h.make_prompt(70, seed=3)
            first = h.add_request(prompt=prompt, max_tokens=11)
            h.run_until_idle(50)
            outputs[async_scheduling, at_schedule] = h.output_tokens(first)
            record, job, ids = [(r, j, ids) for r in h.history for j, (_, ids) in r.store_jobs.items()][-1]
            assert len(ids) == 1
            if async_scheduling:
                assert first in record.finished_req_ids and record.num_scheduled_tokens == {}
                assert record.stores_of_free_blocks == {job: ids}
            else:
                assert record.num_scheduled_tokens == {first: 1} and not record.stores_of_free_blocks
            assert h.reset_prefix_cache()
            second = h.add_request(prompt=prompt + h.output_tokens(first), max_tokens=1)
            h.run_until_idle(50)
            assert sorted(c.block_index for c in h.load_checks if c.req_id == second) == [0, 1, 2, 3, 4]
            assert h.verify_loads() == []  # vLLM's own pool leaves a free block's bytes in place
    # The model runner's tokens (ahead of the scheduler's under async) sample the same sequence.
    assert len(set(map(tuple, outputs.values()))) == 1 and len(outputs[True, False]) == 11


def test_negative_control_lost_store_source_is_caught() -> None:
    with Harness(HarnessConfig()) as h:
        prompt = h.make_prompt(72, seed=7)
        first = h.add_request(prompt=prompt, max_tokens=1)
        record = h.step()
        assert record is not None and h.request(first).is_finished()
        ((_, (_, ids)),) = record.store_jobs.items()
        h.zero_blocks(ids)  # what the store reads from an unmapped page, before it is submitted
        h.run_until_idle(50)
        assert h.reset_prefix_cache()
        second = h.add_request(prompt=prompt, max_tokens=1)
        h.run_until_idle(50)
        mismatches = h.verify_loads()
        assert {(m.req_id, m.block_index) for m in mismatches} == {(second, k) for k in range(4)}
        assert all(m.all_zero and len(m.bad_positions) == BS for m in mismatches)


def test_negative_control_late_rank_reads_after_the_first_report() -> None:
    with Harness(HarnessConfig(tp=2)) as h:
        h.delay_worker(1, 2)
        prompt = h.make_prompt(72, seed=7)
        h.add_request(prompt=prompt, max_tokens=1)
        h.step()
        ((job, (_, ids)),) = h.history[0].store_jobs.items()
        h.step()  # rank 0 copied and reported; rank 1 has not copied yet
        assert h.history[1].completed_jobs == {job: 1}
        h.zero_blocks(ids)
        h.run_until_idle(50)
        assert h.reset_prefix_cache()
        h.add_request(prompt=prompt, max_tokens=1)
        h.run_until_idle(50)
        assert {m.worker for m in h.verify_loads()} == {1}


def _vllm_before_0_33() -> bool:
    import vllm

    return tuple(int(x) for x in vllm.__version__.split("+")[0].split(".")[:2]) < (0, 33)


@pytest.mark.skipif(_vllm_before_0_33(), reason="synchronous loads (sync_load_budget_bytes) arrived in vLLM 0.33")
def test_sync_loads_restore_before_the_forward() -> None:
    with Harness(HarnessConfig(tp=2, extra_config={"sync_load_budget_bytes": 1 << 20})) as h:
        h.delay_worker(1, 3)  # a sync load is waited on, so the delay cannot hold it back
        _, second = _store_then_reload(h, prompt_len=88)
        ((load_step, load_job),) = [(r.step, j) for r in h.history for j, q in r.load_jobs.items() if q == second]
        assert h.history[load_step].num_scheduled_tokens == {second: 8}
        assert h.history[load_step].completed_jobs.get(load_job) == 2
        assert len(h.load_checks) == 2 * 5 and h.verify_loads() == []


def test_unsupported_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="canonical"):
        Harness(HarnessConfig(extra_config={"canonical_layout": True}))
    with pytest.raises(ConfigError, match="kv_memory"):
        Harness(HarnessConfig(), kv_memory=lambda n, b: torch.zeros((n, b + 1), dtype=torch.uint8))


# --- the worker alone: chunk offsets, partial pages, delays -------------------------------------


def _worker(blocks_per_chunk: int = 2) -> tuple[KvcachedCPUOffloadingWorker, torch.Tensor]:
    dev = torch.randint(-128, 127, (8, 64), dtype=torch.int8)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(dev, 64)],
        group_data_refs=[[CanonicalKVCacheRef(0, 64)], [CanonicalKVCacheRef(0, 48)]],
    )
    return KvcachedCPUOffloadingWorker(caches, blocks_per_chunk, num_chunks=4), dev


def test_worker_maps_unaligned_first_blocks_and_partial_pages() -> None:
    w, dev = _worker()
    orig = dev.clone()
    # Group 0 starts at logical block 1, the second half of a chunk; group 1 copies 48 of 64 bytes.
    store = GPULoadStoreSpec([3, 5, 6], group_sizes=[2, 1], block_indices=[1, 4])
    host = CPULoadStoreSpec([0, 1, 2])
    assert w.submit_store(0, store, host)
    assert torch.equal(w.host_tensors[0][1], orig[3]) and torch.equal(w.host_tensors[0][2], orig[5])
    assert torch.equal(w.host_tensors[0][4, :48], orig[6, :48]) and not w.host_tensors[0][4, 48:].any()
    assert w.submit_load(1, host, GPULoadStoreSpec([1, 2, 7], group_sizes=[2, 1], block_indices=[1, 4]))
    assert torch.equal(dev[1], orig[3]) and torch.equal(dev[2], orig[5])
    assert torch.equal(dev[7, :48], orig[6, :48]) and torch.equal(dev[7, 48:], orig[7, 48:])
    assert [r.job_id for r in w.get_finished()] == [0, 1]
    with pytest.raises(ValueError, match="KV groups"):
        w.submit_store(2, GPULoadStoreSpec([3], group_sizes=[1], block_indices=[0]), CPULoadStoreSpec([0]))


def test_worker_delay_copies_and_reports_late_unless_waited() -> None:
    w, dev = _worker(blocks_per_chunk=1)
    w.delay_steps = 1
    spec = GPULoadStoreSpec([2], group_sizes=[1, 0], block_indices=[0, 0])
    w.submit_store(0, spec, CPULoadStoreSpec([3]))
    assert w.get_finished() == [] and not w.host_tensors[0][3].any()
    assert [r.job_id for r in w.get_finished()] == [0] and torch.equal(w.host_tensors[0][3], dev[2])
    w.submit_store(1, GPULoadStoreSpec([4], group_sizes=[1, 0], block_indices=[0, 0]), CPULoadStoreSpec([1]))
    w.wait({1})
    assert torch.equal(w.host_tensors[0][1], dev[4]) and [r.job_id for r in w.get_finished()] == [1]
    with pytest.raises(ConfigError):
        KvcachedCPUOffloadingWorker(CanonicalKVCaches([CanonicalKVCacheTensor(dev, 64)], [[]]), 1, num_chunks=0)
