"""HiCache's copy engine on a CPU: real copies between real buffers, finished when a test says so.

On a CPU, SGLang has neither the copy kernels nor the finish events its GPU copy engine relies
on. ``DeferredCopies`` stands in for both, the way a stream would, so that a copy of slots
unmapped meanwhile shows as wrong bytes, as on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch


class DeferredEvent:
    """A finish event over ``DeferredCopies``: done when the copies queued before ``record`` ran."""

    def __init__(self, copies: DeferredCopies) -> None:
        self._copies = copies
        self._mark = 0

    def record(self, stream: Any = None) -> None:
        self._mark = self._copies.queued

    def query(self) -> bool:
        return self._copies.ran >= self._mark

    def synchronize(self) -> None:
        self._copies.run(self._mark)

    def wait(self, stream: Any = None) -> None:
        pass  # one host "stream": order is queue order

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class DeferredCopies:
    """The copy stand-in: ``transfer_kv_direct`` queues, ``run`` copies.

    NOTE: on a GPU, SGLang's ``L2TransferEngine`` runs its copies on a side stream and records a
    finish event after them; the copy reads the device slots some time later, and SGLang learns
    it is done from ``event.query()`` or ``event.synchronize()``. On a CPU, SGLang has neither:
    its copy kernels (``sgl_kernel.kvcacheio.transfer_kv_direct``, imported by
    ``mem_cache/pool_host/mha.py`` only under CUDA) are missing, and ``torch.cpu.Event`` is done
    at once.

    NOTE: this class stands in for both, the way a stream would: a copy is queued with its
    indices and copies the bytes when it runs, reading the source *then*. An event recorded after
    it is done once the copies before it have run (``DeferredEvent``). So a copy whose source
    slots were unmapped meanwhile copies zeros, as a GPU copy of a freed page reads whatever is
    there, and the test sees wrong bytes rather than a flag.
    """

    def __init__(self) -> None:
        self._queue: list[Callable[[], None]] = []
        self.queued = 0
        self.ran = 0

    def transfer_kv_direct(
        self,
        src_layers: list[torch.Tensor],
        dst_layers: list[torch.Tensor],
        src_indices: torch.Tensor,
        dst_indices: torch.Tensor,
        page_size: int,
    ) -> None:
        """``sgl_kernel.kvcacheio.transfer_kv_direct``'s contract (slot ``src_indices[i]`` of each
        source layer to slot ``dst_indices[i]`` of its destination), deferred."""
        src, dst = src_indices.clone(), dst_indices.clone()
        self._queue.append(lambda: copy_slots(src_layers, dst_layers, src, dst))
        self.queued += 1

    def run(self, upto: int | None = None) -> None:
        """Run the queued copies, all of them or those before mark ``upto``."""
        end = self.queued if upto is None else upto
        while self.ran < end:
            self._queue[self.ran]()
            self._queue[self.ran] = _done
            self.ran += 1

    @property
    def pending(self) -> int:
        return self.queued - self.ran

    def event_pair(self) -> tuple[DeferredEvent, DeferredEvent, bool]:
        """``l2_transfer.make_timing_event_pair``'s result: start and finish events, no timing."""
        return DeferredEvent(self), DeferredEvent(self), False

    @contextmanager
    def installed(self) -> Iterator[DeferredCopies]:
        """SGLang's host pool and transfer engine use this stand-in while the block runs.

        NOTE: SGLang up to 0.5.21 takes its streams from ``torch.get_device_module()``, which from
        torch 2.14 is ``torch.cuda`` on a CUDA build with no device (0.5.22's
        ``get_device_module`` checks for one); the copy engine's streams are then
        ``torch.cpu``'s here, as they are under 0.5.22 on.
        """
        from sglang.srt.managers import cache_controller
        from sglang.srt.mem_cache import l2_transfer
        from sglang.srt.mem_cache.pool_host import mha

        saved_kernel = mha.__dict__.get("transfer_kv_direct", _MISSING)
        saved_pair = l2_transfer.make_timing_event_pair
        no_device = [
            m for m in (l2_transfer, cache_controller)
            if getattr(m, "device_module", None) is torch.cuda and not torch.cuda.is_available()
        ]  # fmt: skip
        mha.transfer_kv_direct = self.transfer_kv_direct
        l2_transfer.make_timing_event_pair = self.event_pair
        for m in no_device:
            m.device_module = torch.cpu
        try:
            yield self
        finally:
            for m in no_device:
                m.device_module = torch.cuda
            l2_transfer.make_timing_event_pair = saved_pair
            if saved_kernel is _MISSING:
                del mha.transfer_kv_direct
            else:
                mha.transfer_kv_direct = saved_kernel


def copy_slots(
    src_layers: list[torch.Tensor], dst_layers: list[torch.Tensor], src_indices: torch.Tensor, dst_indices: torch.Tensor
) -> None:
    """The copy ``transfer_kv_direct`` makes: slot ``src_indices[i]`` of each source layer to slot
    ``dst_indices[i]`` of its destination, each index on its tensor's device."""
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device, torch.long)] = src[src_indices.to(src.device, torch.long)].to(dst.device)


def _done() -> None:
    pass


_MISSING = object()
