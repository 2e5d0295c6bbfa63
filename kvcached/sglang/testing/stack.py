"""One SGLang KV stack on kvcached, as SGLang's pool builder and HiCache assemble it, for tests.

The parts are SGLang's own: ``MHATokenToKVPool`` (its K and V tensors made by kvcached's hook),
the token allocator (kvcached's subclass, which the server's plugin puts in SGLang's place),
``MHATokenToKVPoolHost`` (HiCache's host tier, layer-first, direct copies) and
``HiCacheController``, whose ``write`` / ``load`` / ``start_loading`` / ``reset`` the tests call as
SGLang's tree cache does. Only the copy kernels and their events are stand-ins
(``copies.DeferredCopies``). ``step`` is what kvcached's hook on ``Scheduler.get_next_batch_to_run``
does at each scheduler step; ``drain_acks`` is what the tree's ``writing_check`` /
``loading_check`` do with the ack queues (pop what has finished, in order).
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch

from ..engine import SglangConfig, SglangEngine, engine_of
from ..hooks import pools_on_kvcached
from .copies import DeferredCopies


class HiCacheStack:
    def __init__(
        self, config: SglangConfig, *, size: int = 511, head_num: int = 2, head_dim: int = 8, layers: int = 2
    ) -> None:
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        from ..allocator import KvcachedTokenAllocator

        with pools_on_kvcached(config):
            self.pool = MHATokenToKVPool(
                size=size,
                page_size=1,
                dtype=torch.float32,
                head_num=head_num,
                head_dim=head_dim,
                layer_num=layers,
                device="cpu",
                enable_memory_saver=False,
                enable_alt_stream=False,
            )
        engine = engine_of(self.pool)
        assert engine is not None
        self.engine: SglangEngine = engine
        self.allocator = KvcachedTokenAllocator(size, torch.float32, "cpu", self.pool, need_sort=False)
        self.host = _host_pool(MHATokenToKVPoolHost, self.pool, size, layers)
        self.copies = DeferredCopies()
        self._installed = self.copies.installed()
        self._installed.__enter__()  # before the controller: its copy engine makes its streams
        self.controller = HiCacheController(
            self.allocator, self.host, 1, None, threading.Event(), write_policy="write_through", io_backend="direct"
        )

    def fill(self, slots: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
        """Write KV into ``slots`` of every layer; returns what was written, per buffer."""
        g = torch.Generator().manual_seed(seed)
        out = {}
        for layer in range(self.pool.layer_num):
            for name, buf in (("k", self.pool.k_buffer), ("v", self.pool.v_buffer)):
                data = torch.randn((len(slots), *buf[layer].shape[1:]), generator=g)
                buf[layer][slots] = data
                out[f"{name}{layer}"] = data
        return out

    def host_bytes(self, host_slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            f"{name}{layer}": buf[layer][host_slots].clone()
            for layer in range(self.pool.layer_num)
            for name, buf in (("k", self.host.k_buffer), ("v", self.host.v_buffer))
        }

    def device_bytes(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            f"{name}{layer}": buf[layer][slots].clone()
            for layer in range(self.pool.layer_num)
            for name, buf in (("k", self.pool.k_buffer), ("v", self.pool.v_buffer))
        }

    def step(self) -> None:
        """One scheduler step that builds nothing: what the test does next happens between steps."""
        self.engine.bridge.step()
        self.engine.bridge.step_done()

    def drain_acks(self) -> int:
        """Pop the finished acks at the head of both queues (the tree's checks); how many."""
        n = 0
        for queue in (self.controller.ack_write_queue, self.controller.ack_load_queue):
            while queue and queue[0].finish_event.query():
                queue.pop(0)
                n += 1
        return n

    def flush(self) -> None:
        """``Scheduler.flush_cache``: the tree's reset (the controller's, then the host pool's),
        then the allocator's ``clear``."""
        self.controller.reset()
        self.host.clear()
        self.allocator.clear()

    @property
    def mapped_pages(self) -> int:
        return self.engine.manager.state().mapped

    def close(self) -> None:
        self._installed.__exit__(None, None, None)
        self.engine.close()


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _host_pool(cls: Any, pool: Any, size: int, layers: int) -> Any:
    """HiCache's host pool over ``pool``: twice its size, layer-first, unpinned.

    NOTE: SGLang up to 0.5.22 builds it from the device pool itself (``device_pool``); 0.5.23 from the
    pool's buffer description (``MHATokenToKVPool._mha_buffer_info``) with the device capacity
    and layer range spelled out. The first parameter's name says which constructor this is.
    """
    common = dict(pin_memory=False, device="cpu")
    first = list(inspect.signature(cls.__init__).parameters)[1]
    if first == "device_pool":
        return cls(pool, 2.0, 0, 1, "layer_first", **common)
    return cls(
        pool._mha_buffer_info(), 2.0, 0, 1, "layer_first", **common,
        device_capacity_tokens=size, start_layer=0, end_layer=layers - 1,
    )  # fmt: skip
