"""Serving cost of kvcached: start-up time and per-request latency, kvcached against native vLLM.

Run with vLLM's CPU build (``.venv-cpu/bin/python benchmarks/bench_serve.py``). Both servers get
the same flags (the tiny llama of the tests, offloading on through the project's CPU spec, eager
mode) and the same prompts; kvcached runs with its defaults (ledger policy, 2 MiB pages, no
journal). Each round starts a native and a kvcached server one after the other (start-up: launch
to ``/health`` answering; which goes first alternates by round), then, with both up, sends the
prompts to them in turn, one request at a time, so that this machine's drift (up to 30% between
minutes) hits both alike. Per-request latency is the median over the prompts, greedy, after two
warm-up requests each; the ratios are of medians over all rounds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from kvcached.testing.tiny_model import build, corpus
from kvcached.vllm.testing.e2e import Server, ServerConfig

NAMES = ("native", "kvcached")


def prompts(n: int) -> list[tuple[str, int]]:
    return [(" ".join(corpus(30 + 5 * (i % 6), seed=500 + i))[:3000], 16) for i in range(n)]


def start(model: str, name: str, logs: Path, rnd: int) -> Server:
    cfg = ServerConfig(model=model, kvcached=name == "kvcached", kv_cache_bytes=128 << 20, cpu_offload_bytes=64 << 20)
    s = Server(cfg, logs / f"{name}-{rnd}.log").start()
    if not s.wait_ready(300):
        s.stop()
        raise SystemExit(f"{name} server did not start; see {s.log_path}")
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=24)
    args = ap.parse_args()
    startup: dict[str, list[float]] = {n: [] for n in NAMES}
    latency: dict[str, list[float]] = {n: [] for n in NAMES}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build(Path(tmp) / "model"))
        load = prompts(args.requests)
        for rnd in range(args.rounds):
            order = NAMES if rnd % 2 == 0 else NAMES[::-1]
            servers: dict[str, Server] = {}
            try:
                for name in order:
                    servers[name] = start(model, name, Path(tmp), rnd)
                    startup[name].append(servers[name].ready_after or 0.0)
                for p, n in load[:2]:
                    for name in order:
                        servers[name].complete(p, n)
                lat: dict[str, list[float]] = {n: [] for n in NAMES}
                for i, (p, n) in enumerate(load):
                    for name in order if i % 2 == 0 else order[::-1]:
                        c = servers[name].complete(p, n)
                        if not c.ok:
                            raise SystemExit(f"{name}: request failed with HTTP {c.status}")
                        lat[name].append(c.seconds)
            finally:
                for s in servers.values():
                    s.stop()
            for name in NAMES:
                latency[name] += lat[name]
                med = statistics.median(lat[name]) * 1e3
                print(f"round {rnd} {name:8}: ready after {startup[name][-1]:6.1f} s, median request {med:7.1f} ms")
    s_n, s_k = (statistics.median(startup[n]) for n in NAMES)
    r_n, r_k = (statistics.median(latency[n]) for n in NAMES)
    print(f"start-up   : native {s_n:6.1f} s, kvcached {s_k:6.1f} s, ratio {s_k / s_n:.3f} (budget 1.25)")
    print(f"per request: native {r_n * 1e3:6.1f} ms, kvcached {r_k * 1e3:6.1f} ms, ratio {r_k / r_n:.3f} (budget 1.10)")


if __name__ == "__main__":
    main()
