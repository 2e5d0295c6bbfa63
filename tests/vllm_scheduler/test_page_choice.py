"""``kv_layout.plan`` over real vLLM KV cache configs whose block does not divide the default page
(it must just work at default settings): with KVCACHED_PAGE_SIZE_MB unset the engine
core's plan and the worker's allocation choose the same page for their backend, the engine core
says so once, and a page the user set that does not fit is refused with a hint true for it."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvcached.errors import ConfigError
from kvcached.vllm import kv_layout
from kvcached.vllm.engine_core import served
from kvcached.vllm.worker import kv_memory

MiB = 1 << 20
NAMES = [f"model.layers.{i}.attn" for i in range(4)]


def per_layer(spec: Any, num_blocks: int = 200) -> KVCacheConfig:
    """One group, each layer its own region of ``num_blocks`` blocks (vLLM's LBHNC layout)."""
    page = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks * len(NAMES),
                layers=list(NAMES),
                layer_stride=page * num_blocks,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(NAMES), spec)],
    )


MLA = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)  # 18432 B a layer
# A Mamba2 state of 1085440 B (265 OS pages), the state size of a real Mamba2 model.
MAMBA2 = MambaSpec(block_size=2048, shapes=((265, 1024),), dtypes=(torch.float32,))
FULL = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)  # 64 KiB


def test_the_specs_have_the_sizes_of_the_kinds() -> None:
    assert (MLA.page_size_bytes, MAMBA2.page_size_bytes, FULL.page_size_bytes) == (18432, 1085440, 65536)


@pytest.mark.parametrize(
    ("spec", "backend", "page"),
    [(MLA, "host", 2064384), (MLA, "cuda", 18 * MiB), (MAMBA2, "host", 1085440), (FULL, "host", 2 * MiB)],
)
def test_unset_page_is_chosen_for_the_block_and_backend(spec: Any, backend: str, page: int) -> None:
    cfg = per_layer(spec)
    p, choice = kv_layout.plan_page(cfg, 2 * MiB, backend=backend, page_set=False)
    assert p.page_bytes == choice.page_bytes == page and p.regions == 4
    assert p.page_bytes % p.block_bytes == 0 and choice.chosen is (page != 2 * MiB)
    assert p.geometry.page_bytes == page and p.total_bytes >= cfg.kv_cache_tensors[0].size


def test_a_set_page_that_does_not_fit_is_refused_with_a_true_hint() -> None:
    with pytest.raises(ConfigError, match=r"set KVCACHED_PAGE_SIZE_MB=2\.0703125 or 1\.03515625 \(.*host backend\)"):
        kv_layout.plan(per_layer(MAMBA2), 2 * MiB, backend="host", page_set=True)
    with pytest.raises(ConfigError, match=r"set KVCACHED_PAGE_SIZE_MB=530 \(.*cuda backend\)$"):
        kv_layout.plan(per_layer(MAMBA2), 2 * MiB, backend="cuda", page_set=True)
    with pytest.raises(ConfigError, match=r"KVCACHED_PAGE_SIZE_MB=530 to accept that$"):  # unset: beyond the bound
        kv_layout.plan(per_layer(MAMBA2), 2 * MiB, backend="cuda", page_set=False)
    # Attention scales with --block-size: a 4 MiB block (16 tokens) fits a 2 MiB page at 8.
    big = FullAttentionSpec(block_size=16, num_kv_heads=64, head_size=1024, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"or --block-size 8, or unset it"):
        kv_layout.plan(per_layer(big, 4), 2 * MiB, backend="cuda", page_set=True)


def test_the_worker_allocates_on_the_page_the_engine_core_plans() -> None:
    """The worker (kv_memory.allocate, which knows its device) and the engine core (served.build's
    plan, which knows the platform) reach the same page from the same setting."""
    cfg = per_layer(MLA)
    key = f"test-{uuid.uuid4().hex[:8]}"
    try:
        views = kv_memory.allocate(
            cfg, torch.device("cpu"), KVCacheLayout["LBHNC"], None, page_bytes=2 * MiB, page_set=False, key=key
        )
        backend = kv_memory.local_backend(key)
        assert backend is not None
        engine, _ = kv_layout.plan_page(cfg, 2 * MiB, backend="host", page_set=False)
        assert backend.page_bytes == engine.page_bytes == 2064384
        assert backend.num_pages == engine.geometry.backend_pages
        base = backend.tensor(torch.int8).data_ptr()
        for region, name in enumerate(NAMES):  # each block of each layer on its page, none straddling two
            view = views[name]
            for b in (0, 111, 112, 199):
                start = view[b].data_ptr() - base
                end = start + view[b].numel() * view[b].element_size() - 1
                slot = region * engine.geometry.num_pages + b // 112
                assert start // engine.page_bytes == end // engine.page_bytes == slot, (name, b)
        del views
    finally:
        kv_memory.release(key)


def test_the_engine_core_plans_for_its_platform_and_logs_the_choice_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """served.build: the plan for the platform's backend, and one INFO line saying what was
    chosen and what it costs (stopped right after: the rest needs a real scheduler)."""
    from kvcached.settings import Settings

    class Stop(Exception):
        pass

    seen: dict[str, Any] = {}

    def decision_backends(scheduler: Any, plan: Any, *, kind: str) -> Any:
        seen.update(plan=plan, kind=kind)
        raise Stop

    lines: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record)

    handler = Keep(logging.INFO)
    served.log.addHandler(handler)
    # setLevel, not the attribute: it also clears the logger's isEnabledFor cache, which an earlier
    # test's logging on vllm.kvcached (test_metrics) leaves saying INFO is off.
    level = served.log.level
    served.log.setLevel(logging.INFO)
    monkeypatch.setattr("kvcached.vllm.patches.on_cpu", lambda: True)
    monkeypatch.setattr("kvcached.vllm.engine_core.step_sender.decision_backends", decision_backends)
    scheduler = type("S", (), {"kv_cache_config": per_layer(MAMBA2)})()
    try:
        with pytest.raises(Stop):
            served.build(scheduler, Settings.from_env({}))
        assert seen["kind"] == "host" and seen["plan"].page_bytes == 1085440
        assert [r.getMessage() for r in lines] == [
            "[kvcached] page size: a KV block takes 1085440 B, which does not divide the default 2 MiB page; "
            "chose 1.03515625 MiB pages (1 block each, 0 B unused per page) for the host backend "
            "(set KVCACHED_PAGE_SIZE_MB to choose)"
        ]
        lines.clear()
        monkeypatch.setattr("kvcached.vllm.patches.on_cpu", lambda: False)
        with pytest.raises(ConfigError, match=r"KVCACHED_PAGE_SIZE_MB=530 to accept that$"):
            served.build(scheduler, Settings.from_env({}))
        scheduler.kv_cache_config = per_layer(FULL)
        with pytest.raises(Stop):
            served.build(scheduler, Settings.from_env({}))
        assert seen["kind"] == "cuda" and seen["plan"].page_bytes == 2 * MiB and not lines  # the default: no line
    finally:
        served.log.removeHandler(handler)
        served.log.setLevel(level)
