"""End to end at --data-parallel-size 2 on vLLM's CPU build: each rank is an engine of its own.

vLLM runs a dense model's data-parallel ranks as independent engine cores (``run_engine_core``:
``EngineCoreProc`` with ``engine_index=dp_rank``, its config reset to one rank by
``ParallelConfig.reconfigure_for_independent_dp_rank``), each with its own scheduler, workers and KV
cache. So each rank gets its own kvcached engine and its own files: the journal
``P.dp<rank>`` (``ranks.rank_path``; one shared file would be refused by the segment lock and
lose a rank's events), its ``kvctl`` socket, its flight recorder, its share of a budget and its
``engine`` label on ``/metrics`` (vLLM's own, so that kvcached's series join vLLM's per rank).

kvcached PR #598's validation load at DP=2, each request sent to rank ``i % 2`` (vLLM's
``X-data-parallel-rank`` header) so that both ranks serve, offload and load back:

* ``ledger``: every greedy token, top-5 logprob and cached-token count equals native vLLM's at
  DP=2; both ranks' journals replay clean, each holding its own rank's jobs; ``kvctl list`` shows
  the two ranks, with one budget holding both shares; ``/metrics`` has kvcached's series for
  engines 0 and 1, as vLLM's own KV series;
* ``legacy``: a rank's journal shows I1 (the freed-block copy), the check above tripping.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvcached.testing.tiny_model import build
from kvcached.vllm.testing.e2e import (
    ACTIVE_LINE,
    Completion,
    Server,
    check_same_as_native,
    check_served,
    replay_check,
    validation_config,
    validation_prompts,
)
from kvcached.vllm.testing.elastic import kvctl

pytestmark = pytest.mark.vllm

DP2 = ("--data-parallel-size", "2")
# As at TP=2 (test_tp_e2e): vLLM's CPU build binds each local worker's threads to a NUMA node of
# its own and refuses two on one node; this machine has one.
DP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
BUDGET = "dp"


@dataclass
class Run:
    mode: str
    server: Server
    ready: bool
    outputs: list[Completion]
    journal: Path | None
    listed: list[dict[str, Any]] = field(default_factory=list)  # kvctl list --json while serving
    budget_line: str = ""
    metrics: str = ""


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build(tmp_path_factory.mktemp("tiny-llama-dp")))


def _passes(server: Server) -> list[Completion]:
    outputs: list[Completion] = []
    for _ in range(2):  # a prefix-cache reset after each pass: the second loads back from the CPU tier
        outputs += [server.complete(p, n, rank=i % 2) for i, (p, n) in enumerate(validation_prompts())]
        assert server.reset_prefix_cache()
    time.sleep(0.5)  # the journals are written within milliseconds of each event
    return outputs


def _run(mode: str, model: str, out: Path) -> Run:
    policy = None if mode == "native" else mode
    journal = out / f"dp-{mode}.kvj" if policy else None
    runtime = out / "run"
    runtime.mkdir()
    cfg = validation_config(model, policy, journal)
    cfg.extra_args = DP2
    cfg.env.update(DP2_ENV, XDG_RUNTIME_DIR=str(runtime))
    if policy == "ledger":  # room for both: the budget is shared, not what limits them here
        cfg.env.update(KVCACHED_BUDGET=BUDGET, KVCACHED_BUDGET_BYTES=str(192 << 20))
    server = Server(cfg, out / f"dp-{mode}.log").start()
    run = Run(mode, server, False, [], journal)
    try:
        run.ready = server.wait_ready(timeout=400)
        if run.ready:
            run.outputs = _passes(server)
            if policy == "ledger":
                run.listed = kvctl(runtime, "list", "--json")
                run.budget_line = next(
                    (line for line in kvctl(runtime, "list").splitlines() if line.startswith("budget ")), ""
                )
                with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
                    run.metrics = r.read().decode()
    finally:
        server.stop()
    return run


@pytest.fixture(scope="module")
def runs(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    return {mode: _run(mode, model, tmp_path_factory.mktemp(f"dp-{mode}")) for mode in ("native", "legacy", "ledger")}


def _journals(run: Run) -> list[Path]:
    assert run.journal is not None
    return [run.journal.with_name(f"{run.journal.name}.dp{rank}") for rank in range(2)]


@pytest.mark.parametrize("mode", ["native", "legacy", "ledger"])
def test_dp2_servers_are_healthy(runs: dict[str, Run], mode: str) -> None:
    run = runs[mode]
    s = run.server
    assert run.ready, f"{mode}: not ready:\n{s.log()[-3000:]}"
    before_stop = check_served(s, run.outputs, legacy=mode == "legacy")  # legacy's I1 lines are ERRORs
    active = [line for line in before_stop.splitlines() if ACTIVE_LINE in line]
    if mode == "native":
        assert not active
        return
    assert len(active) == 2 and all("backend=host" in line for line in active), active
    for rank, path in enumerate(_journals(run)):  # one engine per rank, each with its own journal
        assert sum(f"journal={path}," in line and f"EngineCore_DP{rank}" in line for line in active) == 1, active
    assert run.journal is not None and not run.journal.exists(), "a rank wrote the journal's shared name"


def test_ledger_at_dp2_matches_native_exactly(runs: dict[str, Run]) -> None:
    native, ours = runs["native"].outputs, runs["ledger"].outputs
    for rank in range(2):  # each rank loaded a prefix back from its own CPU tier
        assert sum(c.cached_tokens or 0 for c in native[10 + rank :: 2]) > 0, f"rank {rank} never loaded back"
    check_same_as_native(native, ours)


def test_each_rank_journals_its_own_jobs_and_replays_clean(runs: dict[str, Run]) -> None:
    from kvcached.ledger.events import JobReported
    from kvcached.ledger.journal import read_journal

    for rank, path in enumerate(_journals(runs["ledger"])):
        trace = read_journal(path)
        assert trace.header.meta.get("data_parallel_rank") == str(rank), trace.header.meta
        assert trace.header.meta.get("data_parallel_size") == "2", trace.header.meta
        assert any(isinstance(ev, JobReported) for ev in trace.events), f"rank {rank} journaled no copy"
        rc, report = replay_check(path)
        assert rc == 0 and "clean" in report and "0 outstanding" in report, report


def test_legacy_at_dp2_shows_the_freed_block_copy(runs: dict[str, Run]) -> None:
    reports = [replay_check(path) for path in _journals(runs["legacy"])]
    assert any(rc == 1 and "I1" in report for rc, report in reports), reports


def test_kvctl_lists_both_ranks_on_one_budget(runs: dict[str, Run]) -> None:
    run = runs["ledger"]
    engines = [e["status"]["engine"] for e in run.listed if e.get("alive")]
    assert sorted((e["index"], e["data_parallel"]) for e in engines) == [(0, 2), (1, 2)], run.listed
    assert len({e["pid"] for e in engines}) == 2 and len({e["port"] for e in engines}) == 1, engines
    assert all(e["budget"] == BUDGET for e in engines), engines
    sockets = sorted(e["socket"] for e in run.listed)
    assert [s.rsplit(".", 2)[-2] for s in sockets] == ["dp0", "dp1"], sockets
    # One budget line naming both engine cores' shares.
    assert run.budget_line.startswith(f"budget {BUDGET}:"), run.budget_line
    assert all(f"pid {e['pid']} " in run.budget_line for e in engines), run.budget_line


def test_metrics_label_each_rank_as_vllm_does(runs: dict[str, Run]) -> None:
    def engines(series: str) -> set[str]:
        found = set()
        for line in runs["ledger"].metrics.splitlines():
            if line.startswith(series + "{"):
                labels = line[len(series) + 1 : line.index("}")]
                found |= {kv.split("=", 1)[1].strip('"') for kv in labels.split(",") if kv.startswith("engine=")}
        return found

    ours, theirs = engines("vllm:kvcached_mapped_bytes"), engines("vllm:kv_cache_usage_perc")
    assert ours == theirs == {"0", "1"}, (ours, theirs, json.dumps(runs["ledger"].metrics[-1500:]))
