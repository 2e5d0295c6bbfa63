"""What kvcached relies on in vLLM's BlockPool beyond its public methods (``vllm_internals``).

These fail, with a message that says what changed and where kvcached depends on it, when a vLLM
release renames a private name or stops handing out the head of its free queue.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

vllm_block_pool = pytest.importorskip("vllm.v1.core.block_pool")
pytestmark = pytest.mark.vllm

import vllm  # noqa: E402
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue  # noqa: E402

from kvcached.backends.host import HostBackend  # noqa: E402
from kvcached.errors import ConfigError, KvcachedError  # noqa: E402
from kvcached.kv_cache_manager import KVCacheManager, KVGeometry  # noqa: E402
from kvcached.vllm_bridge import vllm_internals  # noqa: E402
from kvcached.vllm_bridge.block_pool import install_page_aware_pool  # noqa: E402

PAGE = 64 * 1024
WHERE = "kvcached/vllm_bridge/vllm_internals.py depends on it"


def pool(num_blocks: int = 16):
    return vllm_block_pool.BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)


def test_the_private_names_kvcached_uses_are_on_vllms_block_pool() -> None:
    p = pool()
    for name in vllm_internals.PRIVATE_NAMES:
        assert hasattr(p, name), f"vLLM {vllm.__version__}'s BlockPool has no {name}: {WHERE}"
    assert isinstance(p._reuse_watchers, dict), f"BlockPool._reuse_watchers is no longer a dict: {WHERE}"
    params = list(inspect.signature(p._notify_reuse).parameters)
    assert params == ["blocks"], f"BlockPool._notify_reuse takes {params}, not (blocks): {WHERE}"
    vllm_internals.check(p)  # and the startup check agrees


def test_vllms_get_new_blocks_hands_out_the_head_of_its_free_queue() -> None:
    """The seam: blocks moved to the head of the free queue are the ones handed out, in order."""
    p = pool()
    chosen = [p.blocks[9], p.blocks[3], p.blocks[12]]
    q = p.free_block_queue
    for b in chosen:
        q.remove(b)
    q.prepend_n(chosen)
    got = vllm_block_pool.BlockPool.get_new_blocks(p, 3)
    assert [b.block_id for b in got] == [9, 3, 12], (
        f"vLLM {vllm.__version__}'s BlockPool.get_new_blocks no longer pops the head of free_block_queue: {WHERE}"
    )


def _manager(num_blocks: int = 16) -> KVCacheManager:
    geo = KVGeometry(num_blocks=num_blocks, block_bytes=16 * 1024, page_bytes=PAGE)
    return KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE))


def test_a_block_pool_without_a_private_name_is_refused_at_install(monkeypatch) -> None:
    monkeypatch.delattr(vllm_block_pool.BlockPool, "_notify_reuse")
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool()))
    with pytest.raises(ConfigError) as e:
        install_page_aware_pool(scheduler, _manager())
    msg = str(e.value)
    assert "\n" not in msg and "_notify_reuse missing" in msg and "vllm_internals.py" in msg


def test_a_vllm_that_hands_out_other_blocks_fails_loudly(monkeypatch) -> None:
    def popright_n(self, n):  # a vLLM that takes from the tail
        blocks = self.get_all_free_blocks()[-n:]
        for b in blocks:
            self.remove(b)
        return blocks

    monkeypatch.setattr(FreeKVCacheBlockQueue, "popleft_n", popright_n)
    p = pool()
    install_page_aware_pool(SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=p)), _manager())
    with pytest.raises(KvcachedError, match="did not hand out the head of its free queue"):
        p.get_new_blocks(2)
