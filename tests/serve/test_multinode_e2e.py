"""Two nodes on vLLM's CPU build, through vLLM's own multi-node launch (``kvcached.vllm.testing.nodes``:
node B in network and mount namespaces of its own, with its own ``/dev/shm``).

* One engine's workers on two nodes (``--tensor-parallel-size 2 --nnodes 2``, node B
  ``--headless --node-rank 1``): the engine core on node A decides, and each step's
  ``SchedulerOutput`` carries the decisions to node B's worker through vLLM's executor, which maps
  its own KV in its own ``/dev/shm``. kvcached PR #598's validation load equals native vLLM's on the
  same two nodes (tokens, top-5 logprobs, cached tokens); the journal replays clean with every job
  reported by both workers; ``legacy`` shows I1.
* Data-parallel ranks on two nodes (``--data-parallel-size 2 --data-parallel-size-local 1``, node B
  ``--headless --data-parallel-start-rank 1``): each node's engine core journals, lists and
  budgets its own rank; a budget is per node (``KVCACHED_BUDGET`` names a file in each node's runtime
  directory), and each node's holds its own engine's share only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvcached.budget import budget_usage
from kvcached.testing.tiny_model import build
from kvcached.vllm.testing import nodes
from kvcached.vllm.testing.e2e import (
    ACTIVE_LINE,
    Completion,
    Server,
    check_same_as_native,
    check_served,
    free_port,
    job_reports,
    replay_check,
    validation_config,
    validation_prompts,
)
from kvcached.vllm.testing.elastic import kvctl

pytestmark = pytest.mark.vllm

STEP_CHANNEL = "mapped as the scheduler decides (step channel)"


@dataclass
class Run:
    mode: str
    a: Server
    b: nodes.NodeB
    ready: bool = False
    outputs: list[Completion] = field(default_factory=list)
    journal: Path | None = None
    listed: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # node -> kvctl list --json
    budgets: dict[str, list[int]] = field(default_factory=dict)  # node -> pids holding a share of its budget


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    why_not = nodes.unavailable()  # here, not at collection: it makes (and removes) a namespace
    if why_not is not None:
        pytest.skip(why_not)
    return str(build(tmp_path_factory.mktemp("tiny-llama-nodes")))


def _serve(kind: str, mode: str, model: str, out: Path) -> Run:
    policy = None if mode == "native" else mode
    port = str(free_port())
    if kind == "tp":
        common: tuple[str, ...] = (
            "--tensor-parallel-size",
            "2",
            "--nnodes",
            "2",
            "--master-addr",
            nodes.ADDR_A,
            "--master-port",
            port,
        )
        only = {"A": ("--node-rank", "0"), "B": ("--headless", "--node-rank", "1")}
    else:
        common = (
            "--data-parallel-size",
            "2",
            "--data-parallel-size-local",
            "1",
            "--data-parallel-address",
            nodes.ADDR_A,
            "--data-parallel-rpc-port",
            port,
        )
        only = {"A": (), "B": ("--headless", "--data-parallel-start-rank", "1")}
    with nodes.Pair() as pair:
        servers: dict[str, Server] = {}
        for node in ("A", "B"):
            runtime = out / f"run-{node}"
            runtime.mkdir()
            journal = out / f"{kind}-{mode}-{node}.kvj" if policy and (kind == "dp" or node == "A") else None
            cfg = validation_config(model, policy, journal)
            cfg.serve_cli = True  # only vllm serve's own entry runs --headless
            cfg.extra_args = common + only[node]
            cfg.env.update(pair.env(node), XDG_RUNTIME_DIR=str(runtime))
            if policy and kind == "dp":
                cfg.env.update(KVCACHED_BUDGET="node", KVCACHED_BUDGET_BYTES=str(96 << 20))
            log = out / f"{kind}-{mode}-{node}.log"
            servers[node] = nodes.NodeB(pair, cfg, log) if node == "B" else Server(cfg, log)
        b = servers["B"]
        assert isinstance(b, nodes.NodeB)
        run = Run(mode, servers["A"], b, journal=out / f"{kind}-{mode}-A.kvj" if policy else None)
        group = nodes.Nodes(run.a, run.b).start()
        try:
            run.ready = run.a.wait_ready(timeout=500)
            if run.ready:
                for _ in range(2):  # a reset after each pass: the second loads back from the CPU tier
                    run.outputs += [
                        run.a.complete(p, n, rank=i % 2 if kind == "dp" else None)
                        for i, (p, n) in enumerate(validation_prompts())
                    ]
                    assert run.a.reset_prefix_cache()
                time.sleep(0.5)
                if policy and kind == "dp":
                    for node in ("A", "B"):
                        runtime = out / f"run-{node}"
                        run.listed[node] = kvctl(runtime, "list", "--json")
                        usage = budget_usage("node", directory=str(runtime / "kvcached"))
                        run.budgets[node] = sorted(e.pid for e in usage.engines)
        finally:
            group.stop()
    return run


@pytest.fixture(scope="module")
def runs(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    modes = ("native", "legacy", "ledger")
    found = {f"tp-{m}": _serve("tp", m, model, tmp_path_factory.mktemp(f"tp-{m}")) for m in modes}
    found["dp-ledger"] = _serve("dp", "ledger", model, tmp_path_factory.mktemp("dp-ledger"))
    return found


@pytest.mark.parametrize("name", ["tp-native", "tp-legacy", "tp-ledger", "dp-ledger"])
def test_two_node_servers_are_healthy(runs: dict[str, Run], name: str) -> None:
    run = runs[name]
    assert run.ready, f"{name}: not ready:\n{run.a.log()[-2000:]}\n--- node B:\n{run.b.log()[-2000:]}"
    for s in (run.a, run.b):  # node B's /dev/shm went with its mount namespace
        check_served(s, run.outputs, legacy=run.mode == "legacy", shm=s is run.a)
    logs = {node: s.log(before_stop=True) for node, s in (("A", run.a), ("B", run.b))}
    if run.mode == "native":
        assert not any(ACTIVE_LINE in text for text in logs.values())
        return
    kind = name.split("-")[0]
    # An engine core on each node for data parallelism; on node A only when one engine spans both.
    assert [text.count(ACTIVE_LINE) for text in logs.values()] == ([1, 1] if kind == "dp" else [1, 0])
    # Each node's worker applied the decisions that came with the steps, in its own node.
    assert [text.count(STEP_CHANNEL) for text in logs.values()] == [1, 1], logs["B"][-2000:]


def test_one_engine_on_two_nodes_matches_native_exactly(runs: dict[str, Run]) -> None:
    native, ours = runs["tp-native"].outputs, runs["tp-ledger"].outputs
    assert sum(c.cached_tokens or 0 for c in native[10:]) > 0, "native never loaded from the CPU tier"
    check_same_as_native(native, ours)


def test_one_engine_on_two_nodes_waits_for_both_workers(runs: dict[str, Run]) -> None:
    journal = runs["tp-ledger"].journal
    assert journal is not None
    workers, reports = job_reports(journal)
    assert workers == 2 and reports and {sum(c) for c in reports.values()} == {2}, reports
    rc, report = replay_check(journal)
    assert rc == 0 and "clean" in report and "0 outstanding" in report, report


def test_legacy_on_two_nodes_shows_the_freed_block_copy(runs: dict[str, Run]) -> None:
    journal = runs["tp-legacy"].journal
    assert journal is not None
    rc, report = replay_check(journal)
    assert rc == 1 and "I1" in report, report


def test_data_parallel_ranks_on_two_nodes_keep_to_their_node(runs: dict[str, Run]) -> None:
    run = runs["dp-ledger"]
    assert run.journal is not None
    for rank, node in enumerate(("A", "B")):
        journal = run.journal.with_name(f"dp-ledger-{node}.kvj.dp{rank}")
        rc, report = replay_check(journal)
        assert rc == 0 and "clean" in report and "0 outstanding" in report and " 0 jobs" not in report, report
        engines = [e["status"]["engine"] for e in run.listed[node] if e.get("alive")]
        assert [(e["index"], e["data_parallel"]) for e in engines] == [(rank, 2)], run.listed[node]
        # A budget is per node: this node's holds this node's engine core only.
        assert run.budgets[node] == [engines[0]["pid"]], (node, run.budgets)
