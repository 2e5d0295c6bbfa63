"""The end of a scheduler call under either engine, and its page maps and unmaps per step.

Both wings end a scheduler call alike (``StepEnds``): the allocator takes what the ledger let go
since (``KVCacheManager.drain_releasable``: after the call's events, never from inside one), and
at the end of a step the step's page ops are counted. What closes a build stays the wing's (vLLM's
``Bridge.close_build``, SGLang's ``Bridge.step``), as does when a call ends: vLLM's
``scheduler_calls`` wrapper, SGLang's ``get_next_batch_to_run`` hook.

On CUDA a page op is one ``cuMemMap`` (with its ``cuMemSetAccess``) or ``cuMemUnmap`` per layer
region in each worker, 20 to 40 us each (``benchmarks/bench_backend_cuda.py``), and upstream
kvcached measured its non-contiguous layout losing 20% of an H100's throughput to them. The
reserve and the pages kept until the ledger lets them go exist so that a decode step in steady
state makes none. This counts what each step did make: the allocator counts its ops
(``PageAllocator.ops``), and the wing marks the end of each step (``StepEnds.step_ended``:
vLLM's ``Scheduler.schedule``, SGLang's ``get_next_batch_to_run``), so a step's count is what
was decided since the previous step ended. ``vllm:kvcached_page_ops_per_step`` exports it.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Final

from ..service.messages import Histogram

if TYPE_CHECKING:
    from ..kv_cache_manager import KVCacheManager

# Upper bounds of the buckets (Prometheus' ``le``); a last bucket holds the rest (+Inf).
BOUNDS: Final = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)


class OpsPerStep:
    """Logical page ops (maps and unmaps) per step, bucketed by ``BOUNDS``."""

    __slots__ = ("_counts", "_seen", "_sum")

    def __init__(self, ops_at_start: int = 0) -> None:
        self._counts = [0] * (len(BOUNDS) + 1)
        self._sum = 0
        # The allocator's op count when the last step ended: at first, what the engine's start
        # mapped (the first blocks and the reserve), which no step decided.
        self._seen = ops_at_start

    def step_ended(self, ops_so_far: int) -> None:
        n = ops_so_far - self._seen
        self._seen = ops_so_far
        self._counts[bisect.bisect_left(BOUNDS, n)] += 1
        self._sum += n

    def snapshot(self) -> Histogram:
        return Histogram(bounds=BOUNDS, counts=tuple(self._counts), sum=self._sum)


class StepEnds:
    """The end of each scheduler call (``drain``) and of each step (``step_ended``) of one engine."""

    __slots__ = ("manager", "ops")

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.ops = OpsPerStep(manager.allocator.ops)  # what the start mapped is no step's

    def drain(self) -> None:
        """Let the allocator unmap what the ledger released, after events it did not make."""
        self.manager.drain_releasable()

    def step_ended(self) -> None:
        """The step has decided (drained already): count the page ops made since the last one."""
        self.ops.step_ended(self.manager.allocator.ops)
