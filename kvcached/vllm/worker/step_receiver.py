"""The worker's end of the step channel (``kvcached.vllm.step_channel``): decisions applied.

Each worker owns its KV range. ``GPUModelRunner.execute_model`` (wrapped, see ``patches``) first
applies the batch its ``SchedulerOutput`` carries to this worker's range, then runs the step; an
idle engine's batch arrives through ``collective_rpc`` (``flush_on_worker``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from ...backends.base import Backend
from ...errors import ConfigError
from ...settings import format_size
from .. import patches
from ..kv_layout import KVPlan
from ..step_channel import ATTR, ChannelError

log = logging.getLogger("vllm.kvcached")


def flush_on_worker(_worker: Any, message: tuple[int, ...]) -> None:
    """What ``collective_rpc`` runs on each worker (vLLM passes its worker wrapper first)."""
    worker = _WORKER
    if worker is not None:
        worker.apply(message)


class WorkerPages:
    """This worker's range and the batches applied to it."""

    def __init__(self, backend: Backend, plan: KVPlan) -> None:
        g = plan.geometry
        self.backend = backend
        self.num_pages = g.num_pages
        self.regions = g.regions
        self.blocks_per_page = g.blocks_per_page
        self.seq = 0
        self.maps = self.unmaps = 0

    def apply(self, message: tuple[int, ...]) -> None:
        seq, bpp, *ops = message
        if seq != self.seq + 1:
            raise ChannelError(
                f"kvcached: page decisions batch {seq} reached this worker after batch {self.seq}; "
                "the executor lost or reordered a step"
            )
        if bpp != self.blocks_per_page:
            raise ChannelError(
                f"kvcached: the scheduler puts {bpp} blocks on a page, this worker's KV layout {self.blocks_per_page}; "
                "its ranks' KV caches differ (pipeline stages of unequal layers?)"
            )
        self.seq = seq
        if seq == 1:
            self._forget_warm_up()
            self._apply(ops)
            self._check_after_warm_up()
            return
        if ops:
            self._apply(ops)

    def _check_after_warm_up(self) -> None:
        """NOTE: the first batch maps what the scheduler chose to start with (vLLM's null block's
        page, the reserve): that and nothing more may be mapped once warm-up's pages are gone.
        Upstream kvcached's users met engines that backed the whole KV range while serving
        healthily whenever a runner change routed the allocation around it; here the worker
        says in one line what it holds, and refuses a range holding more than was decided."""
        b = self.backend
        decided = (self.maps - self.unmaps) * self.regions
        if b.mapped_count != decided:
            raise ChannelError(
                f"kvcached: after warm-up this worker's KV range has {b.mapped_count} page slots mapped, the "
                f"scheduler decided {decided}: the memory is not elastic (a runner that allocated around kvcached?); "
                "disable kvcached"
            )
        log.info(
            "[kvcached] worker pid %d: %d pages x %d regions, mapped as the scheduler decides (step channel); "
            "after warm-up %d of %d pages mapped (%s), as decided",
            os.getpid(),
            self.num_pages,
            self.regions,
            self.maps - self.unmaps,
            self.num_pages,
            format_size(decided * b.page_bytes),
        )

    def _apply(self, ops: list[int]) -> None:
        b = self.backend
        if b.kind == "cuda" and any(op < 0 for op in ops):
            # Kernels of the step before this one may still be queued (async scheduling launches
            # step N+1 before N's are done); an unmap must not pull memory from under them.
            import torch

            torch.cuda.synchronize(b.device)  # type: ignore[attr-defined]
        n = self.num_pages
        for op in ops:
            if op >= 0:
                for r in range(self.regions):
                    b.map_page(r * n + op)
                self.maps += 1
            else:
                for r in range(self.regions):
                    b.unmap_page(r * n + ~op)
                self.unmaps += 1

    def _forget_warm_up(self) -> None:
        """vLLM's profiling and warm-up ran on this range before any scheduler existed; the
        scheduler's first batch starts from nothing mapped."""
        b = self.backend
        unmap_all = getattr(b, "unmap_all", None)
        if unmap_all is not None:  # host: drop what warm-up wrote; nothing is mapped yet
            unmap_all()
            unlink = getattr(b, "unlink", None)
            if unlink is not None:
                unlink()  # no other process opens this worker's file: drop the name now
            return
        import torch

        torch.cuda.synchronize(b.device)  # type: ignore[attr-defined]
        for slot in b.mapped_pages():  # mapped by kv_memory for warm-up
            b.unmap_page(slot)


_WORKER: WorkerPages | None = None


def install_worker(backend: Backend, plan: KVPlan) -> None:
    """In a worker, where its KV memory was just made: apply each step's decisions to it before
    the step runs (the patch table's runner patches, installed now that the runner is loaded).
    Idempotent per process (one worker per process under every executor)."""
    global _WORKER
    _WORKER = WorkerPages(backend, plan)
    patches.install(patches.When.KV_ALLOCATION, None)
    # NOTE: the runner targets are loaded_only (a module this worker has not imported is not
    # its runner). If none was there, no step would apply the scheduler's page decisions and the
    # worker would serve on pages the scheduler thinks unmapped: refused instead (vLLM 0.34
    # removed the V1 runner module; a vLLM that moves the V2 one lands here, not in a bad run).
    if not any(t.endswith(".execute_model") for t in patches.installed()):
        raise ConfigError(
            f"kvcached: no model runner it knows is loaded in this worker (vLLM {patches.vllm_version()}; "
            "kvcached/vllm/patches.py names the runners' execute_model): nothing would apply its page "
            "decisions; disable kvcached (ENABLE_KVCACHED=0)"
        )


def wrap_execute_model(original: Callable[..., Any], _context: object) -> Callable[..., Any]:
    """``GPUModelRunner.execute_model``: this step's decisions first, then vLLM's step."""

    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        worker = _WORKER
        if worker is not None:
            message = getattr(scheduler_output, ATTR, None)
            if message is not None:
                worker.apply(message)
            elif scheduler_output.total_num_scheduled_tokens > 0:
                raise ChannelError(
                    "kvcached: a step reached this worker without the scheduler's page decisions; "
                    "this executor does not carry SchedulerOutput whole: disable kvcached"
                )
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model
