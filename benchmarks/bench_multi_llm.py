"""Several models sharing one machine's KV memory: one budget (kvcached) against static caches.

What users pick kvcached for (upstream reports 2-28x lower time to first token for three models
sharing a GPU under intermittent peaks than static partitions), measured here with CPU
offloading on, the combination this project makes safe. Two systems serve the same bursty load:

* **static**: N native ``vllm serve`` engines, each with an equal share of the KV memory as its
  own cache (``--kv-cache-memory-bytes total/N``), as one partitions a GPU today;
* **kvcached**: N ``ENABLE_KVCACHED=1`` engines naming one budget of the same total, each able to
  grow into all of it (its cache is sized at the total; the budget bounds the sum), with no
  prefix cache kept on pages (``KVCACHED_MAX_CACHED_TOKENS=0``) and no reserve, so that an
  engine whose requests end gives its pages back by itself, for the next burst elsewhere.

Both have the same tiny llama, flags and CPU tier (``--kv-transfer-config`` OffloadingConnector).
The load comes in phases: each model busy alone in turn (a burst of concurrent requests that
needs more KV than a static share holds), then two at once, then all. Each phase is run on one
system and then the other, the order alternating by round, so that the machine's drift hits
both alike; servers of both systems are up throughout, idle when not in the phase. Per request,
the time to first token (streamed), and per system TTFT mean and p99, output tokens per second
over the phases' wall time, vLLM's preemption counter (``vllm:num_preemptions_total``), and
how many greedy completions are identical in the two systems. A sampler reads the budget
every 0.1 s: it must never be over its size (the run fails if it is). Prints a markdown table and draws
``multi_llm.png`` (TTFT by phase, and the budget's engines over time).

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
CPU_TIER = 32 * MiB
MAX_MODEL_LEN = 1536  # vLLM wants one request of it to fit a cache, less its null block
BUDGET = "multi"
PAGE_MB = "0.25"  # a page of one block per layer: memory moves block by block
SYSTEMS = ("static", "kvcached")


@dataclass
class Result:
    system: str
    phase: str
    engine: str
    ttft: float
    seconds: float
    tokens: int
    text: str


@dataclass
class Budgeted:
    t: list[float] = field(default_factory=list)
    resident: list[dict[str, int]] = field(default_factory=list)  # kvcached engine -> worker's KV bytes
    over: int = 0  # the most bytes the budget was ever over its size (0: never)
    size: int = 0


class BudgetSampler(threading.Thread):
    """Every 0.1 s: the budget, under its lock (what engines hold: mapped pages and, during a
    scheduler call, the lease of what its count promised), and each kvcached worker's resident KV
    bytes (``kv_resident_bytes``: the memory itself)."""

    def __init__(self, directory: str, workers: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.directory, self.workers, self.seen, self.halt = directory, workers, Budgeted(), threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self.halt.wait(0.1):
            u = budget_usage(BUDGET, directory=self.directory)
            self.seen.t.append(time.monotonic() - self.t0)
            self.seen.resident.append({e: kv_resident_bytes(pid) for e, pid in self.workers.items()})
            self.seen.size = u.size or 0
            self.seen.over = max(self.seen.over, u.used - (u.size or u.used))


def prompts(phase: str, engine: str, n: int, rnd: int, output: int) -> list[tuple[str, int]]:
    """``n`` distinct prompts of about 450 to 650 tokens (2,900-4,200 characters) and ``output``
    tokens each: 5 to 6 blocks of 128 tokens at the end, held for as long as the request
    decodes, so that a static share of 15 usable blocks admits two or three at a time and the
    rest wait for their decode to end, where one engine of the budget admits them all."""
    seed = 10_000 * (rnd + 1) + 97 * sum(map(ord, phase + engine))
    out = []
    for i in range(n):
        chars = 2900 + (i * 433) % 1300
        out.append((" ".join(corpus(120, seed=seed + i))[:chars], output))
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


def preemptions(server: Server) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        total = 0.0
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:num_preemptions_total"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def start_all(model: str, engines: int, runtime: Path, logs: Path) -> dict[str, dict[str, Server]]:
    total = engines * SHARE
    servers: dict[str, dict[str, Server]] = {s: {} for s in SYSTEMS}
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    kv_env = dict(
        env,
        KVCACHED_BUDGET=BUDGET,
        KVCACHED_BUDGET_BYTES=str(total),
        KVCACHED_PAGE_SIZE_MB=PAGE_MB,
        KVCACHED_MIN_RESERVED_PAGES="0",
        KVCACHED_MAX_RESERVED_PAGES="0",
        KVCACHED_MAX_CACHED_TOKENS="0",
        KVCACHED_DUMP_DIR=str(logs),
    )
    for i in range(engines):
        name = "ABCDEFGH"[i]
        common = dict(model=model, cpu_offload_bytes=CPU_TIER, max_model_len=MAX_MODEL_LEN)
        static = ServerConfig(kvcached=False, env=env, kv_cache_bytes=SHARE, **common)  # type: ignore[arg-type]
        elastic = ServerConfig(kvcached=True, env=kv_env, kv_cache_bytes=total, **common)  # type: ignore[arg-type]
        servers["static"][name] = Server(static, logs / f"static-{name}.log")
        servers["kvcached"][name] = Server(elastic, logs / f"kvcached-{name}.log")
    everyone = [s for group in servers.values() for s in group.values()]
    try:
        for pair in range(0, len(everyone), 2):  # two at a time: six at once starve a 2-core machine
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
    system: str, group: dict[str, Server], busy: tuple[str, ...], per: int, rnd: int, output: int
) -> list[Result]:
    label = "+".join(busy)
    jobs = [(e, p, n) for e in busy for p, n in prompts(label, e, per, rnd, output)]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [(e, pool.submit(stream, group[e], p, n)) for e, p, n in jobs]
        out = []
        for e, f in futures:
            ttft, secs, toks, text = f.result()
            out.append(Result(system, label, e, ttft, secs, toks, text))
    return out


def wait_given_back(directory: str, floor: int, timeout: float) -> float:
    """Seconds until the budget's use is back to the idle engines' floor (nan: not in time)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if budget_usage(BUDGET, directory=directory).used <= floor:
            return time.monotonic() - t0
        time.sleep(0.1)
    return math.nan


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, math.ceil(0.99 * len(xs)) - 1)]


def report(results: list[Result], wall: dict[str, float], pre: dict[str, float]) -> list[str]:
    rows = [
        "| system | requests | TTFT mean (s) | TTFT p99 (s) | output tokens/s | preemptions |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for system in SYSTEMS:
        rs = [r for r in results if r.system == system]
        ttft = [r.ttft for r in rs]
        tps = sum(r.tokens for r in rs) / wall[system]
        rows.append(
            f"| {system} | {len(rs)} | {statistics.mean(ttft):.3f} | {p99(ttft):.3f} | {tps:.1f} | {pre[system]:.0f} |"
        )
    s = [r.ttft for r in results if r.system == "static"]
    k = [r.ttft for r in results if r.system == "kvcached"]
    rows.append(
        f"\nstatic / kvcached: TTFT mean {statistics.mean(s) / statistics.mean(k):.2f}x, p99 {p99(s) / p99(k):.2f}x"
    )
    by_phase = ["", "| phase | static TTFT mean / p99 (s) | kvcached TTFT mean / p99 (s) |", "| --- | ---: | ---: |"]
    for ph in dict.fromkeys(r.phase for r in results):
        cells = []
        for system in SYSTEMS:
            t = [r.ttft for r in results if r.system == system and r.phase == ph]
            cells.append(f"{statistics.mean(t):.3f} / {p99(t):.3f}")
        by_phase.append(f"| {ph} | {cells[0]} | {cells[1]} |")
    return rows + by_phase


def plot(results: list[Result], seen: Budgeted, marks: list[tuple[float, str]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    ph = list(dict.fromkeys(r.phase for r in results))
    width = 0.38
    for j, system in enumerate(SYSTEMS):
        means = [statistics.mean([r.ttft for r in results if r.system == system and r.phase == p]) for p in ph]
        tails = [p99([r.ttft for r in results if r.system == system and r.phase == p]) for p in ph]
        xs = [i + (j - 0.5) * width for i in range(len(ph))]
        ax1.bar(xs, tails, width, alpha=0.35, color=f"C{j}")
        ax1.bar(xs, means, width, label=f"{system} (mean; pale: p99)", color=f"C{j}")
    ax1.set_xticks(range(len(ph)), ph)
    ax1.set_xlabel("busy models (phase)")
    ax1.set_ylabel("time to first token (s)")
    ax1.legend(fontsize=8)
    ax1.set_title("TTFT: one shared budget vs equal static caches")
    for e in seen.resident[0] if seen.resident else ():
        ax2.plot(seen.t, [r[e] / MiB for r in seen.resident], linewidth=1, label=f"kvcached {e}: worker's resident KV")
    ax2.plot(seen.t, [sum(r.values()) / MiB for r in seen.resident], "k", linewidth=1.5, label="together")
    ax2.axhline(seen.size / MiB, color="k", linestyle="--", label="budget = static engines' caches together")
    for t, label in marks:
        ax2.axvline(t, color="lightgrey", linewidth=0.8)
        ax2.text(t, seen.size / MiB * 1.02, label, rotation=90, fontsize=7, va="bottom")
    ax2.set_ylim(0, seen.size / MiB * 1.35 if seen.size else 1)
    ax2.set_xlabel("seconds")
    ax2.set_ylabel("MiB")
    ax2.legend(fontsize=7, loc="upper right")
    ax2.set_title("kvcached: the budget moves to the busy model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=6, help="concurrent requests per busy model per phase")
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
        print(f"starting {args.engines} static and {args.engines} kvcached engines (vLLM CPU build)...", flush=True)
        servers = start_all(model, args.engines, runtime, out)
        directory = str(runtime / "kvcached")
        try:
            for group in servers.values():  # warm-up, unmeasured: the first batches of a server are slow
                for server in group.values():
                    for p, n in prompts("warm-up", "", 2, 0, 4):
                        stream(server, p, n)
            floor = budget_usage(BUDGET, directory=directory).used  # idle engines: their null blocks' pages
            workers = {e: s.worker_pid() for e, s in servers["kvcached"].items()}
            sampler = BudgetSampler(directory, workers)
            sampler.start()
            before = {s: sum(preemptions(v) for v in servers[s].values()) for s in SYSTEMS}
            results: list[Result] = []
            wall = dict.fromkeys(SYSTEMS, 0.0)
            marks: list[tuple[float, str]] = []
            back: list[float] = []
            k = 0
            for rnd in range(args.rounds):
                for busy in phases(args.engines, args.short):
                    order = SYSTEMS if k % 2 == 0 else SYSTEMS[::-1]
                    k += 1
                    for system in order:
                        if system == "kvcached":
                            marks.append((time.monotonic() - sampler.t0, "+".join(busy)))
                        t0 = time.perf_counter()
                        results += run_phase(system, servers[system], busy, args.requests, rnd, args.output)
                        wall[system] += time.perf_counter() - t0
                        if system == "kvcached":
                            back.append(wait_given_back(directory, floor, 30.0))
                    print(f"round {rnd} phase {'+'.join(busy)}: done", flush=True)
            sampler.halt.set()
            sampler.join()
            pre = {s: sum(preemptions(v) for v in servers[s].values()) - before[s] for s in SYSTEMS}
        finally:
            for group in servers.values():
                for s in group.values():
                    s.stop()
    same = sum(
        1
        for a, b in zip(
            (r for r in results if r.system == "static"), (r for r in results if r.system == "kvcached"), strict=True
        )
        if a.text == b.text
    )
    n = len(results) // 2
    lines = report(results, wall, pre)
    given = [b for b in back if not math.isnan(b)]
    lines += [
        "",
        f"identical completions in the two systems: {same} of {n} (their batches differ, and a bf16 rounding "
        "of another batch may flip a greedy token: the served tests compare kvcached and native on the same batches)",
        f"budget: {sampler.seen.size // MiB} MiB, most ever over its size: {sampler.seen.over} bytes",
        f"pages given back after a kvcached phase: {len(given)} of {len(back)} phases within 30 s"
        + (f" (median {statistics.median(given):.1f} s)" if given else ""),
    ]
    text = "\n".join(lines)
    print(text)
    (out / "multi_llm.md").write_text(text + "\n")
    if plot(results, sampler.seen, marks, out / "multi_llm.png"):
        print(f"plot: {out / 'multi_llm.png'}")
    if sampler.seen.over > 0:
        raise SystemExit("bench_multi_llm: the budget was exceeded (see above)")


if __name__ == "__main__":
    main()
