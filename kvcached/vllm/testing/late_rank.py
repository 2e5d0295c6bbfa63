"""A CPU offloading spec whose tensor-parallel rank 1 reports its copies late (test scaffolding).

With tensor parallelism every rank copies its own share of a job and reports it; vLLM's
scheduler-side connector sees a job done only when every rank reported, and kvcached's ledger
keeps the job's pages until then (the golden trace ``tp2-late-report``). This spec makes that
happen in a real server: it is kvcached's CPU spec, except that on rank 1 the worker reports
each job ``DELAY_STEPS`` steps after rank 0 and copies only when it reports (the latest moment a
real asynchronous copy may touch the memory). Select it in the server's
``kv_connector_extra_config`` with ``"spec_name": "LateRankOffloadingSpec"`` and
``"spec_module_path": "kvcached.vllm.testing.late_rank"``; nothing in the served package reads it.
"""

from __future__ import annotations

from typing import Any

from kvcached.vllm.offload.cpu import KvcachedCPUOffloadingSpec, KvcachedCPUOffloadingWorker

SPEC = ("LateRankOffloadingSpec", "kvcached.vllm.testing.late_rank")
LATE_RANK = 1
DELAY_STEPS = 3


class LateRankOffloadingSpec(KvcachedCPUOffloadingSpec):  # type: ignore[misc,unused-ignore]
    def get_worker(self, kv_caches: Any) -> KvcachedCPUOffloadingWorker:
        from vllm.distributed import get_tensor_model_parallel_rank

        worker = super().get_worker(kv_caches)
        if get_tensor_model_parallel_rank() == LATE_RANK:
            assert isinstance(worker, KvcachedCPUOffloadingWorker)
            worker.delay_steps = DELAY_STEPS
            worker.copy_at_completion = True
        return worker  # type: ignore[no-any-return,unused-ignore]
