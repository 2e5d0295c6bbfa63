"""kvcached's series on SGLang's ``/metrics``: SGLang 0.5.23's HTTP server with ``--enable-metrics``.

The same series, names and labels as under vLLM (``kvcached.engine.metrics.SERIES``), found by the
server's own scrape: the scheduler that holds the pool answers over its ledger socket, and
``vllm:kvcached_info`` says ``serving="SGLang 0.5.23"``. SGLang's own series stay on the scrape.
What trips it: without the ``collect`` row of ``kvcached/sglang/hooks.py`` no kvcached series is
there; without ``KVCACHED_SERVE_PID`` in the schedulers (``plugin.register``) the collector finds
no engine of its server and the gauges are absent.
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcached.engine.metrics import PREFIX, exposed_names
from kvcached.ledger.findings import INVARIANTS
from kvcached.testing.tiny_model import build
from kvcached.vllm.testing.e2e import ERROR_SIGNATURES, ServerConfig, metric_families

pytestmark = pytest.mark.vllm

MiB = 1 << 20


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    python = os.environ.get("KVCACHED_SGLANG_PYTHON")
    if not python:
        pytest.skip("needs SGLang's environment (KVCACHED_SGLANG_PYTHON, set by scripts/test.sh)")
    from kvcached.sglang.testing.server import SglangServer

    model = str(build(tmp_path_factory.mktemp("tiny-llama-sglang-metrics")))
    out = tmp_path_factory.mktemp("sglang-metrics")
    runtime = out / "run"
    runtime.mkdir(mode=0o700)
    env = {
        "XDG_RUNTIME_DIR": str(runtime),
        "KVCACHED_BACKEND": "host",
        "KVCACHED_PAGE_SIZE_MB": "0.125",
        "KVCACHED_BUDGET": "sglang-metrics",
        "KVCACHED_BUDGET_BYTES": str(512 * MiB),
    }
    config = ServerConfig(
        model=model,
        kvcached=True,
        env=env,
        kv_cache_bytes=64 * MiB,
        cpu_offload_bytes=16 * MiB,
        extra_args=("--enable-metrics",),
    )
    server = SglangServer(config, out / "sglang.log", python=Path(python))
    with server:
        assert server.wait_ready(600), server.log()[-3000:]
        done = [server.complete(f"river stone cloud {i} " * 40, 4) for i in range(3)]
        with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
            text = r.read().decode()
        scheduler = server.worker_pid()
    yield {"text": text, "done": done, "log": server.log(before_stop=True), "scheduler": scheduler, "server": server}


def test_kvcached_series_are_on_sglangs_scrape_as_under_vllm(scraped: dict[str, Any]) -> None:
    assert all(c.ok for c in scraped["done"])
    got = metric_families(scraped["text"])
    only_while_shrinking = {PREFIX + "shrink_waiting_pages"}
    assert exposed_names() - only_while_shrinking <= set(got), exposed_names() - set(got)
    ((info, one),) = got[PREFIX + "info"]
    assert one == 1.0 and info["serving"] == "SGLang 0.5.23" and info["tested"] == "true", info
    assert info["vllm_version"] == "" and info["engine"] == "0" and info["model_name"], info
    assert int(info["pid"]) == scraped["scheduler"], "the engine is SGLang's scheduler process"
    assert [v for _, v in got[PREFIX + "engine_up"]] == [1.0]
    states = {lv["state"]: v for lv, v in got[PREFIX + "pages"]}
    (capacity,) = [v for _, v in got[PREFIX + "capacity_bytes"]]
    (mapped,) = [v for _, v in got[PREFIX + "mapped_bytes"]]
    page = capacity / sum(states.values())
    assert mapped == (states["in_use"] + states["pinned"] + states["reserved"]) * page and mapped > 0
    violations = got[PREFIX + "violations_total"]
    assert sorted(lv["invariant"] for lv, _ in violations) == sorted(INVARIANTS)
    assert {v for _, v in violations} == {0.0}
    assert info["budget"] == "sglang-metrics"
    assert got[PREFIX + "budget_size_bytes"] == [({"budget": "sglang-metrics"}, 512.0 * MiB)]
    (used,) = [v for _, v in got[PREFIX + "budget_used_bytes"]]
    assert 0 < used <= 512 * MiB


def test_sglangs_own_series_stay_and_the_log_is_clean(scraped: dict[str, Any]) -> None:
    got = metric_families(scraped["text"])
    assert any(name.startswith("sglang:") for name in got), sorted(got)[:10]
    bad = [line for line in scraped["log"].splitlines() if ERROR_SIGNATURES.search(line)]
    assert not bad, bad[:5]
    server = scraped["server"]
    assert server.exit_seconds is not None and server.exit_seconds <= 90 and server.left_behind == []
