"""kvcached's /metrics collector against real ledger services, scraped as Prometheus would.

Each engine here is a real ``LedgerService`` with its live socket (the one ``kvctl`` and the API
server's collector talk to) and a small ``EngineControl`` standing in for an engine core's
``LiveControl``; the served test (tests/serve/test_metrics_e2e.py) runs the real one. The
exposition is rendered by ``prometheus_client`` and parsed back with its own parser, so label
sets and ``_total`` names are what a scrape returns.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvcached.holds import BOUNDS as HOLD_BOUNDS  # noqa: E402
from kvcached.ledger.findings import INVARIANTS  # noqa: E402
from kvcached.service import messages  # noqa: E402
from kvcached.service.ledger_service import BackgroundService, ServiceConfig  # noqa: E402
from kvcached.testing import synth  # noqa: E402
from kvcached.vllm.api_server import metrics  # noqa: E402

PAGE = 2 << 20


class Control:
    """An engine's identity and memory as an engine core reports them (``EngineControl``)."""

    def __init__(self, info: messages.EngineInfo, memory: messages.MemoryStatus) -> None:
        self._info, self._memory = info, memory

    def info(self) -> messages.EngineInfo:
        return self._info

    def memory(self) -> messages.MemoryStatus:
        return self._memory

    def set_limit(self, size: int | None) -> messages.MemoryStatus:
        raise NotImplementedError

    def tick(self) -> None:
        pass  # no budget


def _engine(
    folder: Path, index: int, api_pid: int, *, budget: messages.BudgetStatus | None = None
) -> BackgroundService:
    path = str(folder / f"ledger-{index}.sock")
    info = messages.EngineInfo(
        model="tiny",
        pid=1000 + index,
        api_pid=api_pid,
        port=8000,
        socket=path,
        started_unix=0.0,
        policy="ledger",
        engine="vLLM 0.32.0",
        kvcached="9.9",
        index=index,
        backend="host",
        page_size=PAGE,
        page_cost=PAGE * 4,  # a page in each of 4 layers, as MemoryStatus.page_bytes counts it
        compiled=True,
        budget=budget.name if budget else None,
    )
    memory = messages.MemoryStatus(
        page_bytes=PAGE * 4,
        num_pages=10,
        mapped_pages=6,
        in_use_pages=3,
        reserved_pages=3,
        limit_pages=5,
        shrink_pending=True,
        waiting_on={"reserved, pinned by job": 1},
        reason="shrink pending",
        held_pages=1,
        budget=budget,
        # Two holds ended: one of 0.3 s, one of 40 s (over 30, within 60).
        page_holds=messages.Histogram(bounds=HOLD_BOUNDS, counts=(0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0), sum=40.3),
    )
    bg = BackgroundService.start(synth.header(), ServiceConfig(socket=path))
    bg.service.control = Control(info, memory)
    return bg


def _scrape(collector: metrics.Collector) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)
    text = prometheus_client.generate_latest(registry).decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("KVCACHED_LEDGER_SOCKET", raising=False)
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


def test_series_join_vllm_s_labels_start_at_zero_and_partition_the_pages(folder: Path) -> None:
    budget = messages.BudgetStatus(name="gpu0", size=64 * PAGE, used=24 * PAGE)
    mine = [_engine(folder, i, api_pid=os.getpid(), budget=budget) for i in (0, 1)]
    other = _engine(folder, 7, api_pid=os.getpid() + 1)  # another vllm serve's engine: not ours to show
    try:
        got = _scrape(metrics.Collector(os.getpid(), folder=str(folder)))
    finally:
        for bg in (*mine, other):
            bg.close()
    up = got["vllm:kvcached_engine_up"]
    assert sorted((lv["engine"], v) for lv, v in up) == [("0", 1.0), ("1", 1.0)]
    assert all(set(lv) == {"model_name", "engine"} and lv["model_name"] == "tiny" for lv, _ in up)
    (info, _), _ = got["vllm:kvcached_info"]
    keys = ("version", "policy", "backend", "page_bytes", "layer_page_bytes", "compiled", "pid", "budget")
    assert {k: info[k] for k in keys} == {
        "version": "9.9",
        "policy": "ledger",
        "backend": "host",
        "page_bytes": str(PAGE * 4),
        "layer_page_bytes": str(PAGE),
        "compiled": "true",
        "pid": "1000",
        "budget": "gpu0",
    }
    assert (info["vllm_version"], info["tested"]) == ("0.32.0", "true")
    # A series per invariant and engine from the first scrape, each at 0.
    violations = got["vllm:kvcached_violations_total"]
    assert sorted((lv["engine"], lv["invariant"]) for lv, _ in violations) == sorted(
        (e, inv) for e in ("0", "1") for inv in INVARIANTS
    )
    assert {v for _, v in violations} == {0.0}
    # One label's values partition the engine's pages: 3 in use, 1 pinned, 2 reserved, 4 unmapped.
    states = {lv["state"]: v for lv, v in got["vllm:kvcached_pages"] if lv["engine"] == "0"}
    assert states == {"in_use": 3, "pinned": 1, "reserved": 2, "unmapped": 4}
    capacity = {lv["engine"]: v for lv, v in got["vllm:kvcached_capacity_bytes"]}["0"]
    assert sum(states.values()) * PAGE * 4 == capacity
    assert [v for lv, v in got["vllm:kvcached_shrink_pending"] if lv["engine"] == "0"] == [1.0]
    # A budget shared by both engines is one series, not one per engine.
    assert got["vllm:kvcached_budget_size_bytes"] == [({"budget": "gpu0"}, 64.0 * PAGE)]
    assert got["vllm:kvcached_budget_used_bytes"] == [({"budget": "gpu0"}, 24.0 * PAGE)]
    assert got["vllm:kvcached_budget_wanted_bytes"] == [({"budget": "gpu0"}, 0.0)]  # nobody short
    assert sorted((lv["engine"], v) for lv, v in got["vllm:kvcached_jobs_failed_total"]) == [("0", 0.0), ("1", 0.0)]
    # The hold histogram in Prometheus' shape: cumulative buckets, vLLM's bounds as prometheus_client
    # writes them, +Inf last.
    holds = {lv["le"]: v for lv, v in got["vllm:kvcached_page_hold_seconds_bucket"] if lv["engine"] == "0"}
    assert list(holds)[:4] == ["0.01", "0.05", "0.1", "0.5"] and list(holds)[-1] == "+Inf"
    assert (holds["0.1"], holds["0.5"], holds["30.0"], holds["60.0"], holds["+Inf"]) == (0, 1, 1, 2, 2)
    assert [v for lv, v in got["vllm:kvcached_page_hold_seconds_count"] if lv["engine"] == "0"] == [2.0]
    assert [v for lv, v in got["vllm:kvcached_page_hold_seconds_sum"] if lv["engine"] == "0"] == [40.3]


def test_an_engine_that_stops_answering_reads_engine_up_0_not_absent(folder: Path) -> None:
    collector = metrics.Collector(os.getpid(), folder=str(folder))
    bg = _engine(folder, 0, api_pid=os.getpid())
    try:
        before = _scrape(collector)
    finally:
        bg.close()
    after = _scrape(collector)
    assert [v for _, v in before["vllm:kvcached_engine_up"]] == [1.0]
    assert [v for _, v in after["vllm:kvcached_engine_up"]] == [0.0]
    assert [lv["pid"] for lv, _ in after["vllm:kvcached_info"]] == ["1000"]  # still says which engine
    assert "vllm:kvcached_mapped_bytes" not in after  # no stale values for an engine that is gone


def test_a_multiprocess_scrape_carries_the_series(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under --api-server-count N each scrape builds a registry holding only a MultiProcessCollector
    # (prometheus_fastapi_instrumentator's expose route); the wrapped collect adds our families.
    from prometheus_client import multiprocess

    from kvcached.vllm.api_server import startup

    mp = tmp_path / "prometheus"
    mp.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(mp))
    monkeypatch.setattr(metrics, "_collector", None)
    wrapped = startup.wrap_multiprocess_collect(multiprocess.MultiProcessCollector.collect, None)  # type: ignore[arg-type]
    monkeypatch.setattr(multiprocess.MultiProcessCollector, "collect", wrapped)

    def scrape() -> str:
        registry = prometheus_client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return prometheus_client.generate_latest(registry).decode()

    bg = _engine(folder, 0, api_pid=os.getpid())
    try:
        assert "vllm:kvcached_" not in scrape()  # no collector here: an engine core or a worker
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder.parent))
        metrics.install(os.getpid())
        assert metrics._collector is not None
        metrics._collector.folder = str(folder)
        first, second = scrape(), scrape()
    finally:
        bg.close()
    for text in (first, second):
        assert text.count("\nvllm:kvcached_engine_up{") == 1, text
