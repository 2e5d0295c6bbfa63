"""kvcached under one test harness on host backends: the two callbacks ``Harness`` takes.

Tests that put kvcached's engine under vLLM's real scheduler (``kvcached.vllm.testing.harness``)
each needed the same two pieces: the harness's ``kv_memory`` (one host backend per rank, the
geometry fixed by the first rank's blocks) and its ``on_scheduler_built`` (``assemble`` with the
test's ``EngineConfig``). They live here once; the PR #598 scenarios and kvsim keep their own,
which choose backends and configs per variant.
"""

from __future__ import annotations

from typing import Any

import torch

from ...backends.host import HostBackend
from ...kv_cache_manager import KVGeometry
from ..engine_core.engine import Engine, EngineConfig, assemble


class HostEngine:
    """Pass ``kv_memory`` and ``on_scheduler_built`` to ``Harness``; ``engine`` is then what
    ``assemble`` built with ``config``, on pages of ``page_blocks`` blocks."""

    def __init__(self, config: EngineConfig, *, page_blocks: int = 4) -> None:
        self.config = config
        self.page_blocks = page_blocks
        self.backends: list[HostBackend] = []
        self.geometry: KVGeometry | None = None
        self.engine: Engine | None = None

    def kv_memory(self, num_blocks: int, block_bytes: int) -> torch.Tensor:
        if self.geometry is None:
            page = block_bytes * self.page_blocks
            self.geometry = KVGeometry(num_blocks=num_blocks, block_bytes=block_bytes, page_bytes=page)
        g = self.geometry
        backend = HostBackend(page_bytes=g.page_bytes)
        backend.reserve(g.backend_pages)
        self.backends.append(backend)
        # One row per block from the start of the range, as vLLM views its KV tensor.
        return backend.tensor()[: num_blocks * block_bytes].view(num_blocks, block_bytes)

    def on_scheduler_built(self, scheduler: Any) -> None:
        assert self.geometry is not None, "kv_memory runs before the scheduler is built"
        self.engine = assemble(scheduler, self.geometry, self.backends, self.config)

    @property
    def e(self) -> Engine:
        assert self.engine is not None, "the harness has not built its scheduler yet"
        return self.engine

    def close(self) -> None:
        """The engine (its journal, its service), then the backends' memory."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        for b in self.backends:
            b.close()
        self.backends.clear()
