"""A request preempted by a prefix-cache reset and re-admitted at once is running, not preempted.

``Scheduler.reset_prefix_cache(reset_running_requests=True)`` preempts every running request
between steps; the next ``schedule()`` matches and re-admits them, and the output it builds lists
them in ``preempted_req_ids``. The bridge recorded the preemption after matching had dropped the
requests' window holds, so the ledger kept running requests "preempted" for good, and the first
shrink more than 16 builds later reported a false I4 ``holds-block-shrink``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcached.ledger.events import RequestPreempted, WindowRelease
from kvcached.ledger.journal import read_journal
from kvcached.vllm.patches import VLLM
from kvcached.vllm.testing.harness import Harness, HarnessConfig
from kvcached.vllm.testing.scenarios import Kvcached

pytestmark = pytest.mark.vllm


def test_a_request_re_admitted_after_a_reset_is_not_kept_preempted(tmp_path: Path) -> None:
    import vllm

    if VLLM.parse(vllm.__version__) < VLLM.parse("0.33.0"):
        # As for the preempt-shrink scenario: vLLM 0.32.0's own OffloadingConnectorScheduler
        # asserts that a preempted request has only store jobs in flight (0.33 copes).
        pytest.skip(f"vLLM {vllm.__version__} asserts on preempting a request with a load in flight (0.33 copes)")
    journal = str(tmp_path / "reset.kvj")
    kvc = Kvcached("ledger", journal=journal)
    cfg = HarnessConfig(sliding_window=16, max_num_batched_tokens=128, num_gpu_blocks=96)
    h = Harness(cfg, kv_memory=kvc.kv_memory, on_scheduler_built=kvc.on_scheduler_built)
    try:
        for seed in (21, 22):
            h.add_request(prompt=h.make_prompt(64, seed=seed), max_tokens=80)
        for _ in range(4):
            h.step()
        assert h.reset_prefix_cache(reset_running_requests=True)
        h.step()  # matched and re-admitted in the same schedule
        lg = kvc.ledger
        assert lg.tables.preempted == {}, "running requests are recorded as preempted"
        for _ in range(20):  # well past the liveness bound of 16 builds, still running
            h.step()
        m = kvc.manager
        assert m is not None
        m.set_limit_pages(m.state().mapped - 1)  # a shrink while the requests hold windows
        for _ in range(20):
            h.step()
        h.run_until_idle(max_steps=400)
        assert [v for v in lg.violations if v.invariant == "I4"] == []
    finally:
        h.close()
        kvc.close()
    # The journal says it in that order: each preemption before the release of its holds.
    events = read_journal(journal).events
    for req in {e.req for e in events if isinstance(e, RequestPreempted)}:
        mine = [type(e) for e in events if isinstance(e, RequestPreempted | WindowRelease) and e.req == req]
        assert mine[0] is RequestPreempted, mine
