"""End to end at --tensor-parallel-size 2 on vLLM's CPU build: the page decisions reach both ranks.

Each rank's KV memory is its own worker's; the scheduler's map and unmap decisions ride vLLM's
``SchedulerOutput`` to every worker and are applied there before the step (``step_channel``),
or through vLLM's ``collective_rpc`` when the engine goes idle. kvcached PR #598's validation
load (tests/serve/test_serve_e2e.py), at TP=2 with vLLM's ``mp`` executor:

* ``ledger``, with rank 1 reporting every copy three steps after rank 0 and copying only then
  (``kvcached.vllm.testing.late_rank``): every greedy token, top-5 logprob and cached-token count
  equals native vLLM's at TP=2; the journal replays clean (I1: no page of a job unmapped before
  every worker reported it) and shows jobs reported in two parts, rank 0's first;
* ``legacy``: the journal shows I1 (the freed-block copy), the check above tripping;
* elasticity: after a load and a prefix-cache reset (the engine then idle), both ranks give back
  every KV page but the null block's, and their processes' resident memory falls as much;
* vLLM's Ray executor (``--distributed-executor-backend ray``) is refused by vLLM's CPU platform
  itself, so its test is kept but skipped here (it would compare with native again).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcached.testing.tiny_model import build, corpus
from kvcached.vllm.testing.e2e import (
    ACTIVE_LINE,
    Completion,
    Server,
    ServerConfig,
    check_same_as_native,
    check_served,
    job_reports,
    replay_check,
    rss_bytes,
    validation_config,
    validation_passes,
)

pytestmark = pytest.mark.vllm

TP2 = ("--tensor-parallel-size", "2")
# vLLM's CPU build binds each rank's threads to a NUMA node of its own by default and refuses two
# ranks on one node; this machine has one. Both ranks share the cores, one thread each.
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build(tmp_path_factory.mktemp("tiny-llama-tp")))


@dataclass
class Run:
    mode: str
    server: Server
    ready: bool
    outputs: list[Completion]
    journal: Path | None


def _late_rank(cfg: ServerConfig) -> None:
    """Rank 1 reports late: kvcached's CPU spec, swapped for the test's (same sizes)."""
    from kvcached.vllm.testing.late_rank import SPEC  # imports vLLM: not at collection

    assert cfg.cpu_offload_bytes
    ktc = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": cfg.cpu_offload_bytes,
            "spec_name": SPEC[0],
            "spec_module_path": SPEC[1],
        },
    }
    cfg.cpu_offload_bytes = None
    cfg.extra_args += ("--kv-transfer-config", json.dumps(ktc))


def _run(mode: str, model: str, out: Path, *, executor: str = "mp") -> Run:
    policy = None if mode == "native" else mode.split("-")[0]
    journal = out / f"tp-{mode}.kvj" if policy else None
    cfg = validation_config(model, policy, journal)
    cfg.extra_args = (*TP2, "--distributed-executor-backend", executor)
    cfg.env.update(TP2_ENV)
    if policy == "ledger":
        _late_rank(cfg)
    server = Server(cfg, out / f"tp-{mode}.log").start()
    outputs: list[Completion] = []
    ready = False
    try:
        ready = server.wait_ready(timeout=400)
        if ready:
            outputs, resets = validation_passes(server)
            assert resets == [True, True]
    finally:
        server.stop()
    return Run(mode, server, ready, outputs, journal)


@pytest.fixture(scope="module")
def native(model: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    return _run("native", model, tmp_path_factory.mktemp("tp-native"))


@pytest.fixture(scope="module")
def runs(native: Run, model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    out = tmp_path_factory.mktemp("tp")
    return {"native": native, **{mode: _run(mode, model, out) for mode in ("legacy", "ledger")}}


def _healthy(run: Run, *, ray: bool = False) -> None:
    s = run.server
    assert run.ready, f"{run.mode}: not ready:\n{s.log()[-3000:]}"
    # Ray's own start-up chatter (dashboard, usage stats) is not the server's.
    before_stop = check_served(
        s,
        run.outputs,
        legacy=run.mode == "legacy",
        ours=(lambda line: "kvcached" in line or "Traceback" in line) if ray else lambda line: True,
    )
    active = [line for line in before_stop.splitlines() if ACTIVE_LINE in line]
    ranks = [line for line in before_stop.splitlines() if "mapped as the scheduler decides (step channel)" in line]
    if run.mode == "native":
        assert not active and not ranks
    else:
        assert len(active) == 1 and "backend=host" in active[0], active
        assert len(ranks) == 2, ranks  # both workers applied the decisions that came with the steps


@pytest.mark.parametrize("mode", ["native", "legacy", "ledger"])
def test_tp2_servers_are_healthy(runs: dict[str, Run], mode: str) -> None:
    _healthy(runs[mode])


def _same(native: list[Completion], ours: list[Completion]) -> None:
    assert sum(c.cached_tokens or 0 for c in native[10:]) > 0, "native never loaded from the CPU tier"
    check_same_as_native(native, ours)


def test_ledger_at_tp2_matches_native_exactly(runs: dict[str, Run]) -> None:
    _same(runs["native"].outputs, runs["ledger"].outputs)


def test_ledger_keeps_pages_until_both_ranks_reported(runs: dict[str, Run]) -> None:
    run = runs["ledger"]
    assert run.journal is not None
    workers, reports = job_reports(run.journal)
    assert workers == 2
    split = [job for job, counts in reports.items() if counts == [1, 1]]
    assert reports and all(sum(c) == 2 for c in reports.values()), reports
    assert len(split) == len(reports), f"rank 1 did not report late: {reports}"
    rc, report = replay_check(run.journal)
    assert rc == 0 and "clean" in report and "0 outstanding" in report, report


def test_legacy_at_tp2_shows_the_freed_block_copy(runs: dict[str, Run]) -> None:
    run = runs["legacy"]
    assert run.journal is not None
    rc, report = replay_check(run.journal)
    assert rc == 1 and "I1" in report, report


# --- elasticity: both ranks give memory back --------------------------------------------------------


def _worker_pids(s: Server) -> list[int]:
    import psutil

    pids = []
    for pid, p in s._processes().items():
        with contextlib.suppress(psutil.Error):
            if "Worker" in " ".join(p.cmdline()) or "Worker" in p.name():
                pids.append(pid)
    return sorted(pids)


def _kv_resident(pid: int) -> int:
    """Resident bytes of the worker's own KV range (its /dev/shm mapping, ``/proc/PID/smaps``):
    observed from outside, never the mechanism (on a GPU there is no such file)."""
    total, ours = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                ours = "kvcached-kv-" in line
            elif ours and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_both_ranks_give_memory_back_after_a_prefix_cache_reset(model: str, tmp_path: Path) -> None:
    env = {"KVCACHED_MAX_RESERVED_PAGES": "0", "KVCACHED_MIN_RESERVED_PAGES": "0", **TP2_ENV}
    cfg = ServerConfig(
        model=model, kvcached=True, env=env, kv_cache_bytes=128 << 20, cpu_offload_bytes=8 << 20, extra_args=TP2
    )
    with Server(cfg, tmp_path / "tp-elastic.log") as s:
        assert s.wait_ready(timeout=400), s.log()[-3000:]
        workers = _worker_pids(s)
        assert len(workers) == 2, workers
        before = [(rss_bytes(w), _kv_resident(w)) for w in workers]
        for i in range(8):  # ~1000 distinct tokens each, kept in the prefix cache
            assert s.complete(" ".join(corpus(80, seed=100 + i))[:5000], 2).ok
        loaded = [(rss_bytes(w), _kv_resident(w)) for w in workers]
        assert s.reset_prefix_cache()
        time.sleep(2.0)  # the engine is idle: the unmaps went out through collective_rpc
        after = [(rss_bytes(w), _kv_resident(w)) for w in workers]
    mib = 1 << 20
    page = (2 << 20) * 8  # the default 2 MiB page in each of the tiny model's 8 layers
    for rank, ((b, kb), (lo, kl), (a, ka)) in enumerate(zip(before, loaded, after, strict=True)):
        print(f"rank {rank} RSS MiB: {b // mib} -> load {lo // mib} -> reset {a // mib}; ", end="")
        print(f"its KV range: {kb // mib} -> {kl // mib} -> {ka // mib}")
        assert kl - kb > 24 * mib, f"rank {rank}: the load did not fill its KV cache"
        # What stays is the page of vLLM's null block (block 0, held for the engine's life).
        assert ka <= page + mib, f"rank {rank} kept {ka // mib} MiB of KV after the reset"
        assert lo - a >= (kl - ka) - 4 * mib, f"rank {rank}: the process did not give back what its range did"


# --- Ray ------------------------------------------------------------------------------------------


@pytest.mark.skip(
    reason="vLLM's CPU platform refuses Ray (ray_utils.initialize_ray_cluster: 'current platform cpu does not "
    "support ray'; tried with ray 2.60.0 from the index); kvcached's path is the same as under mp"
)
def test_ray_executor_at_tp2_matches_native(native: Run, model: str, tmp_path: Path) -> None:
    run = _run("ledger-ray", model, tmp_path, executor="ray")
    _healthy(run, ray=True)
    _same(native.outputs, run.outputs)
