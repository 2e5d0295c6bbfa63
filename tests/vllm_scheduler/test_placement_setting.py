"""``KVCACHED_PLACEMENT`` reaches the manager of a served engine core, and ``assemble`` builds the
manager under vLLM's real scheduler with the rule its ``EngineConfig`` names."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from kvcached.kv_cache_manager import KVGeometry, Placement  # noqa: E402
from kvcached.settings import Settings  # noqa: E402
from kvcached.vllm.engine_core import served  # noqa: E402
from kvcached.vllm.engine_core.engine import EngineConfig  # noqa: E402
from kvcached.vllm.testing.harness import Harness, HarnessConfig  # noqa: E402
from kvcached.vllm.testing.host_engine import HostEngine  # noqa: E402


@pytest.mark.parametrize(
    ("env", "rule"), [({}, Placement.WHOLE_PAGES), ({"KVCACHED_PLACEMENT": "best-fit"}, Placement.BEST_FIT)]
)
def test_the_setting_reaches_the_engine_config(env: dict[str, str], rule: Placement, monkeypatch) -> None:
    class Stop(Exception):
        pass

    seen: dict[str, Any] = {}

    def capture(scheduler: Any, geometry: Any, backends: Any, config: EngineConfig, **kw: Any) -> Any:
        seen["config"] = config
        raise Stop

    geometry = KVGeometry(num_blocks=32, block_bytes=1 << 18, page_bytes=1 << 20)  # the floor is read off it
    plan, page = type("Plan", (), {"geometry": geometry})(), type("Page", (), {"chosen": False})()
    monkeypatch.setattr(served, "plan_page", lambda *a, **k: (plan, page))
    monkeypatch.setattr("kvcached.vllm.engine_core.step_sender.decision_backends", lambda *a, **k: ([], None))
    monkeypatch.setattr(served, "assemble", capture)
    scheduler = type("S", (), {"kv_cache_config": None, "cache_config": type("C", (), {"block_size": 16})()})()
    with pytest.raises(Stop):
        served.build(scheduler, Settings.from_env(env))
    assert seen["config"].placement is rule


@pytest.mark.parametrize("rule", [Placement.WHOLE_PAGES, Placement.BEST_FIT])
def test_assemble_builds_the_manager_with_the_configured_rule(rule: Placement) -> None:
    kv = HostEngine(EngineConfig(placement=rule))
    h = Harness(
        HarnessConfig(num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=256),
        kv_memory=kv.kv_memory,
        on_scheduler_built=kv.on_scheduler_built,
    )
    try:
        manager = kv.e.manager
        assert manager is not None and manager.placement is rule
        # A run of two pages' worth on a fresh pool: whole pages of its own, or the lowest holes.
        got = manager.alloc(8)
        pages = sorted({manager.page_of(b) for b in got})
        assert pages == ([1, 2] if rule is Placement.WHOLE_PAGES else [0, 1, 2])
    finally:
        h.close()
        kv.close()
