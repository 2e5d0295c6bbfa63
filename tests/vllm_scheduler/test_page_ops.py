"""Page maps and unmaps per scheduler step (``kvcached.engine.steps``), counted where vLLM steps.

vLLM's real ``Scheduler`` and ``OffloadingConnector`` through the harness, kvcached underneath
with a reserve: every ``schedule`` ends one step, and the histogram's steps and ops are exactly
the schedules and the ledger's ``PageMapped``/``PageUnmapped`` events after the engine's start.
What trips: a step counted from the wrong call (``update_from_output`` too: twice the steps), or
the start's maps taken for the first step's (the sum is off by them).
"""

from __future__ import annotations

import pytest

from kvcached.engine.steps import BOUNDS, OpsPerStep
from kvcached.vllm.testing.harness import Harness, HarnessConfig
from kvcached.vllm.testing.scenarios import Kvcached

pytestmark = pytest.mark.vllm


def test_each_schedule_is_a_step_and_its_page_ops_are_the_ledger_s() -> None:
    kvc = Kvcached("ledger", max_reserved=4)
    h = Harness(HarnessConfig(num_gpu_blocks=64), kv_memory=kvc.kv_memory, on_scheduler_built=kvc.on_scheduler_built)
    try:
        assert kvc.engine is not None
        at_start = kvc.ledger.maps + kvc.ledger.unmaps  # the null block's page and the reserve
        assert at_start > 0
        for i in range(6):
            h.add_request(prompt=h.make_prompt(40 + 8 * i, seed=i), max_tokens=24)
        h.run_until_idle()
        hist = kvc.engine.page_ops.snapshot()
        assert hist.observed == len(h.history)
        assert hist.sum == kvc.ledger.maps + kvc.ledger.unmaps - at_start > 0
        assert hist.counts[0] > 0  # steps that mapped nothing: the reserve absorbed them
    finally:
        h.close()
        kvc.close()


def test_the_buckets_hold_each_step_once_by_its_count() -> None:
    ops = OpsPerStep(ops_at_start=3)
    for total in (3, 4, 4, 7, 7 + 300):  # steps of 0, 1, 0, 3 and 300 ops
        ops.step_ended(total)
    h = ops.snapshot()
    assert h.bounds == BOUNDS and h.sum == 304 and h.observed == 5
    assert dict(zip((*BOUNDS, "inf"), h.counts, strict=True)) == {
        0: 2,
        1: 1,
        2: 0,
        4: 1,
        8: 0,
        16: 0,
        32: 0,
        64: 0,
        128: 0,
        256: 0,
        "inf": 1,
    }
