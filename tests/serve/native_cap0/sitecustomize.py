"""Native vLLM with kvcached's ``KVCACHED_MAX_CACHED_TOKENS=0`` cache state, for one served test.

Put on ``PYTHONPATH`` of a native server only (tests/serve/test_model_kinds.py): Python imports
``sitecustomize`` at start in every process of the server, and this one wraps vLLM's
``BlockPool.free_blocks`` (vllm/v1/core/block_pool.py, vLLM 0.32.0) so that a block whose last
reference goes is evicted from the prefix cache at once through vLLM's own ``evict_blocks``,
as kvcached's cap of 0 cached blocks does (kvcached/vllm/engine_core/block_pool.py,
``_cap_cache``). The block stays in vLLM's free queue; only its hash goes. Nothing else of
vLLM changes, so the cached-token counts such a server reports are native vLLM's own under the
cache state kvcached's setting makes. It patches the module when vLLM imports it (a meta-path
hook), so processes that never import vLLM pay nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

TARGET = "vllm.v1.core.block_pool"


def _patch(module: ModuleType) -> None:
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


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _Hook())
