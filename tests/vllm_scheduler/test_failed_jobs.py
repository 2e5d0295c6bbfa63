"""A transfer job that fails, under kvcached (vLLM 0.34's ``failed_jobs``).

From vLLM 0.34 an offloading worker can report a job failed (``TransferResult.success`` False;
the worker connector's ``OffloadingWorkerMetadata.mark_completed(job_id, success=False)``). The
scheduler still counts it complete, drops a failed store instead of publishing it to the CPU tier
(``complete_store(..., success=False)``) and never reads a failed load's blocks back. For the
ledger a failed copy is a finished copy: its pins go with its report as with any other, and the
failure is recorded (``JobFailed``), so that ``kvreplay show`` says which jobs failed. Here the
real scheduler and OffloadingConnector run through the harness with kvcached underneath, and the
worker fails every store.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvcached.ledger.events import JobFailed, JobReported
from kvcached.ledger.journal import read_journal
from kvcached.vllm.testing.harness import Harness, HarnessConfig
from kvcached.vllm.testing.scenarios import Kvcached

pytestmark = pytest.mark.vllm

offloading_common = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.offloading.common")
if "failed_jobs" not in {f.name for f in dataclasses.fields(offloading_common.OffloadingWorkerMetadata)}:
    pytest.skip("failed transfer jobs arrived in vLLM 0.34", allow_module_level=True)


def test_a_failed_store_is_recorded_releases_its_pins_and_is_never_loaded_back(tmp_path: Path, capsys) -> None:
    journal = tmp_path / "failed.kvj"
    kvc = Kvcached("ledger", journal=str(journal))
    h = Harness(HarnessConfig(), kv_memory=kvc.kv_memory, on_scheduler_built=kvc.on_scheduler_built)
    try:
        h.transfer_workers[0].fails = lambda plan: plan.is_store
        prompt = h.make_prompt(72, seed=7)
        first = h.add_request(prompt=prompt, max_tokens=1)
        h.run_until_idle(50)
        stores = [job for r in h.history for job in r.store_jobs]
        assert stores, "the prompt was not offloaded"
        counters = kvc.ledger.counters()
        assert counters["failed_jobs"] == len(stores), counters  # each failure recorded
        assert counters["outstanding_jobs"] == 0 and counters["pinned_pages"] == 0, counters  # pins released
        assert kvc.ledger.violations == []
        # vLLM did not publish the failed stores: the same prompt after a prefix-cache reset
        # loads nothing from the CPU tier, and its output is computed again, the same.
        assert h.reset_prefix_cache()
        again = h.add_request(prompt=prompt, max_tokens=1)
        h.run_until_idle(50)
        assert [c for c in h.load_checks if c.req_id == again] == []
        assert h.output_tokens(again)[0] == h.output_tokens(first)[0]
        stores = [job for r in h.history for job in r.store_jobs]  # the second run's stores too
        assert kvc.ledger.counters()["failed_jobs"] == len(stores) > 1
    finally:
        h.close()
        kvc.close()
    events = read_journal(journal).events
    failed = [e.job for e in events if isinstance(e, JobFailed)]
    assert sorted(failed) == sorted(stores)
    # Recorded before the report that completes it, which the ledger needs outstanding.
    for job in failed:
        at = next(i for i, e in enumerate(events) if isinstance(e, JobFailed) and e.job == job)
        assert any(isinstance(e, JobReported) and e.job == job for e in events[at + 1 :])

    from kvreplay.cli import main

    assert main(["check", str(journal)]) == 0
    capsys.readouterr()
    assert main(["show", str(journal), "--job", str(failed[0])]) == 0
    assert "complete, failed" in capsys.readouterr().out
