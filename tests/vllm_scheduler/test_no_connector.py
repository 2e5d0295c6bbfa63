"""An engine without a KV connector gives pages back: each scheduler call closes the open build.

With no connector, ``build_connector_meta`` is never called, so nothing closes a build and the
ledger's grace pins (which end at the next build) would keep every freed page mapped for good.
The engine's wrapper of each scheduler call has the bridge close the build instead
(``engine_core.scheduler_calls``). vLLM's real
BlockPool under kvcached's page-aware pool; the scheduler's calls are stand-ins that free blocks
as vLLM's ``Scheduler._free_blocks`` does (through the pool), since a scheduler without a model
runner has no other way to finish a request here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

vllm_block_pool = pytest.importorskip("vllm.v1.core.block_pool")
pytestmark = pytest.mark.vllm

from kvcached.backends.host import HostBackend  # noqa: E402
from kvcached.kv_cache_manager import KVCacheManager, KVGeometry  # noqa: E402
from kvcached.vllm.engine_core import scheduler_calls  # noqa: E402
from kvcached.vllm.engine_core.block_pool import install_page_aware_pool  # noqa: E402
from kvcached.vllm.engine_core.bridge import install_bridge  # noqa: E402
from kvcached.vllm.engine_core.engine import Engine  # noqa: E402

PAGE = 64 * 1024


def engine(close: bool) -> tuple[SimpleNamespace, KVCacheManager, list]:  # type: ignore[type-arg]
    pool = vllm_block_pool.BlockPool(num_gpu_blocks=32, enable_caching=False, hash_block_size=16)
    geo = KVGeometry(num_blocks=32, block_bytes=16 * 1024, page_bytes=PAGE)
    m = KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE), min_reserved=0, max_reserved=0)
    held: list = []

    def schedule() -> None:  # a step: a request ends, its blocks go back to the pool
        if held:
            pool.free_blocks(held.pop())

    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool), connector=None, schedule=schedule)
    bridge = install_bridge(scheduler, m.recorder, offloading=False)
    wrapper = install_page_aware_pool(scheduler, m)
    if close:
        engine = Engine(m.recorder, manager=m, pool=wrapper, bridge=bridge, service=None)
        scheduler_calls.install(scheduler, engine)
    held.append(pool.get_new_blocks(12))  # three pages
    return scheduler, m, held


@pytest.mark.parametrize("close", [True, False])
def test_freed_pages_go_back_after_the_next_scheduler_call(close: bool) -> None:
    scheduler, m, _ = engine(close)
    assert m.backend.mapped_count >= 3
    scheduler.schedule()
    if close:
        assert m.backend.mapped_count <= 1  # the page with vLLM's null block may stay
        assert m.recorder.ledger.violations == []
    else:  # the bug: a grace pin that no build ever ends
        assert m.backend.mapped_count >= 3 and m.recorder.ledger.pending_grace_pages() >= 3
