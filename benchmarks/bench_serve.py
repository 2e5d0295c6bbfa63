"""Serving cost of kvcached: start-up time and per-request latency, kvcached against native vLLM.

Run with vLLM's CPU build (``.venv-cpu/bin/python benchmarks/bench_serve.py``). Both servers get
the same flags (the tiny llama of the tests, offloading on through the project's CPU spec, eager
mode) and the same prompts; kvcached runs with its defaults (ledger policy, 2 MiB pages, no
journal). Servers are started alternately, ``--rounds`` times each, so that drift on this machine
hits both alike. Start-up is the time from launch to ``/health`` answering; per-request latency
is the median over the prompts (after two warm-up requests), each sent alone, greedy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from kvcached.serve.e2e import Server, ServerConfig
from kvcached.serve.tiny_model import build, corpus


def prompts(n: int) -> list[tuple[str, int]]:
    return [(" ".join(corpus(30 + 5 * (i % 6), seed=500 + i))[:3000], 16) for i in range(n)]


def one(model: str, kvcached: bool, logs: Path, rnd: int, load: list[tuple[str, int]]) -> tuple[float, list[float]]:
    name = "kvcached" if kvcached else "native"
    cfg = ServerConfig(model=model, kvcached=kvcached, kv_cache_bytes=128 << 20, cpu_offload_bytes=64 << 20)
    with Server(cfg, logs / f"{name}-{rnd}.log") as s:
        if not s.wait_ready(300):
            raise SystemExit(f"{name} server did not start; see {s.log_path}")
        assert s.ready_after is not None
        for p, n in load[:2]:
            s.complete(p, n)
        lat = []
        for p, n in load:
            c = s.complete(p, n)
            if not c.ok:
                raise SystemExit(f"{name}: request failed with HTTP {c.status}")
            lat.append(c.seconds)
        return s.ready_after, lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=24)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build(Path(tmp) / "model"))
        load = prompts(args.requests)
        start: dict[str, list[float]] = {"native": [], "kvcached": []}
        per_req: dict[str, list[float]] = {"native": [], "kvcached": []}
        for rnd in range(args.rounds):
            for kv in (False, True):
                name = "kvcached" if kv else "native"
                t, lat = one(model, kv, Path(tmp), rnd, load)
                start[name].append(t)
                per_req[name].append(statistics.median(lat))
                med = statistics.median(lat) * 1e3
                print(f"round {rnd} {name:8}: ready after {t:6.1f} s, median request {med:7.1f} ms")
    s_n, s_k = statistics.median(start["native"]), statistics.median(start["kvcached"])
    r_n, r_k = statistics.median(per_req["native"]), statistics.median(per_req["kvcached"])
    print(f"start-up  : native {s_n:6.1f} s, kvcached {s_k:6.1f} s, ratio {s_k / s_n:.3f} (budget 1.25)")
    print(f"per request: native {r_n * 1e3:6.1f} ms, kvcached {r_k * 1e3:6.1f} ms, ratio {r_k / r_n:.3f} (budget 1.10)")


if __name__ == "__main__":
    main()
