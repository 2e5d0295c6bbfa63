"""A same-step prefix hit on a block whose write the bridge defers is no foreign store.

A false I5 on a served engine: vLLM's ``KVCacheManager.allocate_slots`` caches a
request's full prompt blocks as soon as it allocates them, so a request scheduled later in the
same ``Scheduler.schedule`` can take such a block as a prefix hit. Here, under async scheduling
(case 2 of kvcached PR #598), request A finishes and frees its blocks; the next schedule gives
them to B fresh and builds A's last store over two of them in ``jobs_to_flush`` (the worker
copies it before B's forward writes there), and C, arriving with B and sharing B's first 80
tokens, hits B's fifth block, one of those two. The bridge tells the ledger B's write of such a
block only after that build's jobs (A's flushed store reads A's own KV); it told C's hold of it
before, so C's own store of the block in the next build (its chunk of two blocks, the second one
C's own, completes only then) was an I5 store-of-foreign-block: a served engine reported a
violation and dumped its flight recorder, and ``kvreplay check`` failed the journal, with every
byte right. This runs vLLM's real ``AsyncScheduler`` and ``OffloadingConnector`` through the
harness with kvcached underneath, and checks the bytes by loading C's prompt back.
"""

from __future__ import annotations

import pytest

from kvcached.vllm.testing.harness import Harness, HarnessConfig
from kvcached.vllm.testing.scenarios import Kvcached

pytestmark = pytest.mark.vllm

BS = 16  # tokens per block (HarnessConfig's default)


def test_a_same_step_hit_on_a_block_written_after_a_flushed_store_is_not_a_foreign_store() -> None:
    # Chunks of two blocks; a token budget that schedules B's whole prompt (96) and 8 of C's.
    cfg = HarnessConfig(async_scheduling=True, blocks_per_chunk=2, max_num_batched_tokens=104, num_gpu_blocks=16)
    kvc = Kvcached("ledger")
    h = Harness(cfg, kv_memory=kvc.kv_memory, on_scheduler_built=kvc.on_scheduler_built)
    try:
        # A: 86 prompt tokens and 11 outputs; its last chunk (tokens 64..95) is stored only in
        # the build after it finished, from finished_req_ids.
        a = h.add_request(prompt=h.make_prompt(86, seed=1), max_tokens=11)
        while not h.request(a).is_finished():
            h.step()
        # B and C arrive together once A has freed its blocks: C shares B's first 5 blocks.
        b_prompt = h.make_prompt(96, seed=2)
        b = h.add_request(prompt=b_prompt, max_tokens=2)
        c_prompt = b_prompt[: 5 * BS] + h.make_prompt(40, seed=3)
        c = h.add_request(prompt=c_prompt, max_tokens=2)
        h.run_until_idle()

        # The schedule that first gives B and C blocks builds A's last store, flushed.
        k = next(i for i, r in enumerate(h.history) if b in r.num_scheduled_tokens)
        both = h.history[k]
        assert a in both.finished_req_ids and c in both.num_scheduled_tokens
        [flushed] = [ids for j, (r, ids) in both.store_jobs.items() if r == a and j in both.jobs_to_flush]
        [b_ids] = [ids for r, ids in both.store_jobs.values() if r == b]
        # C's chunk of blocks 4 and 5 completes in the next step; its block 4 is B's block 4,
        # given to B fresh in the same step and read by A's flushed store.
        [c_ids] = [ids for r, ids in h.history[k + 1].store_jobs.values() if r == c]
        shared = b_ids[4]
        assert c_ids[0] == shared and shared in flushed and c_ids[1] not in b_ids, (b_ids, c_ids, flushed)

        # No foreign store: C's hit block holds C's own prefix (what B wrote there) ...
        assert [f"{v.invariant} {v.code}: {v.message}" for v in kvc.ledger.violations] == []

        # ... and the bytes agree: C's prompt comes back from the CPU tier byte for byte.
        assert h.reset_prefix_cache()
        again = h.add_request(prompt=c_prompt, max_tokens=1)
        h.run_until_idle()
        assert sorted(x.block_index for x in h.load_checks if x.req_id == again) == [0, 1, 2, 3, 4, 5]
        assert h.verify_loads() == []
        assert kvc.ledger.violations == []
    finally:
        h.close()
        kvc.close()
