"""Plants for native vLLM servers of the served model-kind tests, chosen by ``KVTEST_PLANTS``.

Put on ``PYTHONPATH`` of a test's native server only (tests/serve/test_model_kinds.py): Python
imports ``sitecustomize`` at start in every process of the server, and this one patches a module
when it is first imported (a meta-path hook), so processes that never import it pay nothing.
``KVTEST_PLANTS`` is a comma-separated list of:

- ``evict-on-free``: vLLM's ``BlockPool.free_blocks`` (vllm/v1/core/block_pool.py, vLLM 0.32.0)
  evicts a block from the prefix cache through vLLM's own ``evict_blocks`` as soon as its last
  reference goes, as kvcached's ``KVCACHED_MAX_CACHED_TOKENS=0`` does
  (kvcached/vllm/engine_core/block_pool.py, ``_cap_cache``): native vLLM under the cache state
  kvcached's setting makes. The block stays in vLLM's free queue; only its hash goes.
- ``zero-loads``: the offload worker of kvcached's CPU spec (kvcached/vllm/offload/cpu.py) zeroes
  every block it loads from the CPU tier after copying it: a loaded block corrupted, the bug the
  served comparison must be able to see.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

PLANTS = {p.strip() for p in os.environ.get("KVTEST_PLANTS", "").split(",") if p.strip()}


def _evict_on_free(module: ModuleType) -> None:
    pool_class = module.BlockPool
    free_blocks = pool_class.free_blocks

    def free_and_evict(self: Any, ordered_blocks: Any) -> None:
        blocks = list(ordered_blocks)
        free_blocks(self, blocks)
        gone = {
            b.block_id
            for b in blocks
            if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None and b.pool in (None, self)
        }
        if gone:
            self.evict_blocks(gone)

    pool_class.free_blocks = free_and_evict


def _zero_loads(module: ModuleType) -> None:
    worker_class = module.KvcachedCPUOffloadingWorker
    init = worker_class.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        copy = self.copy_fn

        def copy_then_zero(plan: Any, device_tensors: Any, host_tensors: Any) -> None:
            copy(plan, device_tensors, host_tensors)
            if not plan.is_store:
                for c in plan.copies:
                    dev = device_tensors[c.tensor_idx]
                    dev[c.device_blocks.to(dev.device), : c.num_bytes] = 0

        self.copy_fn = copy_then_zero

    worker_class.__init__ = __init__


_PATCHES: dict[str, tuple[str, Callable[[ModuleType], None]]] = {
    "evict-on-free": ("vllm.v1.core.block_pool", _evict_on_free),
    "zero-loads": ("kvcached.vllm.offload.cpu", _zero_loads),
}


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, patch: Callable[[ModuleType], None]) -> None:
        self.target, self.patch = target, patch

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module
        patch = self.patch

        def exec_module(module: ModuleType) -> None:
            execute(module)
            patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


for _name in sorted(PLANTS):
    if _name not in _PATCHES:
        raise SystemExit(f"KVTEST_PLANTS: unknown plant {_name!r}; one of {', '.join(_PATCHES)}")
    sys.meta_path.insert(0, _Hook(*_PATCHES[_name]))
