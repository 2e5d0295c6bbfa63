"""Ledger and journal speed: per-event apply cost, encode cost, decode+apply rate, bytes/event.

Runs every measurement in two child processes, side by side: the pure-Python ledger (the
source tree) and the mypyc-compiled ledger that ``pip install kvcached`` builds (compiled here
into a temporary folder by ``scripts/build-compiled.sh``). Each figure is the median of
``--runs`` runs; each run times a batch of events through ``Ledger.apply`` (the live path) and
divides. The trace for decode and size is the synthetic serving workload of
``kvcached.testing.synth`` with allocator decisions derived under ``ledger``.

    python benchmarks/bench_ledger.py [--runs 7] [--events 200000] [--json]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_US = {"free_1": 1.0, "report_1": 1.0, "report": 1.0, "job_16": 3.0, "encode": 0.3}


def _per_event_us(make, apply_events, runs: int) -> float:
    samples = []
    for _ in range(runs):
        ledger, events = make()
        # vLLM's engine core freezes its start-up heap (gc.freeze) so that collections skip
        # it; the ledger's per-block tables are part of that heap, so they are frozen here too.
        gc.collect()
        gc.freeze()
        t0 = time.perf_counter()
        apply_events(ledger, events)
        samples.append((time.perf_counter() - t0) / len(events) * 1e6)
        gc.unfreeze()
    return statistics.median(samples)


def _run_of(k: int, i: int) -> tuple[int, ...]:
    return tuple(range(k * i, k * (i + 1)))


def child(runs: int, n_events: int) -> dict[str, object]:
    from kvcached.ledger import ledger as ledger_mod
    from kvcached.ledger.events import (
        BlockAlloc,
        BlockFree,
        Header,
        JobBuilt,
        JobKind,
        JobReported,
        PageMapped,
        PoolGeometry,
    )
    from kvcached.ledger.journal import JournalReader, JournalWriter, encode_batch
    from kvcached.ledger.simulate import derive
    from kvcached.testing import synth

    Ledger = ledger_mod.Ledger
    n = 20000
    geo = Header(page_bytes=2 << 20, pools=(PoolGeometry(block_bytes=synth.BLOCK_BYTES, num_blocks=400_000),))

    def mapped(*pre: object) -> Ledger:
        lg = Ledger(geo, "ledger")
        for p in range(lg.num_pages):
            lg.apply(PageMapped(p))
        for ev in pre:
            lg.apply(ev)  # type: ignore[arg-type]
        return lg

    def live(lg: Ledger, events: list[object]) -> None:
        apply = lg.apply
        for ev in events:
            apply(ev)  # type: ignore[arg-type]

    out: dict[str, object] = {"ledger_module": ledger_mod.__file__}
    out["free_1"] = _per_event_us(
        lambda: (mapped(BlockAlloc(0, tuple(range(n)))), [BlockFree(0, (b,)) for b in range(n)]), live, runs
    )
    out["free_8"] = _per_event_us(
        lambda: (
            mapped(BlockAlloc(0, tuple(range(8 * n)))),
            [BlockFree(0, tuple(range(8 * i, 8 * i + 8))) for i in range(n)],
        ),
        live,
        runs,
    )
    out["alloc_1"] = _per_event_us(lambda: (mapped(), [BlockAlloc(0, (b,)) for b in range(n)]), live, runs)

    # Jobs are built and reported in rounds of 64, as an engine keeps a bounded number of copies
    # in flight (tens, not tens of thousands, which would only measure the garbage collector
    # walking 20,000 outstanding jobs); the two kinds are timed apart.
    def in_flight(blocks_per_job: int) -> tuple[float, float]:
        built, reported = [], []
        for _ in range(runs):
            lg = mapped(BlockAlloc(0, tuple(range(blocks_per_job * n))))
            rounds = [
                (
                    [JobBuilt(i, JobKind.STORE, i % 256, (_run_of(blocks_per_job, i),), 1) for i in range(r, r + 64)],
                    [JobReported(i, 1) for i in range(r, r + 64)],
                )
                for r in range(0, n, 64)
            ]
            gc.collect()
            gc.freeze()
            tb = tr = 0.0
            apply = lg.apply
            for jobs, reports in rounds:
                t0 = time.perf_counter()
                for ev in jobs:
                    apply(ev)
                t1 = time.perf_counter()
                for ev in reports:
                    apply(ev)
                tr += time.perf_counter() - t1
                tb += t1 - t0
            gc.unfreeze()
            built.append(tb / n * 1e6)
            reported.append(tr / n * 1e6)
        return statistics.median(built), statistics.median(reported)

    out["job_16"], out["report"] = in_flight(16)
    # A decode step's store is one block: its report releases one page, not the 2-3 of a 16-block job.
    _, out["report_1"] = in_flight(1)

    # The realistic trace: inputs from the synthetic workload, decisions derived under ledger.
    h = synth.header()
    trace = list(derive(Ledger(h, "ledger"), itertools.islice(synth.workload(7), n_events)))
    batches = [trace[i : i + 256] for i in range(0, len(trace), 256)]
    enc = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for b in batches:
            encode_batch(b)
        enc.append((time.perf_counter() - t0) / len(trace) * 1e6)
    out["encode"] = statistics.median(enc)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.kvj")
        with JournalWriter.create(path, h) as w:
            for b in batches:
                w.append(b)
        out["bytes_per_event"] = os.path.getsize(path) / len(trace)
        rates = []
        for _ in range(runs):
            t0 = time.perf_counter()
            lg = Ledger(h, "ledger")
            with JournalReader(path) as r:
                lg.apply_all(r)
            rates.append(len(trace) / (time.perf_counter() - t0))
            assert lg.violations == [], lg.violations[:1]
        out["decode_apply_eps"] = statistics.median(rates)
    out["trace_events"] = len(trace)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.runs, args.events)))
        return 0
    from _builds import builds
    from _builds import child as run_child

    with tempfile.TemporaryDirectory() as tmp:
        results: dict[str, dict[str, object]] = {
            name: run_child(path, __file__, "--runs", str(args.runs), "--events", str(args.events), cwd=tmp)
            for name, path in builds(tmp).items()
        }
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    rows = [
        ("free_1", "apply BlockFree, 1 block (us)"),
        ("free_8", "apply BlockFree, 8 blocks (us)"),
        ("alloc_1", "apply BlockAlloc, 1 block (us)"),
        ("report_1", "apply JobReported, 1-block job (us)"),
        ("report", "apply JobReported, 16-block job (us)"),
        ("job_16", "apply JobBuilt, 16 blocks (us)"),
        ("encode", "journal encode per event (us)"),
        ("decode_apply_eps", "decode + apply (events/s)"),
        ("bytes_per_event", "journal bytes per event"),
    ]
    print(f"median of {args.runs} runs; trace: {results['pure']['trace_events']} events of the synthetic workload")
    print(f"{'':34} {'pure Python':>14} {'compiled':>14} {'budget':>10}")
    budget = dict(BUDGET_US, decode_apply_eps=">= 500000", bytes_per_event="<= 16")
    for key, label in rows:
        vals = [results[v][key] for v in ("pure", "compiled")]
        fmt = "{:>14,.0f}" if key == "decode_apply_eps" else "{:>14.3f}"
        b = budget.get(key, "")
        b = f"<= {b}" if isinstance(b, float) else b
        print(f"{label:34} " + " ".join(fmt.format(v) for v in vals) + f" {b:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
