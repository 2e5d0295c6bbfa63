"""Two kvcached engines on one memory budget, served for real: the scenario, its timeline, its plot.

kvcached exists so that several models share one machine's KV memory: what an idle engine gives
back, a busy one maps. This is that, end to end, on vLLM's CPU build: two ``vllm serve`` engines
(A and B, the same tiny model) name one budget (``KVCACHED_BUDGET``) smaller than the sum of
their KV caches, at kvcached's default reserve and prefix-cache cap; B bursts while A idles, and
an operator steers them with ``kvctl`` through five phases more (``run_elastic``).
``tests/serve/test_budget_e2e.py`` checks it; ``kvcached.vllm.testing.demo`` (the main job) prints
it and plots it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached.budget import held_still
from kvcached.testing.tiny_model import corpus
from kvcached.vllm.testing.e2e import Completion, Server, ServerConfig, kv_resident_bytes

MiB = 1 << 20
KV_BYTES = 64 * MiB  # each engine's KV cache, as vLLM sizes it (32 blocks of 128 tokens, 2 MiB each)
BUDGET_BYTES = 80 * MiB  # the budget both name: less than the 128 MiB of the two caches
A_IDLE_LIMIT = 8 * MiB  # what A is limited to while idle (4 pages)
B_IDLE_LIMIT = 16 * MiB
CPU_TIER = 16 * MiB  # both (and native) offload to a CPU tier, the setup kvcached is for
PAGE_MB = "0.25"  # a page of one block per layer (2 MiB in all 8 layers): memory moves block by block
# Several servers starting at once on a busy 2-core machine take over the harness's 240 s.
STARTUP_S = 600.0
# Bounds on waits for a condition, sized for a loaded 2-core machine (5, 10 and 20 s are too short
# at a load of 18). Each guards a liveness that a bug makes infinite, not a speed:
# without kvctl's wake-up an idle engine core never steps (it blocks on its input queue), and
# without the dead share's reclaim B never maps A's. The waits return as soon as the condition holds.
KILL_BOUND_S = 60.0  # a dead engine's share must be mapped by another within this
IDLE_LIMIT_S = 60.0  # an idle engine limited by kvctl reaches the limit within this, with no call
POKED_LIMIT_S = 120.0  # ... or, where it did not, after a utility call stepped its engine core


def server_config(
    model: str, *, kvcached: bool, runtime: Path, budget: str, dump_dir: Path, cpu_tier: int = CPU_TIER
) -> ServerConfig:
    """A or B (``kvcached``), or the native server with the same flags."""
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    if kvcached:  # the default reserve (5..10 pages) and prefix-cache cap: only the page is set
        env.update(
            KVCACHED_PAGE_SIZE_MB=PAGE_MB,
            KVCACHED_BUDGET=budget,
            KVCACHED_BUDGET_BYTES=str(BUDGET_BYTES),
            KVCACHED_DUMP_DIR=str(dump_dir),
        )
    return ServerConfig(model=model, kvcached=kvcached, env=env, kv_cache_bytes=KV_BYTES, cpu_offload_bytes=cpu_tier)


def prompts(phase: str, n: int, chars: int) -> list[tuple[str, int]]:
    """``n`` distinct prompts of about ``chars`` characters (6,500: about 1,000 tokens, 8 blocks),
    4 output tokens each; distinct across phases, so that no prefix is shared and native vLLM's
    cache state cannot matter to the comparison."""
    seed = 7000 + 100 * sum(map(ord, phase))
    return [(" ".join(corpus(160, seed=seed + i))[:chars], 4) for i in range(n)]


# B's burst while A idles: sent at once, three prompts of about 6 blocks each (36 MiB), far more
# than the budget has left once A has loaded. Compared with native for being served only: a batch
# of three computes in another order than native's one at a time, so the last bits may differ.
BURST: list[tuple[str, int]] = prompts("B bursts", 3, 4800)
PHASES: dict[str, list[tuple[str, int]]] = {
    "A loads": prompts("A loads", 5, 6500),
    "B loads": prompts("B loads", 5, 6500),
    "A again": prompts("A again", 2, 1200),
    "A fills": prompts("A fills", 4, 6500),
    "B after kill": prompts("B after kill", 2, 6500),
}


def kvctl(runtime: Path, *argv: str) -> Any:
    """Run ``kvctl`` as an operator does (its own process, the servers' runtime directory)."""
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("KVCACHED_LEDGER_SOCKET", None)
    r = subprocess.run([sys.executable, "-m", "kvctl.cli", *argv], capture_output=True, text=True, env=env, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"kvctl {' '.join(argv)}: {r.stderr.strip()}")
    return json.loads(r.stdout) if "--json" in argv else r.stdout


def engine_pid(runtime: Path, server: Server) -> int:
    """The engine-core pid of ``server`` (its HTTP port, as ``kvctl list`` shows it)."""
    for e in kvctl(runtime, "list", "--json"):
        st = e.get("status") or {}
        if (st.get("engine") or {}).get("port") == server.port:
            return int(st["pid"])
    raise RuntimeError(f"kvctl list shows no engine on port {server.port}")


@dataclass(frozen=True)
class Sample:
    t: float  # seconds since the sampler started
    phase: str
    used: int  # the budget's bytes held by live engines
    size: int | None
    share: dict[str, int]  # engine -> bytes it holds in the budget
    resident: dict[str, int]  # engine -> its worker's resident KV bytes
    # Engines whose engine core the budget finds dead (a SIGKILL): their workers' memory goes as
    # the kernel tears those processes down, a moment after the share is no longer counted.
    dead: frozenset[str] = frozenset()


class Sampler(threading.Thread):
    """Reads the budget and each worker's KV residency every ``period`` seconds.

    NOTE: it reads the budget and each worker's resident KV bytes (``kv_resident_bytes``: its
    mappings of kvcached's KV files) every 0.2 s, so that a check that the budget was never
    exceeded looks at the whole run, not at its end.
    """

    def __init__(self, budget: str, directory: str, workers: dict[str, int], period: float = 0.2) -> None:
        super().__init__(daemon=True, name="kvcached-elastic-sampler")
        self.budget, self.directory, self.workers, self.period = budget, directory, dict(workers), period
        self.engines: dict[int, str] = {}  # engine-core pid -> name, for the budget's shares
        self.samples: list[Sample] = []
        self.phase = "start"
        self.errors: list[str] = []
        self._halt = threading.Event()  # not _stop: threading.Thread has a _stop of its own
        self.t0 = time.monotonic()

    def sample(self) -> Sample:
        # NOTE: the workers are read one after the other, under the budget's lock: read without
        # it, A's memory before A gave a page back and B's after B mapped it summed a page that
        # was never mapped twice (the budget's promise holds at every instant, not across two).
        with held_still(self.budget, directory=self.directory) as u:
            resident = {}
            for name, pid in self.workers.items():
                try:
                    resident[name] = kv_resident_bytes(pid)
                except (FileNotFoundError, ProcessLookupError, PermissionError):
                    resident[name] = 0  # killed: its memory went with it
        share = {name: 0 for name in self.engines.values()}
        live = set()
        for e in u.engines:
            if e.alive and e.pid in self.engines:
                share[self.engines[e.pid]] += e.bytes
                live.add(self.engines[e.pid])
        dead = frozenset(share) - live  # shown dead, or its share already dropped
        s = Sample(time.monotonic() - self.t0, self.phase, u.used, u.size, share, resident, dead)
        self.samples.append(s)
        return s

    def run(self) -> None:
        while not self._halt.wait(self.period):
            try:
                self.sample()
            except Exception as exc:  # kept for the test to report, not lost in a thread
                self.errors.append(repr(exc))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)

    def wait_for(self, cond: Callable[[Sample], bool], timeout: float) -> Sample | None:
        """The first fresh sample for which ``cond`` holds, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.sample()
            if cond(s):
                return s
            time.sleep(0.05)
        return None


@dataclass
class ElasticRun:
    """What the scenario saw: completions per phase, kvctl's answers, the timeline, figures.

    NOTE: every completion is kept for comparison with native vLLM's on the same prompts (greedy
    tokens, top-5 logprobs: ``compare``).
    """

    completions: dict[str, list[Completion]] = field(default_factory=dict)
    seen: dict[str, Any] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    sampler_errors: list[str] = field(default_factory=list)
    logs: dict[str, str] = field(default_factory=dict)


def _status(runtime: Path, pid: int) -> dict[str, Any]:
    return dict(kvctl(runtime, "-e", str(pid), "status", "--json"))


def _wait_within_limit(runtime: Path, pid: int, timeout: float) -> dict[str, Any]:
    """``kvctl status`` of engine ``pid`` once no shrink is pending (or at ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        st = _status(runtime, pid)
        if not st["memory"]["shrink_pending"] or time.monotonic() > deadline:
            return st
        time.sleep(0.3)


def limit_idle(runtime: Path, pid: int, server: Server, size: str, seen: dict[str, Any], key: str) -> None:
    """``kvctl limit`` an idle engine, and see it reach the limit: first with no call at all
    (``seen[key + "_idle"]``: kvctl's own wake-up of the engine core is all there is), then,
    if a shrink is still pending, after a utility call that steps the engine core and touches
    no request or cache (``GET /is_sleeping``, vLLM's dev API): ``seen[key]``. The pages the
    limit empties wait for one build of the connector (their grace), which an idle engine core
    makes only when something wakes it (``Engine.set_limit_bytes``)."""
    # --force: an idle engine is drained below its floor (one request of max_model_len, 32 MiB
    # here) on purpose, to show the pages go; its limit is lifted before it serves again.
    seen[key + "_reply"] = kvctl(runtime, "limit", str(pid), size, "--force", "--json")
    t0 = time.monotonic()
    seen[key + "_idle"] = st = _wait_within_limit(runtime, pid, IDLE_LIMIT_S)
    seen[key + "_idle_s"] = time.monotonic() - t0
    seen[key + "_poked"] = bool(st["memory"]["shrink_pending"])
    if seen[key + "_poked"]:
        with urllib.request.urlopen(server.url + "/is_sleeping", timeout=30) as r:
            r.read()
        st = _wait_within_limit(runtime, pid, POKED_LIMIT_S)
    seen[key] = st


def run_elastic(
    model: str,
    out: Path,
    runtime: Path,
    *,
    budget: str = "demo",
    cpu_tier: int = CPU_TIER,
    say: Callable[[str], None] = print,
) -> ElasticRun:
    """Start A and B, run the five phases, stop them; never raises for what it observes.

    NOTE: the phases, with the operator's ``kvctl`` a separate process, as one runs it:

    1. A is loaded until it holds most of the budget (its prefix cache keeps the pages).
    1b. B bursts (``BURST``, at once) while A idles. B's counts fall short of the budget, so B
       asks (``kvcached.budget.Budget.ask``); A's ledger service gives back toward the ask on
       its tick, its reserve and then its cached blocks by page, down to its floor, and B maps
       them, without preempting a request for want of A's reserve.
    2. Idle, A is limited (``kvctl limit A 8M --force``, below its floor on purpose). It evicts its
       cached blocks page by page and gives the pages back once its engine core takes a step, for
       their grace pins to end. The plugin's own wake-up is seen to reach it or not; else a utility
       call, ``GET /is_sleeping``, does (``limit_idle``).
    3. B is loaded, and grows into what A gave back, far beyond what was left before.
    4. A's limit is lifted (``none``) and A serves again within what is left.
    5. B is limited, A is loaded until the budget is full, B's limit is lifted, and A is killed
       with SIGKILL while it holds its pages. B, loaded again, needs A's share, and maps it once a
       look at the budget finds A dead (``kvcached.budget``: no daemon; the dead share is dropped).
    """
    run = ElasticRun()
    cfg = {
        n: server_config(model, kvcached=True, runtime=runtime, budget=budget, dump_dir=out, cpu_tier=cpu_tier)
        for n in "AB"
    }
    servers = {n: Server(cfg[n], out / f"elastic-{n}.log") for n in "AB"}
    try:
        for s in servers.values():
            s.start()
        for n, s in servers.items():
            if not s.wait_ready(timeout=STARTUP_S):
                raise RuntimeError(f"engine {n} did not start; its log: {s.log_path}")
        say(
            f"A and B ready after {max(s.ready_after or 0 for s in servers.values()):.0f} s, "
            f"budget {budget} of {BUDGET_BYTES // MiB} MiB, {KV_BYTES // MiB} MiB of KV each"
        )
        pids = {n: engine_pid(runtime, s) for n, s in servers.items()}
        sampler = Sampler(budget, str(runtime / "kvcached"), {n: s.worker_pid() for n, s in servers.items()})
        sampler.engines = {p: n for n, p in pids.items()}
        sampler.start()
        a, b = servers["A"], servers["B"]

        def phase(name: str, server: Server) -> Sample:
            sampler.phase = name
            run.completions[name] = [server.complete(p, k) for p, k in PHASES[name]]
            time.sleep(0.5)
            s = sampler.sample()
            say(
                f"{name}: {len(run.completions[name])} requests; budget {s.used // MiB} of "
                f"{(s.size or 0) // MiB} MiB used (A {s.share.get('A', 0) // MiB}, B {s.share.get('B', 0) // MiB})"
            )
            return s

        full = phase("A loads", a)
        run.seen["a_loaded"] = full
        run.seen["headroom_before_giveback"] = (full.size or 0) - full.used

        sampler.phase = "B bursts"
        preempted = b.metric("vllm:num_preemptions_total")
        t0 = sampler.sample().t
        with ThreadPoolExecutor(len(BURST)) as pool:
            run.completions["B bursts"] = list(pool.map(lambda pk: b.complete(*pk), BURST))
        run.seen["b_burst_s"] = sampler.sample().t - t0
        run.seen["b_burst_preemptions"] = b.metric("vllm:num_preemptions_total") - preempted
        time.sleep(0.5)
        run.seen["b_burst"] = burst = sampler.sample()
        during = [x for x in list(sampler.samples) if x.phase == "B bursts"]
        had = full.share.get("B", 0) + run.seen["headroom_before_giveback"]  # B's own and what was free
        peak = max((x.share.get("B", 0) for x in during), default=0)
        grew = next((x.t - t0 for x in during if x.share.get("B", 0) > had), None)
        run.seen["b_burst_peak"], run.seen["b_grew_after_s"] = peak, grew
        say(
            f"B bursts ({len(BURST)} requests at once) while A idles: B's share peaked at {peak // MiB} MiB where "
            f"{had // MiB} MiB was its own or free"
            + ("" if grew is None else f" (beyond it {grew:.1f} s into the burst)")
            + f"; A {full.share.get('A', 0) // MiB} -> {burst.share.get('A', 0) // MiB} MiB; "
            f"{run.seen['b_burst_preemptions']:.0f} preemptions in B; the burst took {run.seen['b_burst_s']:.1f} s"
        )

        sampler.phase = "A limited"
        limit_idle(runtime, pids["A"], a, f"{A_IDLE_LIMIT // MiB}M", run.seen, "a_status_limited")
        time.sleep(0.5)
        run.seen["a_limited"] = sampler.sample()
        idle = run.seen["a_status_limited_idle"]["memory"]["mapped_bytes"] // MiB
        after = run.seen["a_status_limited_idle_s"]
        say(
            f"A limited to {A_IDLE_LIMIT // MiB} MiB while idle: {idle} MiB mapped {after:.1f} s later with no request"
            + (", then a utility call woke its engine core: " if run.seen["a_status_limited_poked"] else ": ")
            + f"{run.seen['a_status_limited']['memory']['mapped_bytes'] // MiB} MiB mapped, its worker's KV "
            f"resident {run.seen['a_limited'].resident['A'] // MiB} MiB"
        )

        run.seen["b_loaded"] = phase("B loads", b)
        run.seen["a_raise_reply"] = kvctl(runtime, "limit", str(pids["A"]), "none", "--json")
        run.seen["a_again"] = phase("A again", a)

        sampler.phase = "B limited"
        limit_idle(runtime, pids["B"], b, f"{B_IDLE_LIMIT // MiB}M", run.seen, "b_status_limited")
        # What A fills into: B's unmaps are back in the budget once its workers applied them.
        t0 = time.monotonic()
        back = sampler.wait_for(lambda s: s.share.get("B", 0) <= B_IDLE_LIMIT, IDLE_LIMIT_S)
        run.seen["b_share_back_after_s"] = None if back is None else time.monotonic() - t0
        run.seen["b_status_share_back"] = _status(runtime, pids["B"])
        run.seen["a_filled"] = phase("A fills", a)
        run.seen["b_status_a_filled"] = _status(runtime, pids["B"])
        run.seen["a_status_a_filled"] = _status(runtime, pids["A"])
        kvctl(runtime, "limit", str(pids["B"]), "none", "--json")
        before = sampler.sample()
        run.seen["before_kill"] = before
        sampler.phase = "A killed"
        assert a.proc is not None
        run.logs["A"] = a.log()
        os.killpg(a.proc.pid, signal.SIGKILL)  # what a crash or the OOM killer does
        a.proc.wait()
        t_kill = time.monotonic()
        sampler.phase = "B after kill"
        done: list[Completion] = []
        worker = threading.Thread(target=lambda: done.extend(b.complete(p, k) for p, k in PHASES["B after kill"]))
        worker.start()
        want = before.share["B"] + max(0, (before.size or 0) - before.used)
        got = sampler.wait_for(lambda s: s.share.get("B", 0) > want, KILL_BOUND_S)
        run.seen["b_mapped_dead_share_after_s"] = None if got is None else time.monotonic() - t_kill
        run.seen["b_share_wanted"] = want
        worker.join(timeout=300)
        run.completions["B after kill"] = done
        time.sleep(0.5)
        run.seen["end"] = sampler.sample()
        after = run.seen["b_mapped_dead_share_after_s"]
        say(
            f"A killed (SIGKILL) holding {before.share['A'] // MiB} MiB: B mapped beyond its "
            f"{want // MiB} MiB " + ("never, within the bound" if after is None else f"{after:.1f} s later")
        )
        sampler.stop()
        run.samples, run.sampler_errors = sampler.samples, sampler.errors
        run.logs["B"] = b.log()
    finally:
        for s in servers.values():
            s.stop()
    return run


NATIVE_ORDER = ("A loads", "B loads", "A again", "A fills", "B after kill")


def native_completions(server: Server) -> dict[str, list[Completion]]:
    """The same prompts on a native server, phase by phase."""
    return {name: [server.complete(p, k) for p, k in PHASES[name]] for name in NATIVE_ORDER}


def compare(
    ours: dict[str, list[Completion]], native: dict[str, list[Completion]]
) -> list[tuple[str, int, bool, float]]:
    """(phase, request, same tokens, top-5 logprob max diff) for every request both served."""
    rows = []
    for name in NATIVE_ORDER:
        for i, (x, y) in enumerate(zip(ours.get(name, []), native[name], strict=False)):
            rows.append((name, i, x.ok and x.tokens == y.tokens, x.max_logprob_diff(y)))
    return rows


def timeline_rows(samples: Sequence[Sample]) -> list[tuple[str, float, int, int, int, int, int]]:
    """One row per phase, at its last sample: (phase, t, A resident, B resident, A+B, budget
    used, budget size), bytes."""
    last: dict[str, Sample] = {}
    for s in samples:
        last[s.phase] = s
    rows = []
    for name, s in last.items():
        ra, rb = s.resident.get("A", 0), s.resident.get("B", 0)
        rows.append((name, s.t, ra, rb, ra + rb, s.used, s.size or 0))
    return rows


def plot(samples: Sequence[Sample], path: Path, *, native_each: int = KV_BYTES) -> bool:
    """The memory timeline as a PNG: each worker's resident KV, their sum, the budget, and what
    two native vLLM engines hold (each its whole KV cache, from start). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t = [s.t for s in samples]
    mib = float(MiB)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(t, [s.resident.get("A", 0) / mib for s in samples], label="engine A: worker's resident KV")
    ax.plot(t, [s.resident.get("B", 0) / mib for s in samples], label="engine B: worker's resident KV")
    ax.plot(t, [sum(s.resident.values()) / mib for s in samples], label="A + B", linewidth=2)
    ax.plot(t, [(s.size or 0) / mib for s in samples], "k--", label="budget (shared by A and B)")
    ax.plot(t, [2 * native_each / mib] * len(t), ":", color="grey", label="two native vLLM engines (whole KV caches)")
    prev = None
    for s in samples:
        if s.phase != prev:
            ax.axvline(s.t, color="lightgrey", linewidth=0.8)
            ax.text(s.t, 2 * native_each / mib * 1.02, s.phase, rotation=90, fontsize=7, va="bottom")
            prev = s.phase
    ax.set_xlabel("seconds")
    ax.set_ylabel("MiB")
    ax.set_ylim(0, 2 * native_each / mib * 1.45)
    ax.legend(loc="upper left", fontsize=7)
    ax.set_title("Two kvcached engines on one KV budget (vLLM CPU build, tiny llama)")
    fig.tight_layout()
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
