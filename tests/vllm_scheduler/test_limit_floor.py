"""The floor of ``kvctl limit``, from vLLM's real Scheduler and its KV cache groups.

A limit below what one request of max_model_len needs leaves an engine that admits nothing and
waits for memory that never comes, so ``LiveControl.set_limit`` refuses it unless forced; the
floor is what vLLM itself would refuse at start-up for that request (each group's spec's
``max_memory_usage_bytes``, summed over the groups the block pool serves). With the floor taken
as one group's full-attention blocks (the naive count), the sliding-window test fails.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytestmark = pytest.mark.vllm

from kvcached.vllm.engine_core.control import request_floor  # noqa: E402
from kvcached.vllm.testing.harness import Harness, HarnessConfig  # noqa: E402

BPP = 4  # blocks per page
COST = 1 << 20


def test_full_attention_needs_max_model_len_in_blocks() -> None:
    with Harness(HarnessConfig(max_model_len=1024, block_size=16)) as h:
        pages, why = request_floor(h.scheduler, BPP, COST)
    assert pages == 1024 // 16 // BPP and "max_model_len 1,024 needs 64 blocks on 16 pages" in why


def test_a_sliding_window_group_adds_its_window_not_the_whole_length() -> None:
    with Harness(HarnessConfig(max_model_len=1024, block_size=16, sliding_window=64)) as h:
        pages, why = request_floor(h.scheduler, BPP, COST)
    blocks = int(why.split("needs ")[1].split(" blocks")[0].replace(",", ""))
    # The full group's 64, and the window's: vLLM counts the window plus one prefill chunk
    # (max_num_batched_tokens 512: ceil((64 - 1 + 512) / 16) + 1 = 37), not the whole length.
    assert blocks == 64 + 37, why
    assert pages == -(-blocks // BPP)


def test_min_kv_cache_mb_raises_the_floor() -> None:
    with Harness(HarnessConfig(max_model_len=1024, block_size=16)) as h:
        pages, why = request_floor(h.scheduler, BPP, COST, min_bytes=40 * COST)
        low, _ = request_floor(h.scheduler, BPP, COST, min_bytes=2 * COST)
    assert pages == 40 and why.startswith("KVCACHED_MIN_KV_CACHE_MB is 40; one request")
    assert low == 16  # below one request's floor it changes nothing
