"""``/metrics`` of a real ``vllm serve --api-server-count 2`` (vLLM's CPU build) with kvcached on.

Two API server processes share the port (vLLM binds it with ``SO_REUSEPORT``) and serve
``/metrics`` from a multiprocess registry each makes for itself; each must carry kvcached's
series. The test scrapes many times over fresh connections (the kernel spreads them over both
processes), parses each exposition with ``prometheus_client``'s parser, and checks what an
operator joins and alerts on: the ``engine`` label is vLLM's own (the one on
``vllm:kv_cache_usage_perc``), every invariant has its zero series, the page states partition
the capacity, the info series names the setup, and the shared budget is reported once.
"""

from __future__ import annotations

import os
import re
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from kvcached.ledger.findings import INVARIANTS
from kvcached.testing.tiny_model import build, corpus
from kvcached.version import KVCACHED_VERSION
from kvcached.vllm.testing.e2e import ERROR_SIGNATURES, Server, ServerConfig, metric_families

pytestmark = pytest.mark.vllm

MiB = 1 << 20
SCRAPES = 16


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model = str(build(tmp_path_factory.mktemp("tiny-llama-metrics")))
    out = tmp_path_factory.mktemp("metrics")
    runtime = out / "run"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(runtime), "KVCACHED_BUDGET": "metrics-test", "KVCACHED_BUDGET_BYTES": "512M"}
    cfg = ServerConfig(
        model=model,
        kvcached=True,
        env=env,
        kv_cache_bytes=64 * MiB,
        cpu_offload_bytes=16 * MiB,
        serve_cli=True,
        extra_args=("--api-server-count", "2"),
    )
    server = Server(cfg, out / "metrics-kvcached.log").start()
    try:
        assert server.wait_ready(), server.log()[-4000:]
        prefix = " ".join(corpus(40, seed=11))[:2500]
        for i in range(4):
            server.complete(prefix + f" question {i}", 4)
        scrapes = []
        for _ in range(SCRAPES):
            with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
                scrapes.append(r.read().decode())
        yield {"scrapes": scrapes, "log": server.log(), "server": server}
    finally:
        server.stop()


def test_every_api_server_exposes_the_series(served: dict[str, Any]) -> None:
    # Each API server logs once when its registry gets the collector: two processes, two lines.
    pids = set(re.findall(r"kvcached's series on the /metrics of API server pid (\d+)", served["log"]))
    assert len(pids) == 2, served["log"][-4000:]
    for text in served["scrapes"]:
        got = metric_families(text)
        assert [v for _, v in got["vllm:kvcached_engine_up"]] == [1.0], text[-2000:]


def test_the_engine_label_joins_vllm_s_own_kv_series(served: dict[str, Any]) -> None:
    for text in served["scrapes"]:
        got = metric_families(text)
        theirs = {(lv["model_name"], lv["engine"]) for lv, _ in got["vllm:kv_cache_usage_perc"]}
        ours = {(lv["model_name"], lv["engine"]) for lv, _ in got["vllm:kvcached_mapped_bytes"]}
        assert ours and ours == theirs, (ours, theirs)
        assert {e for _, e in ours} == {"0"}


def test_zero_series_disjoint_states_and_the_info_series(served: dict[str, Any]) -> None:
    got = metric_families(served["scrapes"][-1])
    violations = got["vllm:kvcached_violations_total"]
    assert sorted(lv["invariant"] for lv, _ in violations) == sorted(INVARIANTS)
    assert {v for _, v in violations} == {0.0}
    states = {lv["state"]: v for lv, v in got["vllm:kvcached_pages"]}
    assert set(states) == {"in_use", "pinned", "reserved", "unmapped"}
    (capacity,) = [v for _, v in got["vllm:kvcached_capacity_bytes"]]
    (mapped,) = [v for _, v in got["vllm:kvcached_mapped_bytes"]]
    page = capacity / sum(states.values())
    assert page == int(page) and page >= 2 * MiB
    assert mapped == (states["in_use"] + states["pinned"] + states["reserved"]) * page
    ((info, one),) = got["vllm:kvcached_info"]
    assert one == 1.0
    assert info["version"] == KVCACHED_VERSION and info["policy"] == "ledger" and info["backend"] == "host"
    # What a page counts in the *_bytes series, and its size in one layer (KVCACHED_PAGE_SIZE_MB).
    assert info["page_bytes"] == str(int(page)) and info["layer_page_bytes"] == str(2 * MiB), info
    assert info["compiled"] in ("true", "false")
    assert int(info["pid"]) > 0 and os.path.basename(info["socket"]).endswith(".sock")
    assert info["budget"] == "metrics-test"
    # The CPU build's vLLM (0.32.0+cpu) is a tested release.
    assert info["vllm_version"].startswith("0.32.0") and info["tested"] == "true", info
    assert [v for _, v in got["vllm:kvcached_shrink_pending"]] == [0.0]
    assert got["vllm:kvcached_budget_size_bytes"] == [({"budget": "metrics-test"}, 512.0 * MiB)]
    (used,) = [v for _, v in got["vllm:kvcached_budget_used_bytes"]]
    assert 0 < used <= 512 * MiB
    for name in ("events_total", "page_maps_total", "events_dropped_total", "journal_events_written_total"):
        assert "vllm:kvcached_" + name in got, name
    bad = [line for line in served["log"].splitlines() if ERROR_SIGNATURES.search(line)]
    assert not bad, bad[:5]


def test_every_series_the_collector_declares_is_on_the_scrape(served: dict[str, Any]) -> None:
    from kvcached.vllm.api_server import metrics

    seen = set(metric_families(served["scrapes"][-1]))
    only_while_shrinking = {metrics.PREFIX + "shrink_waiting_pages"}
    assert metrics.exposed_names() - only_while_shrinking <= seen, metrics.exposed_names() - seen


def test_a_sigkilled_engine_core_takes_the_scrape_target_down(served: dict[str, Any]) -> None:
    """What an operator alerts on when an engine core is killed: vLLM's API servers exit with it,
    so the scrape itself fails (Prometheus records ``up`` 0 for the target: the alert rules'
    ``KvcachedServerDown``) rather than ``engine_up`` going to 0. Last in the module: it ends the
    server."""
    import signal
    import time
    import urllib.error

    ((info, _),) = metric_families(served["scrapes"][-1])["vllm:kvcached_info"]
    os.kill(int(info["pid"]), signal.SIGKILL)
    deadline = time.monotonic() + 120  # a bound on a condition, for a loaded machine
    while True:
        try:
            with urllib.request.urlopen(served["server"].url + "/metrics", timeout=10) as r:
                r.read()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            break  # the target is down: no answer at all
        assert time.monotonic() < deadline, "the API servers still answer /metrics after their engine core died"
        time.sleep(0.5)
