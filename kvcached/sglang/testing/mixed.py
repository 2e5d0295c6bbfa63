"""Two engines on one memory budget, served for real: the seed's elastic case (tests and kvvalidate).

kvcached PR #598's GPU CI cases ``elastic-vllm-qwen05b+sglang-qwen35_4b`` and its vLLM+vLLM and
SGLang+SGLang pairs (the seed, "Elastic tests") at tiny scale on this CPU: server A and server B
are each ``vllm serve`` (vLLM's CPU build) or SGLang's ``launch_server`` (``SglangServer``), both
with kvcached, both naming one budget (``KVCACHED_BUDGET``) of 96 MiB, less than their two 64 MiB
KV caches. ``run_mixed`` runs the seed's phases; ``tests/serve/test_mixed_budget_e2e.py`` and
kvvalidate's elastic cases make the seed's checks (``MixedRun``).
"""

from __future__ import annotations

import sys
import threading
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached.vllm.testing import elastic
from kvcached.vllm.testing.e2e import Completion, Server, ServerConfig

from .server import DEFAULT_PYTHON, SglangServer

MiB = 1 << 20
KV_BYTES = 64 * MiB  # each server's KV cache (vLLM: 32 blocks of 128 tokens; SGLang: 4,096 slots)
BUDGET_BYTES = 96 * MiB
# A page costs 2 MiB in both: vLLM's per-layer regions (8) of 0.25 MiB, SGLang's per-layer K and V
# regions (16) of 0.125 MiB.
PAGE_MB = {"vllm": "0.25", "sglang": "0.125"}
CPU_TIER = 16 * MiB  # both offload to the host (vLLM's OffloadingConnector, SGLang's HiCache)
STARTUP_S = 600.0
# How long a reset engine has to give its pages back: a bound on a wait for that condition (which
# returns once it holds), sized for a loaded machine (20 s is too short at a load of 18).
RELEASE_S = 120.0

LOADS = {name: elastic.prompts(f"mixed {name}", 5, 6500) for name in ("A", "B", "A contended", "B contended")}
PROBES = [(p, 8) for p, _ in elastic.prompts("mixed probes", 3, 200)]


Pair = tuple[str, str]  # the engines of A and B: "vllm" or "sglang"
VLLM_SGLANG: Pair = ("vllm", "sglang")


def journal(out: Path, name: str, engine: str) -> Path:
    """Where server ``name`` ("A", "B") of ``engine`` ("vllm", "sglang") journals its ledger."""
    return out / f"mixed-{name}-{engine}.kvj"


def configs(
    model: str, runtime: Path, budget: str, dump_dir: Path, pair: Pair = VLLM_SGLANG
) -> dict[str, ServerConfig]:
    def config(name: str, engine: str) -> ServerConfig:
        env = {
            "XDG_RUNTIME_DIR": str(runtime),
            "KVCACHED_MIN_RESERVED_PAGES": "0",
            "KVCACHED_MAX_RESERVED_PAGES": "0",
            "KVCACHED_PAGE_SIZE_MB": PAGE_MB[engine],
            "KVCACHED_BUDGET": budget,
            "KVCACHED_BUDGET_BYTES": str(BUDGET_BYTES),
            "KVCACHED_DUMP_DIR": str(dump_dir),
            "KVCACHED_LEDGER_JOURNAL": str(journal(dump_dir, name, engine)),
        }
        if engine == "sglang":
            env["KVCACHED_BACKEND"] = "host"
        return ServerConfig(model=model, kvcached=True, env=env, kv_cache_bytes=KV_BYTES, cpu_offload_bytes=CPU_TIER)

    return {"A": config("A", pair[0]), "B": config("B", pair[1])}


@dataclass
class MixedRun:
    """What the scenario saw: completions and probes per server, budget samples at each mark.

    NOTE: the seed's checks are the test's (``tests/serve/test_mixed_budget_e2e.py``), on what
    ``run_mixed`` records. ``a_filled_memory``: A's share grows by more than half of the free
    budget. ``a_released_memory``: after its reset A keeps less than half of what it grew.
    ``b_reused_a_memory``: B's share grows past what was free at A's peak. Then
    ``contended_requests_ok``, probes unchanged, both alive, both shut down clean. Each server's
    journal must replay clean (``kvreplay check``).
    """

    completions: dict[str, list[Completion]] = field(default_factory=dict)
    probes: dict[str, list[Completion]] = field(default_factory=dict)  # "A before", "B after", ...
    seen: dict[str, Any] = field(default_factory=dict)
    samples: list[elastic.Sample] = field(default_factory=list)
    sampler_errors: list[str] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)
    left_behind: dict[str, list[int]] = field(default_factory=dict)
    exit_seconds: dict[str, float | None] = field(default_factory=dict)


def _engine_pids(runtime: Path, servers: dict[str, Server]) -> dict[str, int]:
    """kvctl's view: a vLLM engine by its HTTP port, an SGLang engine by its scheduler's pid
    (which runs the ledger service kvctl asks)."""
    pids: dict[str, int] = {}
    listed = {int(e["status"]["pid"]) for e in elastic.kvctl(runtime, "list", "--json") if e.get("status")}
    for n, s in servers.items():
        if isinstance(s, SglangServer):
            pids[n] = s.worker_pid()
            if pids[n] not in listed:
                raise RuntimeError(f"kvctl list shows no SGLang engine of server {n} (pid {pids[n]})")
        else:
            pids[n] = elastic.engine_pid(runtime, s)
    return pids


def run_mixed(
    model: str,
    out: Path,
    runtime: Path,
    *,
    budget: str = "mixed",
    python: str | Path = DEFAULT_PYTHON,
    vllm_python: str | Path = sys.executable,
    pair: Pair = VLLM_SGLANG,
    say: Callable[[str], None] = print,
) -> MixedRun:
    """Start A then B, run the four phases, stop them; never raises for what it observes
    (a server that does not start raises ``RuntimeError`` naming it).

    NOTE: A starts first, then B. The seed's phases, with its load sized down (distinct prompts
    of about 1,000 tokens, 4 greedy output tokens, 16 MiB of KV each; five fill a cache):

    1. A gets its load.
    2. A's prefix cache is reset (vLLM's ``/reset_prefix_cache``).
    3. B gets its load and its prefix cache is reset (SGLang's ``/flush_cache``).
    4. Both get their loads at the same time (two requests at a time each: 128 MiB wanted of a
       96 MiB budget).

    Three greedy probes of about 32 tokens run on each server before and after.
    """
    run = MixedRun()
    cfg = configs(model, runtime, budget, out, pair)

    def server(n: str, engine: str) -> Server:
        log = out / f"mixed-{n}-{engine}.log"
        if engine == "sglang":
            return SglangServer(cfg[n], log, python=python)
        return Server(cfg[n], log, python=str(vllm_python))

    a, b = server("A", pair[0]), server("B", pair[1])
    servers = {"A": a, "B": b}
    sampler: elastic.Sampler | None = None
    try:
        a.start()
        b.start()
        for n, s in servers.items():
            if not s.wait_ready(timeout=STARTUP_S):
                raise RuntimeError(f"server {n} did not start; its log: {s.log_path}")
        say(
            f"A ({pair[0]}) ready after {a.ready_after:.0f} s, B ({pair[1]}) after {b.ready_after:.0f} s; "
            f"budget {budget} of {BUDGET_BYTES // MiB} MiB, {KV_BYTES // MiB} MiB of KV each"
        )
        pids = _engine_pids(runtime, servers)
        # The sampler reads the budget every 0.2 s throughout, and the resident KV bytes of vLLM's
        # workers only: SGLang's scheduler keeps its pool in anonymous memory, which /proc does
        # not name, so an SGLang engine's share in the budget is its account.
        workers = {n: s.worker_pid() for n, s in servers.items() if not isinstance(s, SglangServer)}
        sampler = elastic.Sampler(budget, str(runtime / "kvcached"), workers)
        sampler.engines = {p: n for n, p in pids.items()}
        sampler.start()

        def mark(name: str) -> elastic.Sample:
            s = sampler.sample()
            run.seen[name] = s
            say(
                f"{name}: budget {s.used // MiB} of {(s.size or 0) // MiB} MiB used "
                f"(A {s.share.get('A', 0) // MiB}, B {s.share.get('B', 0) // MiB})"
            )
            return s

        def probe(when: str) -> None:
            for n, s in servers.items():
                run.probes[f"{n} {when}"] = [s.complete(p, k) for p, k in PROBES]

        def released(n: str, grown_from: int, peak: int) -> elastic.Sample | None:
            """The first sample where ``n`` keeps less than half of what it grew."""
            return sampler.wait_for(lambda s: s.share.get(n, 0) - grown_from < (peak - grown_from) / 2, RELEASE_S)

        sampler.phase = "probes before"
        probe("before")
        start = mark("start")

        sampler.phase = "A loads"
        run.completions["A"] = [a.complete(p, k) for p, k in LOADS["A"]]
        a_peak = mark("a_loaded")

        sampler.phase = "A reset"
        run.seen["a_reset_ok"] = a.reset_prefix_cache()
        got = released("A", start.share["A"], a_peak.share["A"])
        run.seen["a_poked"] = got is None
        if got is None and pair[0] == "vllm":  # an idle vLLM engine core steps only when woken (elastic.limit_idle)
            with urllib.request.urlopen(a.url + "/is_sleeping", timeout=30) as r:
                r.read()
            released("A", start.share["A"], a_peak.share["A"])
        mark("a_reset")

        sampler.phase = "B loads"
        run.completions["B"] = [b.complete(p, k) for p, k in LOADS["B"]]
        b_peak = mark("b_loaded")
        sampler.phase = "B reset"
        run.seen["b_reset_ok"] = b.reset_prefix_cache()
        released("B", start.share["B"], b_peak.share["B"])
        mark("b_reset")

        sampler.phase = "both load"
        pools = {n: ThreadPoolExecutor(2, thread_name_prefix=f"load-{n}") for n in "AB"}  # two at a time each
        try:
            futures = {
                n: [pools[n].submit(servers[n].complete, p, k) for p, k in LOADS[f"{n} contended"]] for n in "AB"
            }
            for n in "AB":
                run.completions[f"{n} contended"] = [f.result() for f in futures[n]]
        finally:
            for pool in pools.values():
                pool.shutdown()
        mark("contended")

        sampler.phase = "probes after"
        probe("after")
        run.seen["alive"] = {n: s.proc is not None and s.proc.poll() is None for n, s in servers.items()}
        mark("end")
    finally:
        if sampler is not None:
            sampler.stop()
            run.samples, run.sampler_errors = sampler.samples, sampler.errors
        threads = [threading.Thread(target=s.stop) for s in servers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for n, s in servers.items():
            run.logs[n] = s.log(before_stop=True) if s.log_path.exists() else ""
            run.left_behind[n] = s.left_behind
            run.exit_seconds[n] = s.exit_seconds
    return run
