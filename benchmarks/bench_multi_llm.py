"""Several models sharing one machine's KV memory, four arms side by side in one run.

Upstream kvcached's headline for several models on one GPU with CPU offloading
(``benchmarks/bench_offload_vs_kvcached/RESULTS.md``: two Qwen3-4B on an A100-40G, staggered
bursts) compares static partitions, static + vLLM's native CPU offloading and kvcached; no arm
there combines kvcached with offloading, which is what this project makes safe. Here, with the
same tiny llama and flags in every arm:

* **static**: N native ``vllm serve`` engines, each with an equal share of the KV memory as its
  own cache (``--kv-cache-memory-bytes total/N``), as one partitions a GPU today;
* **static+offload**: the same, each with vLLM's OffloadingConnector and a CPU tier;
* **kvcached**: N ``ENABLE_KVCACHED=1`` engines naming one budget of the same total, each able to
  grow into all of it (its cache is sized at the total; the budget bounds the sum), at kvcached's
  default reserve and prefix-cache cap (an engine short of the budget makes the idle ones give
  back: ``kvcached.budget.Budget.ask``), pages of one block per layer for the tiny model;
* **kvcached+offload**: the same on a budget of its own, with the CPU tier.

The load is upstream's shape scaled down: staggered bursts, each model busy alone in turn, then
two at once, then all; in each burst every conversation of a busy model takes its next turn at
once (its history, four blocks of 128 tokens, then the turn's own text), so that a history
evicted from the GPU since the model's last burst is recomputed, or restored from the CPU tier
where there is one. Each phase runs
on every arm, the order rotating by phase, so that the machine's drift hits all alike; every
arm's servers are up throughout, idle when not in the phase. Per request the time to first token
(streamed); per arm and per phase TTFT mean / p50 / p99 (with fewer than 100 requests the p99 is
the largest: the table says so), output tokens per second over the phases' wall time, vLLM's
preemption counter, CPU-tier hits (``vllm:external_prefix_cache_hits``, tokens) and bytes moved
(``vllm:kv_offload_load_bytes`` and ``..._store_bytes``). A sampler reads both budgets every
0.1 s: neither may ever be over its size (the run fails if one is). Prints markdown tables and
draws ``multi_llm.png`` (TTFT by phase and arm, and the kvcached+offload workers' KV over time).

    .venv-cpu/bin/python benchmarks/bench_multi_llm.py [--engines 3] [--rounds 2] [--out DIR]
    .venv-cpu/bin/python benchmarks/bench_multi_llm.py --short   # 2 engines, 1 round (the main job's)
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvcached.budget import budget_usage
from kvcached.testing.tiny_model import build, corpus
from kvcached.vllm.testing.e2e import Server, ServerConfig, kv_resident_bytes

MiB = 1 << 20
SHARE = 32 * MiB  # one static engine's cache: 16 blocks of 128 tokens (2 MiB each over 8 layers)
CPU_TIER = 64 * MiB  # 32 blocks: the histories of every conversation of an engine
MAX_MODEL_LEN = 1536  # vLLM wants one request of it to fit a cache, less its null block
PAGE_MB = "0.25"  # a page of one block per layer: the tiny model's memory moves block by block
HISTORY_CHARS = 3300  # a conversation's history: about 500 tokens, four blocks


@dataclass(frozen=True)
class Arm:
    name: str
    kvcached: bool
    offload: bool

    @property
    def budget(self) -> str:
        return f"multi-{'off' if self.offload else 'gpu'}"


ARMS = (
    Arm("static", False, False),
    Arm("static+offload", False, True),
    Arm("kvcached", True, False),
    Arm("kvcached+offload", True, True),
)
HEADLINE = ("static+offload", "kvcached+offload")  # upstream's comparison, with our combination


@dataclass
class Result:
    arm: str
    phase: str
    engine: str
    ttft: float
    seconds: float
    tokens: int
    text: str


@dataclass
class Budgeted:
    t: list[float] = field(default_factory=list)
    resident: list[dict[str, int]] = field(default_factory=list)  # kvcached+offload engine -> worker's KV bytes
    over: dict[str, int] = field(default_factory=dict)  # budget -> the most bytes it was ever over its size
    size: int = 0


class BudgetSampler(threading.Thread):
    """Every 0.1 s: each budget, under its lock (what engines hold: mapped pages and, during a
    scheduler call, the lease of what its count promised), and each kvcached+offload worker's
    resident KV bytes (``kv_resident_bytes``: the memory itself)."""

    def __init__(self, directory: str, workers: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.directory, self.workers, self.seen, self.halt = directory, workers, Budgeted(), threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        budgets = sorted({a.budget for a in ARMS if a.kvcached})
        while not self.halt.wait(0.1):
            self.seen.t.append(time.monotonic() - self.t0)
            self.seen.resident.append({e: kv_resident_bytes(pid) for e, pid in self.workers.items()})
            for name in budgets:
                u = budget_usage(name, directory=self.directory)
                self.seen.size = u.size or 0
                self.seen.over[name] = max(self.seen.over.get(name, 0), u.used - (u.size or u.used))


def prompts(engine: str, n: int, turn: int, output: int) -> list[tuple[str, int]]:
    """The next turn of each of the engine's ``n`` conversations, ``output`` tokens each: the
    conversation's history (about 500 tokens, four blocks of 128, the same at every turn, as
    upstream's 2,048-token prefix) and 60 to 120 tokens new to this turn, so that a request
    holds five to six blocks while it decodes. A static share of 15 usable blocks admits two or
    three at a time and keeps the histories of about three conversations: a later turn finds
    the others' evicted, to be recomputed, or restored from the CPU tier where there is one."""
    out = []
    for i in range(n):
        key = 1_000 * sum(map(ord, engine)) + i
        history = " ".join(corpus(120, seed=key))[:HISTORY_CHARS]
        new = " ".join(corpus(40, seed=key * 100 + turn + 1))[: 400 + (i * 137) % 400]
        out.append((history + " " + new, output))
    return out


def stream(server: Server, prompt: str, max_tokens: int) -> tuple[float, float, int, str]:
    """(time to first token, total seconds, output tokens, text) of one streamed completion."""
    body = json.dumps(
        {
            "model": server.config.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise SystemExit(f"bench_multi_llm: HTTP {resp.status} from {server.url}: {resp.read()[:200]!r}")
        first, n, text = None, 0, []
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            piece = json.loads(line[6:])["choices"][0].get("text", "")
            if first is None:
                first = time.perf_counter() - t0
            n += 1
            text.append(piece)
    finally:
        conn.close()
    return first or math.nan, time.perf_counter() - t0, n, "".join(text)


# vLLM's counters this reads, summed over engines and labels (a counter's ``_total`` included).
COUNTERS = {
    "preemptions": "vllm:num_preemptions",
    "cpu_hit_tokens": "vllm:external_prefix_cache_hits",
    "loaded_bytes": "vllm:kv_offload_load_bytes",
    "stored_bytes": "vllm:kv_offload_store_bytes",
}


def counters(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        lines = r.read().decode().splitlines()
    out = dict.fromkeys(COUNTERS, 0.0)
    for key, name in COUNTERS.items():
        for line in lines:
            head = line.split("{", 1)[0].split(" ", 1)[0]
            if head in (name, name + "_total"):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def start_all(model: str, engines: int, runtime: Path, logs: Path) -> dict[str, dict[str, Server]]:
    total = engines * SHARE
    servers: dict[str, dict[str, Server]] = {a.name: {} for a in ARMS}
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    for i in range(engines):
        name = "ABCDEFGH"[i]
        for arm in ARMS:
            common = dict(model=model, max_model_len=MAX_MODEL_LEN, cpu_offload_bytes=CPU_TIER if arm.offload else None)
            if arm.kvcached:
                kv_env = dict(
                    env,
                    KVCACHED_BUDGET=arm.budget,
                    KVCACHED_BUDGET_BYTES=str(total),
                    KVCACHED_PAGE_SIZE_MB=PAGE_MB,
                    KVCACHED_DUMP_DIR=str(logs),
                )
                cfg = ServerConfig(kvcached=True, env=kv_env, kv_cache_bytes=total, **common)  # type: ignore[arg-type]
            else:
                cfg = ServerConfig(kvcached=False, env=env, kv_cache_bytes=SHARE, **common)  # type: ignore[arg-type]
            servers[arm.name][name] = Server(cfg, logs / f"{arm.name.replace('+', '-')}-{name}.log")
    everyone = [s for group in servers.values() for s in group.values()]
    try:
        for pair in range(0, len(everyone), 2):  # two at a time: more at once starve a 2-core machine
            batch = everyone[pair : pair + 2]
            for s in batch:
                s.start()
            for s in batch:
                if not s.wait_ready(900):
                    raise SystemExit(f"bench_multi_llm: a server did not start; see {s.log_path}")
    except BaseException:
        for s in everyone:
            s.stop()
        raise
    return servers


def phases(engines: int, short: bool) -> list[tuple[str, ...]]:
    names = tuple("ABCDEFGH"[:engines])
    alone = [(n,) for n in names]
    if short:
        return [*alone, names]
    pairs = [(names[i], names[(i + 1) % engines]) for i in range(engines)] if engines > 2 else []
    return [*alone, *pairs, names]


def run_phase(
    arm: str, group: dict[str, Server], busy: tuple[str, ...], per: int, turns: dict[str, int], output: int
) -> list[Result]:
    """One burst: the next turn of every conversation of each busy engine, all at once."""
    label = "+".join(busy)
    jobs = [(e, p, n) for e in busy for p, n in prompts(e, per, turns[e], output)]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [(e, pool.submit(stream, group[e], p, n)) for e, p, n in jobs]
        out = []
        for e, f in futures:
            ttft, secs, toks, text = f.result()
            out.append(Result(arm, label, e, ttft, secs, toks, text))
    return out


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]


def _stats(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.2f} / {statistics.median(xs):.2f} / {p99(xs):.2f}"


def report(results: list[Result], wall: dict[str, float], moved: dict[str, dict[str, float]]) -> list[str]:
    n = min(len([r for r in results if r.arm == a.name]) for a in ARMS)
    tail = "p99" if n >= 100 else "max"  # with fewer than 100 requests a p99 is the largest
    rows = [
        f"| arm | requests | TTFT mean / p50 / {tail} (s) | output tokens/s | preemptions | CPU-tier hits (tokens) "
        "| loaded / stored (MiB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for arm in ARMS:
        rs = [r for r in results if r.arm == arm.name]
        tps = sum(r.tokens for r in rs) / wall[arm.name]
        m = moved[arm.name]
        rows.append(
            f"| {arm.name} | {len(rs)} | {_stats([r.ttft for r in rs])} | {tps:.1f} | {m['preemptions']:.0f} "
            f"| {m['cpu_hit_tokens']:.0f} | {m['loaded_bytes'] / MiB:.0f} / {m['stored_bytes'] / MiB:.0f} |"
        )
    base, ours = ([r.ttft for r in results if r.arm == name] for name in HEADLINE)
    rows.append(
        f"\n{HEADLINE[1]} against {HEADLINE[0]}: TTFT mean {statistics.mean(base) / statistics.mean(ours):.2f}x, "
        f"{tail} {p99(base) / p99(ours):.2f}x lower; p50 {statistics.median(ours):.2f} s against "
        f"{statistics.median(base):.2f} s"
    )
    phases_seen = list(dict.fromkeys(r.phase for r in results))
    per_phase = min(len([r for r in results if r.arm == a.name and r.phase == ph]) for a in ARMS for ph in phases_seen)
    tail = "p99" if per_phase >= 100 else "max"
    by_phase = [
        "",
        f"TTFT mean / p50 / {tail} (s) by phase (busy models):",
        "",
        "| phase | " + " | ".join(a.name for a in ARMS) + " |",
        "| --- |" + " ---: |" * len(ARMS),
    ]
    for ph in phases_seen:
        cells = [_stats([r.ttft for r in results if r.arm == a.name and r.phase == ph]) for a in ARMS]
        by_phase.append(f"| {ph} | " + " | ".join(cells) + " |")
    return rows + by_phase


def plot(results: list[Result], seen: Budgeted, marks: list[tuple[float, str]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.4))
    ph = list(dict.fromkeys(r.phase for r in results))
    width = 0.8 / len(ARMS)
    for j, arm in enumerate(ARMS):
        means = [statistics.mean([r.ttft for r in results if r.arm == arm.name and r.phase == p]) for p in ph]
        tails = [p99([r.ttft for r in results if r.arm == arm.name and r.phase == p]) for p in ph]
        xs = [i + (j - (len(ARMS) - 1) / 2) * width for i in range(len(ph))]
        ax1.bar(xs, tails, width, alpha=0.35, color=f"C{j}")
        ax1.bar(xs, means, width, label=f"{arm.name} (mean; pale: tail)", color=f"C{j}")
    ax1.set_xticks(range(len(ph)), ph)
    ax1.set_xlabel("busy models (phase)")
    ax1.set_ylabel("time to first token (s)")
    ax1.legend(fontsize=7)
    ax1.set_title("TTFT: four arms on the same bursts")
    for e in seen.resident[0] if seen.resident else ():
        ax2.plot(seen.t, [r[e] / MiB for r in seen.resident], linewidth=1, label=f"kvcached+offload {e}: worker's KV")
    ax2.plot(seen.t, [sum(r.values()) / MiB for r in seen.resident], "k", linewidth=1.5, label="together")
    ax2.axhline(seen.size / MiB, color="k", linestyle="--", label="budget = static engines' caches together")
    for t, label in marks:
        ax2.axvline(t, color="lightgrey", linewidth=0.8)
        ax2.text(t, seen.size / MiB * 1.02, label, rotation=90, fontsize=7, va="bottom")
    ax2.set_ylim(0, seen.size / MiB * 1.35 if seen.size else 1)
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("MiB")
    ax2.legend(fontsize=7, loc="upper right")
    ax2.set_title("kvcached+offload: the budget moves to the busy model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=6, help="conversations per model: one request each per phase")
    ap.add_argument("--output", type=int, default=128, help="output tokens per request")
    ap.add_argument("--short", action="store_true", help="2 engines, 1 round, phases A, B, A+B (the main job's)")
    ap.add_argument("--out", default="bench_out", help="where the logs, the table and the plot go")
    args = ap.parse_args()
    if args.short:
        args.engines, args.rounds = 2, 1
    if not 2 <= args.engines <= 8:
        raise SystemExit("bench_multi_llm: --engines must be 2 to 8")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="multi-llm-") as tmp:
        runtime = Path(tmp) / "run"
        runtime.mkdir(mode=0o700)
        model = str(build(Path(tmp) / "model"))
        print(f"starting {args.engines} engines in each of {len(ARMS)} arms (vLLM CPU build)...", flush=True)
        servers = start_all(model, args.engines, runtime, out)
        directory = str(runtime / "kvcached")
        try:
            for group in servers.values():  # warm-up, unmeasured: the first batches of a server are slow
                for server in group.values():
                    for p, n in prompts("warm-up", 2, 0, 4):
                        stream(server, p, n)
            workers = {e: s.worker_pid() for e, s in servers["kvcached+offload"].items()}
            sampler = BudgetSampler(directory, workers)
            sampler.start()
            before = {a.name: [counters(v) for v in servers[a.name].values()] for a in ARMS}
            results: list[Result] = []
            wall = dict.fromkeys((a.name for a in ARMS), 0.0)
            marks: list[tuple[float, str]] = []
            turns = dict.fromkeys("ABCDEFGH", 0)  # each engine's conversations: turns taken so far
            k = 0
            for rnd in range(args.rounds):
                for busy in phases(args.engines, args.short):
                    order = ARMS[k % len(ARMS) :] + ARMS[: k % len(ARMS)]  # rotating: no arm always first
                    k += 1
                    for arm in order:
                        if arm.name == "kvcached+offload":
                            marks.append((time.monotonic() - sampler.t0, "+".join(busy)))
                        t0 = time.perf_counter()
                        results += run_phase(arm.name, servers[arm.name], busy, args.requests, turns, args.output)
                        wall[arm.name] += time.perf_counter() - t0
                    for e in busy:
                        turns[e] += 1
                    print(f"round {rnd} phase {'+'.join(busy)}: done", flush=True)
            sampler.halt.set()
            sampler.join()
            moved = {}
            for a in ARMS:
                after = [counters(v) for v in servers[a.name].values()]
                moved[a.name] = {
                    key: sum(x[key] - y[key] for x, y in zip(after, before[a.name], strict=True)) for key in COUNTERS
                }
        finally:
            for group in servers.values():
                for s in group.values():
                    s.stop()
    lines = report(results, wall, moved)
    static = [r.text for r in results if r.arm == "static"]
    same = {
        a.name: sum(x == r.text for x, r in zip(static, [r for r in results if r.arm == a.name], strict=True))
        for a in ARMS[1:]
    }
    over = ", ".join(f"{name} {b} bytes" for name, b in sorted(sampler.seen.over.items()))
    lines += [
        "",
        "greedy completions identical to static's: "
        + ", ".join(f"{name} {n} of {len(static)}" for name, n in same.items())
        + " (their batches differ, and a bf16 rounding of another batch may flip a greedy token: the served "
        "tests compare kvcached and native on the same batches)",
        f"budgets: {sampler.seen.size // MiB} MiB each; the most either was ever over its size: {over}",
    ]
    text = "\n".join(lines)
    print(text)
    (out / "multi_llm.md").write_text(text + "\n")
    if plot(results, sampler.seen, marks, out / "multi_llm.png"):
        print(f"plot: {out / 'multi_llm.png'}")
    if any(b > 0 for b in sampler.seen.over.values()):
        raise SystemExit("bench_multi_llm: a budget was exceeded (see above)")


if __name__ == "__main__":
    main()
