"""End to end at --pipeline-parallel-size 2 on vLLM's CPU build: each stage maps its own layers.

Every worker of every stage gets each ``SchedulerOutput`` (vLLM's executor broadcasts it), so
the scheduler's page decisions reach both stages with the step (``step_channel``), and each maps
the pages of its own layers; a job's pages stay pinned until both stages' workers reported it.
vLLM's CPU build serves PP only with compilation: without it a later stage skips the warm-up that
allocates its intermediate tensors and asserts at the first request, natively too
(``api_server.checks._check_pipeline`` refuses that in one line), so these servers run
torch.compile with its eager backend. kvcached PR #598's validation load at PP=2 with vLLM's
``mp`` executor:

* ``ledger``: every greedy token, top-5 logprob and cached-token count equals native vLLM's at
  PP=2; the journal replays clean with every job reported by both stages;
* ``legacy``: the journal shows I1 (the freed-block copy), the check above tripping.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcached.testing.tiny_model import build
from kvcached.vllm.testing.e2e import (
    ACTIVE_LINE,
    Completion,
    Server,
    check_same_as_native,
    check_served,
    job_reports,
    replay_check,
    validation_config,
    validation_passes,
)

pytestmark = pytest.mark.vllm

PP2 = ("--pipeline-parallel-size", "2", "--compilation-config", json.dumps({"mode": 1, "backend": "eager"}))
# As at TP=2 (test_tp_e2e): one NUMA node here, and vLLM's CPU build binds each local worker to its own.
PP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
STEP_CHANNEL = "mapped as the scheduler decides (step channel)"


@dataclass
class Run:
    mode: str
    server: Server
    ready: bool
    outputs: list[Completion]
    journal: Path | None


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build(tmp_path_factory.mktemp("tiny-llama-pp")))  # 8 layers: 4 per stage


def _run(mode: str, model: str, out: Path) -> Run:
    policy = None if mode == "native" else mode
    journal = out / f"pp-{mode}.kvj" if policy else None
    cfg = validation_config(model, policy, journal)
    cfg.extra_args, cfg.enforce_eager = PP2, False
    cfg.env.update(PP2_ENV)
    server = Server(cfg, out / f"pp-{mode}.log").start()
    outputs: list[Completion] = []
    ready = False
    try:
        ready = server.wait_ready(timeout=500)
        if ready:
            outputs, resets = validation_passes(server)
            assert resets == [True, True]
    finally:
        server.stop()
    return Run(mode, server, ready, outputs, journal)


@pytest.fixture(scope="module")
def runs(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    return {mode: _run(mode, model, tmp_path_factory.mktemp(f"pp-{mode}")) for mode in ("native", "legacy", "ledger")}


@pytest.mark.parametrize("mode", ["native", "legacy", "ledger"])
def test_pp2_servers_are_healthy(runs: dict[str, Run], mode: str) -> None:
    run = runs[mode]
    s = run.server
    assert run.ready, f"{mode}: not ready:\n{s.log()[-3000:]}"
    before_stop = check_served(s, run.outputs, legacy=mode == "legacy")  # legacy's I1 lines are ERRORs
    lines = before_stop.splitlines()
    active = [line for line in lines if ACTIVE_LINE in line]
    stages = sorted(line.split()[0] for line in lines if STEP_CHANNEL in line)
    if mode == "native":
        assert not active and not stages
    else:
        assert len(active) == 1, active
        # Both stages' workers applied the decisions, each over its own 4 layers.
        assert stages == ["(Worker_PP0", "(Worker_PP1"], stages
        assert all("x 4 regions" in line for line in lines if STEP_CHANNEL in line)


def test_ledger_at_pp2_matches_native_exactly(runs: dict[str, Run]) -> None:
    native, ours = runs["native"].outputs, runs["ledger"].outputs
    assert sum(c.cached_tokens or 0 for c in native[10:]) > 0, "native never loaded from the CPU tier"
    check_same_as_native(native, ours)


def test_ledger_keeps_pages_until_both_stages_reported(runs: dict[str, Run]) -> None:
    journal = runs["ledger"].journal
    assert journal is not None
    workers, reports = job_reports(journal)
    assert workers == 2 and reports and {sum(c) for c in reports.values()} == {2}, reports
    rc, report = replay_check(journal)
    assert rc == 0 and "clean" in report and "0 outstanding" in report, report


def test_legacy_at_pp2_shows_the_freed_block_copy(runs: dict[str, Run]) -> None:
    journal = runs["legacy"].journal
    assert journal is not None
    rc, report = replay_check(journal)
    assert rc == 1 and "I1" in report, report
