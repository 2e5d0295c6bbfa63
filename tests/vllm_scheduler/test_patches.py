"""The patch table against the vLLM installed: every target there, and a moved one refused.

``kvcached.vllm.patches`` declares each vLLM attribute kvcached changes and the names it relies
on beyond public methods (``RELIED_ON``, used by ``engine_core.pool_seam``). These fail, with a
message that says what changed and where kvcached depends on it, when a vLLM release renames a
target, a private name, or stops handing out the head of its free queue.
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
from kvcached.vllm import patches  # noqa: E402
from kvcached.vllm.engine_core.block_pool import install_page_aware_pool  # noqa: E402

PAGE = 64 * 1024
WHERE = "kvcached/vllm/patches.py (RELIED_ON), engine_core/pool_seam.py and block_pool.py depend on it"


def pool(num_blocks: int = 16):
    return vllm_block_pool.BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)


def test_the_private_names_kvcached_uses_are_on_vllms_block_pool() -> None:
    p = pool()
    for name in ("_reuse_watchers", "_notify_reuse"):
        assert name in patches.by_name("pool seam").attrs
        assert hasattr(p, name), f"vLLM {vllm.__version__}'s BlockPool has no {name}: {WHERE}"
    assert isinstance(p._reuse_watchers, dict), f"BlockPool._reuse_watchers is no longer a dict: {WHERE}"
    params = list(inspect.signature(p._notify_reuse).parameters)
    assert params == ["blocks"], f"BlockPool._notify_reuse takes {params}, not (blocks): {WHERE}"
    patches.check_object(p, patches.by_name("pool seam"))  # and the engine build's check agrees


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
    assert "\n" not in msg and "vllm.v1.core.block_pool.BlockPool._notify_reuse is missing" in msg
    assert f"this vLLM ({vllm.__version__})" in msg
    assert patches.SENTINEL not in vars(scheduler.kv_cache_manager.block_pool)  # nothing was changed


def test_a_block_without_its_hash_field_is_refused_at_install(monkeypatch) -> None:
    """``free_blocks`` reads KVCacheBlock's hash field (``_block_hash`` before vLLM 0.34,
    ``block_hash`` from it) after vLLM's own free has run: a vLLM without it must be refused
    before anything changes, not fail half-way through a free."""
    import msgspec

    from kvcached.vllm.engine_core.block_pool import HASH_FIELD

    row = patches.holding(*HASH_FIELD)
    assert row.attrs == (("block_hash",) if patches.release(vllm.__version__) >= (0, 34, 0) else ("_block_hash",))
    # A vLLM that renamed the field (deleting a dataclass slot would break KVCacheBlock itself).
    renamed = tuple(
        msgspec.structs.replace(p, attrs=("_block_hash_renamed",)) if p.name == row.name else p
        for p in patches.RELIED_ON
    )
    monkeypatch.setattr(patches, "RELIED_ON", renamed)
    scheduler = SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=pool()))
    with pytest.raises(ConfigError) as e:
        install_page_aware_pool(scheduler, _manager())
    msg = str(e.value)
    assert "\n" not in msg and "KVCacheBlock._block_hash_renamed is missing" in msg, msg
    assert patches.SENTINEL not in vars(scheduler.kv_cache_manager.block_pool)


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


def test_every_target_of_the_patch_table_is_in_this_vllm() -> None:
    """Process-wide targets are checked by the installer itself; the objects' targets on vLLM's
    classes (an instance has what its class has, and the per-instance names are checked at build)."""
    found = {p.name for p, _ in patches.check(p for p in patches.PATCHES if not p.loaded_only)}
    assert {"startup checks", "kvcached under the scheduler"} <= found
    # allocate_kv_cache in one of its forms (vLLM 0.34 added allocate=), never both.
    assert len(found & {"KV cache on kvcached pages", "KV cache on kvcached pages (allocate=)"}) == 1, found
    for p in patches.PATCHES:
        if p.how is patches.How.ADDED or not p.holds_for(vllm.__version__):
            continue
        if p.loaded_only and p.optional:
            continue  # V2-runner names: present only where that runner is used
        # The table's own checker: a missing target of a required row is refused naming it, an
        # optional row's is left out.
        row = _eager(p)
        assert [r for r, _ in patches.check((row,))] == [row], f"vLLM {vllm.__version__} lacks a target of {p.name}"
    # What is only read is partly instance state: looked for on a real pool, its queue and a block.
    # The optional names (read with a fallback, not refused where missing) are on 0.32 and 0.33 too.
    live = pool()
    q = live.free_block_queue
    objects = {"BlockPool": live, "FreeKVCacheBlockQueue": q, "KVCacheBlock": q.fake_free_list_head}
    for p in patches.RELIED_ON:
        if not p.holds_for(vllm.__version__):
            continue  # another release's form of a moved target
        assert p.owner is not None, p.name
        obj = objects[p.owner]
        patches.check_object(obj, p)
        assert (type(obj).__module__, type(obj).__name__) == (p.module, p.owner), p.name


def _eager(p: patches.Patch) -> patches.Patch:
    """The patch as if its module were loaded (a runner module is imported here to look)."""
    import msgspec

    return msgspec.structs.replace(p, loaded_only=False)


def test_a_missing_target_is_refused_in_one_line_before_anything_changes(monkeypatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    init = Scheduler.__init__
    monkeypatch.delattr(vllm_block_pool.BlockPool, "get_new_blocks")  # an engine-build target, checked later
    monkeypatch.delattr("vllm.engine.arg_utils.EngineArgs.create_engine_config")
    with pytest.raises(ConfigError) as e:
        patches.install(patches.When.PLUGIN_LOAD, None)
    msg = str(e.value)
    assert "\n" not in msg and "vllm.engine.arg_utils.EngineArgs.create_engine_config is missing" in msg
    assert f"({vllm.__version__})" in msg
    assert Scheduler.__init__ is init and patches.installed() == []  # checked first: nothing installed


def test_vllm_builds_kvcacheds_connector_through_its_factory_and_a_bridge_needs_it() -> None:
    """The documented seam: kv_connector_module_path names kvcached's subclass, under vLLM's name."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

    from kvcached.kv_cache_manager import KVCacheManager, KVGeometry
    from kvcached.vllm.api_server.checks import _check_connector
    from kvcached.vllm.api_server.startup import name_connector
    from kvcached.vllm.engine_core import connector as ours
    from kvcached.vllm.engine_core.bridge import install_bridge
    from kvcached.vllm.testing.harness import Harness, HarnessConfig

    # Every call the table names is overridden by kvcached's connector, and nothing else is.
    overridden = {n for n, v in vars(ours.OffloadingConnector).items() if callable(v) and not n.startswith("_")}
    assert overridden - {"vllm_calls"} == set(patches.CONNECTOR_CALLS)
    ktc = SimpleNamespace(kv_connector="OffloadingConnector", kv_connector_module_path=None)
    name_connector(ktc)
    assert ktc.kv_connector_module_path == patches.CONNECTOR_MODULE == ours.__name__
    _check_connector(ktc, on_cpu=False)  # kvcached's own module passes the startup checks
    with pytest.raises(ConfigError, match=r"kv_connector_module_path names elsewhere\.mod"):
        _check_connector(
            SimpleNamespace(kv_connector="OffloadingConnector", kv_connector_module_path="elsewhere.mod"), on_cpu=False
        )
    with Harness(HarnessConfig(kvcached_connector=True)) as h:
        c = h.scheduler.connector
        assert type(c) is ours.OffloadingConnector and type(c).__name__ == "OffloadingConnector"
        assert isinstance(c, OffloadingConnector) and c.kvcached_bridge is None
    with Harness(HarnessConfig(kvcached_connector=False)) as h:
        assert type(h.scheduler.connector) is OffloadingConnector  # vLLM's own: no bridge goes on it
        m = KVCacheManager.standalone(
            KVGeometry(num_blocks=64, block_bytes=4096, page_bytes=16384), HostBackend(page_bytes=16384)
        )
        with pytest.raises(ConfigError) as e:
            install_bridge(h.scheduler, m.recorder)
        assert "\n" not in str(e.value) and patches.CONNECTOR_MODULE in str(e.value)
        assert patches.SENTINEL not in vars(h.scheduler.connector)
