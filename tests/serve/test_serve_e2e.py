"""End to end on vLLM's CPU build: `vllm serve` with kvcached on, offloading on, against native.

Upstream kvcached PR #598's validation, scaled to a tiny llama made here (random weights, local tokenizer):
the same prompts (long ones sharing a prefix, some with one output token) are sent twice with
a prefix-cache reset in between, so the second pass loads its prefix from the CPU tier, to a
native server and to kvcached servers under each policy, launched with the same flags. The
seed's reproduction settings are used (no cached blocks kept, no reserved pages), and pages of
one block, so that a freed block's page really goes. Under ``legacy`` the freed-block copy
shows: the journal replays with I1 violations (and outputs may differ); under ``ledger`` every
greedy token and top-5 logprob equals native's, and so does every cached-token count. Each
server must pass kvcached PR #598's server checks. A second pair of servers checks elasticity: after a
load and a prefix-cache reset the worker's resident memory falls by most of what the load
added with kvcached, and not with native vLLM.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcached.testing.tiny_model import build, corpus
from kvcached.vllm.testing.e2e import (
    ACTIVE_LINE,
    ERROR_SIGNATURES,
    Completion,
    Server,
    ServerConfig,
    keep_trace,
    replay_check,
    rss_bytes,
    validation_config,
    validation_passes,
)

pytestmark = pytest.mark.vllm

# What kvcached logs at ERROR when the ledger sees a violation (service/ledger_service.py).
FLIGHT_LINES = re.compile(r"kvcached: (invariant I\d violated|flight recorder \()")


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build(tmp_path_factory.mktemp("tiny-llama")))


@dataclass
class Run:
    mode: str
    server: Server
    ready: bool
    outputs: list[Completion]
    reset_ok: list[bool]
    alive_after_load: bool
    journal: Path | None


def _run(mode: str, model: str, out: Path) -> Run:
    journal = out / f"serve-{mode}.kvj" if mode != "native" else None
    cfg = validation_config(model, None if mode == "native" else mode, journal)
    if mode != "native":
        cfg.env["KVCACHED_DUMP_DIR"] = str(out / f"dumps-{mode}")
    server = Server(cfg, out / f"serve-{mode}.log").start()
    outputs: list[Completion] = []
    resets: list[bool] = []
    alive = False
    try:
        ready = server.wait_ready()
        if ready:
            outputs, resets = validation_passes(server)
            alive = server.proc is not None and server.proc.poll() is None
    finally:
        server.stop()
    return Run(mode, server, ready, outputs, resets, alive, journal)


@pytest.fixture(scope="module")
def runs(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    out = tmp_path_factory.mktemp("serve")
    return {mode: _run(mode, model, out) for mode in ("native", "legacy", "ledger")}


def _keep(journal: Path) -> None:
    keep_trace(journal, f"serve-validation.{journal.stem.split('-')[-1]}.kvj")


@pytest.mark.parametrize("mode", ["native", "legacy", "ledger"])
def test_server_checks(runs: dict[str, Run], mode: str) -> None:
    run = runs[mode]
    s = run.server
    assert run.ready, f"{mode}: not ready:\n{s.log()[-3000:]}"
    assert len(run.outputs) == 20 and all(c.ok for c in run.outputs), [c.status for c in run.outputs]
    assert run.reset_ok == [True, True]
    assert run.alive_after_load
    assert s.exit_seconds is not None and s.exit_seconds <= 90, s.exit_seconds
    assert s.left_behind == [], f"processes left behind: {s.left_behind}"
    assert s.shm_files() == [], f"KV files left in /dev/shm: {s.shm_files()}"
    before_stop = s.log(before_stop=True)
    bad = [line for line in before_stop.splitlines() if ERROR_SIGNATURES.search(line)]
    if mode == "legacy":
        # Legacy's freed-block copies are reported, as they happen, by kvcached itself, and only those.
        bad = [line for line in bad if not FLIGHT_LINES.search(line)]
    assert not bad, bad[:5]
    active = [line for line in before_stop.splitlines() if ACTIVE_LINE in line]
    if mode == "native":
        assert not [line for line in before_stop.splitlines() if "[kvcached]" in line]
    else:
        assert len(active) == 1, active
        assert f"policy={mode}" in active[0] and "backend=host" in active[0] and "offloading bridge=on" in active[0]
        # ... and what it changed in vLLM (kvcached/vllm/patches.py)
        changed = active[0].split("vLLM changed: ", 1)[1]
        assert "v1.core.sched.scheduler.Scheduler.__init__" in changed and "EngineCoreProc.run_busy_loop" in changed


def test_second_pass_loads_from_the_cpu_tier(runs: dict[str, Run]) -> None:
    native = runs["native"].outputs
    second = native[10:]
    assert sum(c.cached_tokens or 0 for c in second) > 0, "native never loaded from the CPU tier"


def test_ledger_matches_native_exactly(runs: dict[str, Run]) -> None:
    native, ours = runs["native"].outputs, runs["ledger"].outputs
    for i, (a, b) in enumerate(zip(native, ours, strict=True)):
        assert b.tokens == a.tokens, f"request {i}: {b.text!r} != native {a.text!r}"
        assert b.max_logprob_diff(a) == 0.0, f"request {i}: top-5 logprobs differ"
        assert b.cached_tokens == a.cached_tokens, f"request {i}: cached {b.cached_tokens} != {a.cached_tokens}"


def test_legacy_shows_the_freed_block_copy(runs: dict[str, Run]) -> None:
    run = runs["legacy"]
    assert run.journal is not None
    rc, report = replay_check(run.journal)
    differ = [
        i for i, (a, b) in enumerate(zip(runs["native"].outputs, run.outputs, strict=True)) if a.tokens != b.tokens
    ]
    assert rc == 1 and "I1" in report, report
    _keep(run.journal)
    print(f"legacy: {len(differ)} of 20 outputs differ from native ({differ}); replay: {report.splitlines()[-2]}")


def test_legacy_flight_recorder_saves_its_first_I1_by_itself(runs: dict[str, Run]) -> None:
    run = runs["legacy"]
    log = run.server.log()
    line = r"flight recorder \(I1 at event (\d+)\).* saved to (\S+); replay with: kvreplay check (\S+)"
    named = re.findall(line, log)
    assert len(named) == 1, [line for line in log.splitlines() if "flight" in line]
    index, written, dump = named[0]
    assert written == dump and Path(dump).exists()
    rc, report = replay_check(Path(dump), "--json")
    assert rc == 1, report
    got = [v for v in json.loads(report)["violations"] if v["invariant"] == "I1"]
    # The same first I1 as the live ledger saw, and as the whole journal shows.
    assert run.journal is not None
    _, whole = replay_check(run.journal, "--json")
    want = next(v for v in json.loads(whole)["violations"] if v["invariant"] == "I1")
    assert got and (got[0]["code"], got[0]["index"], got[0]["page"]) == (want["code"], want["index"], want["page"])
    assert got[0]["index"] == int(index)


def test_ledger_journal_replays_clean(runs: dict[str, Run]) -> None:
    run = runs["ledger"]
    assert run.journal is not None
    rc, report = replay_check(run.journal)
    assert rc == 0 and "clean" in report, report
    assert "0 outstanding" in report
    _keep(run.journal)


def test_a_served_journal_finds_a_build_by_its_time(runs: dict[str, Run]) -> None:
    """A served engine stamps its build boundaries with their time, so an incident's time on a
    dashboard leads to its build: ``kvreplay show --at`` halfway between two boundaries names the
    later one's build, as the engine ran it."""
    from kvcached.ledger.events import BuildBoundary
    from kvcached.ledger.journal import read_journal

    run = runs["ledger"]
    assert run.journal is not None
    got = read_journal(run.journal)
    base = got.header.clock_base_unix
    assert base > 0 and abs(base - time.time()) < 3600, base
    stamps = [(b.build, b.at_us) for b in got.events if isinstance(b, BuildBoundary)]
    assert stamps and all(t is not None for _, t in stamps), stamps[:5]
    pairs = [(a, b) for a, b in itertools.pairwise(stamps) if (b[1] or 0) > (a[1] or 0)]
    (_, t0), (build, t1) = pairs[len(pairs) // 2]
    at = base + ((t0 or 0) + (t1 or 0)) / 2e6
    r = subprocess.run(
        [sys.executable, "-m", "kvreplay.cli", "show", str(run.journal), "--at", f"{at:.6f}", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and f"build {build} was running" in r.stdout.splitlines()[0], r.stdout + r.stderr


# --- elasticity ------------------------------------------------------------------------------


def _elastic(model: str, out: Path, kvcached: bool) -> tuple[int, int, int]:
    env = {"KVCACHED_MAX_RESERVED_PAGES": "0", "KVCACHED_MIN_RESERVED_PAGES": "0"} if kvcached else {}
    cfg = ServerConfig(model=model, kvcached=kvcached, env=env, kv_cache_bytes=256 << 20, cpu_offload_bytes=8 << 20)
    with Server(cfg, out / f"elastic-{'kvcached' if kvcached else 'native'}.log") as s:
        assert s.wait_ready(), s.log()[-3000:]
        worker = s.worker_pid()
        before = rss_bytes(worker)
        for i in range(12):  # ~1200 distinct tokens each: the KV cache nearly full, kept in the prefix cache
            assert s.complete(" ".join(corpus(80, seed=100 + i))[:5000], 2).ok
        loaded = rss_bytes(worker)
        assert s.reset_prefix_cache()
        time.sleep(1.0)
        after = rss_bytes(worker)
    return before, loaded, after


def test_worker_memory_goes_back_after_a_prefix_cache_reset(model: str, tmp_path: Path) -> None:
    b0, l0, a0 = _elastic(model, tmp_path, kvcached=True)
    n0, nl, na = _elastic(model, tmp_path, kvcached=False)
    mib = 1 << 20
    print(f"kvcached worker RSS MiB: {b0 // mib} -> load {l0 // mib} -> reset {a0 // mib}")
    print(f"native   worker RSS MiB: {n0 // mib} -> load {nl // mib} -> reset {na // mib}")
    grew = l0 - b0
    assert grew > 64 * mib, "the load did not fill the KV cache"
    assert l0 - a0 > grew // 2, "kvcached kept most of what the load added"
    # Native vLLM zero-fills its KV buffer at start: resident from the first second, never given back.
    assert nl - na < 16 * mib, "native vLLM gave memory back: the comparison is void"
