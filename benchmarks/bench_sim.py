"""kvsim campaign figures: seeds per minute, coverage, and how often each variant fails each check.

Runs ``kvsim``'s seeds (draw, then every variant: ledger, legacy, never-unmap, vllm) and prints
what docs/kvsim.md reports: seeds per minute (wall clock, all variants of a seed counted as one
seed), the campaign's coverage (preemptions, aborts with jobs in flight, prefix-cache resets,
memory-limit shrinks, stores, loads, bytes compared), per variant the seeds that failed and the
count per check, and legacy's failure rate per check (a check legacy never trips is suspect).

    .venv-vllm/bin/python benchmarks/bench_sim.py --seeds 1-1000 --jobs 2 [--json]

The seeds are the same on every machine; only the rate depends on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
if os.environ.get("PYTHONHASHSEED") != "0":  # a seed repeats exactly only with the hash seed pinned
    os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, PYTHONHASHSEED="0"))

from kvsim.cli import VARIANTS, _run_seed, parse_seeds
from kvsim.on_vllm.result import CHECKS, Coverage, SeedResult


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=parse_seeds, default=parse_seeds("1-1000"))
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    seeds: list[int] = args.seeds
    t0 = time.perf_counter()
    results: list[list[SeedResult]] = []
    if args.jobs <= 1:
        results = [_run_seed(s, VARIANTS) for s in seeds]
    else:
        with ProcessPoolExecutor(args.jobs) as ex:
            results = list(ex.map(_run_seed, seeds, [VARIANTS] * len(seeds), chunksize=4))
    wall = time.perf_counter() - t0
    cov = Coverage()
    for rs in results:
        cov = cov + rs[0].coverage  # the ledger variant's run: the shipped one
    failed: dict[str, int] = dict.fromkeys(VARIANTS, 0)
    per: dict[str, dict[str, int]] = {v: dict.fromkeys(CHECKS, 0) for v in VARIANTS}
    shipped: list[str] = []
    for rs in results:
        for r in rs:
            failed[r.variant] += not r.ok
            for c in r.checks():
                per[r.variant][c] += 1
            if r.variant == "ledger" and not r.ok:
                shipped.append(f"seed {r.seed}: {', '.join(f.line() for f in r.failures)}"[:300])
    n = len(seeds)
    out: dict[str, Any] = {
        "seeds": n,
        "wall_s": round(wall, 1),
        "seeds_per_minute": round(60 * n / wall, 1),
        "jobs": args.jobs,
        "coverage": {f: getattr(cov, f) for f in cov.__struct_fields__},
        "failed_seeds": failed,
        "fails_per_check": per,
        "legacy_rate_per_check": {c: round(per["legacy"][c] / n, 4) for c in CHECKS},
        "ledger_failures": shipped,
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"{n} seeds x {len(VARIANTS)} variants in {wall:.0f} s with {args.jobs} process(es): "
        f"{out['seeds_per_minute']} seeds/minute"
    )
    print("coverage (ledger variant): " + ", ".join(f"{k} {v:,}" for k, v in out["coverage"].items()))
    for v in VARIANTS:
        checks = ", ".join(f"{c} {k}" for c, k in per[v].items() if k) or "none"
        print(f"  {v:11}: {failed[v]:4} of {n} seeds failed ({100 * failed[v] / n:.1f}%); {checks}")
    never = [c for c in CHECKS if not per["legacy"][c]]
    print(f"  legacy never tripped: {', '.join(never) or 'none'}")
    for line in shipped:
        print(f"  ledger: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
