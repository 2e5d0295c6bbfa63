"""Ledger service speed: the producer's hand-off, sustained journaling, and ``kvctl pins`` latency.

Runs every measurement in child processes, pure-Python ledger and mypyc-compiled ledger side by
side (as ``benchmarks/bench_ledger.py`` does; ``--pure-only`` skips the 20 s compile), and prints
medians of ``--runs`` runs. The events are the synthetic serving workload with the allocator's
decisions derived under ``ledger`` (``kvcached.testing.synth``).

* hand-off: ns per ``Producer.put`` on the producing thread while the service's writer runs on
  its own thread (journal with ``interval`` durability, replica on), timed put by put with
  ``perf_counter_ns`` (its own cost, reported as ``timer``, is included). Two producers: one paced
  like a scheduler (256 events, then 1 ms away), one flat out (the worst case for the GIL).
* journaling: events/s through the service with ``interval`` durability. ``drain``: the service
  alone, from a full hand-off to a closed journal. ``at 300k/s``: a producer on another thread
  offering 300 events every millisecond (300,000 events/s, default hand-off of 65,536), from the
  first put until the journal is closed; the events it had to drop are reported (a flat-out
  producer would measure the GIL's 5 ms switch interval, not the service). Both with the
  replica (one more ``Ledger.apply`` per event) and without.
* pins: from another process (as kvctl), the round trip of a ``pins`` request against a replica
  with 10,000 pinned pages (a job pin each) that an event every 2 ms keeps changing, decoded;
  ``kvctl pins`` rendered as plain text, request included; and the whole ``kvctl pins``
  command, interpreter start-up included.

    python benchmarks/bench_service.py [--runs 5] [--events 300000] [--pure-only] [--json]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"handoff_median_ns": "<= 1000", "handoff_p999_ns": "<= 20000", "eps": ">= 300000", "pins_ms": "< 50"}


def _pct(samples: list[int], q: float) -> float:
    samples = sorted(samples)
    return float(samples[min(len(samples) - 1, int(q * len(samples)))])


_PINS_CLIENT = """
import io, json, sys, time
from kvcached.service import kvctl, live, messages
sock, n = sys.argv[1], int(sys.argv[2])
trips, cli = [], []
for _ in range(n):
    t0 = time.perf_counter()
    reply = live.request(sock, messages.Request(op="pins"))
    trips.append(time.perf_counter() - t0)
    assert len(reply.rows) == 10_000
    t0 = time.perf_counter()
    kvctl.main(["--socket", sock, "pins"], out=io.StringIO())
    cli.append(time.perf_counter() - t0)
print(json.dumps({"trips": trips, "cli": cli}))
"""


def child(runs: int, n_events: int) -> dict[str, Any]:
    import anyio

    from kvcached.ledger import ledger as ledger_mod
    from kvcached.ledger.events import BlockAlloc, JobBuilt, JobKind, PageMapped, PrefixCacheReset, RequestAdded
    from kvcached.ledger.ledger import Ledger
    from kvcached.ledger.simulate import derive
    from kvcached.service.ledger_service import BackgroundService, Durability, LedgerService, ServiceConfig
    from kvcached.testing import synth

    h = synth.header()
    trace = list(derive(Ledger(h), itertools.islice(synth.workload(7), n_events)))
    out: dict[str, Any] = {"ledger_module": ledger_mod.__file__, "events": len(trace)}
    tmp = tempfile.mkdtemp(prefix="bench_service-")

    def journal(run: int) -> str:
        return os.path.join(tmp, f"j{run}.kvj")

    # --- hand-off -------------------------------------------------------------------------
    ns = time.perf_counter_ns
    timer = []
    for _ in range(100_000):
        t0 = ns()
        timer.append(ns() - t0)
    out["timer_ns"] = statistics.median(timer)
    for mode in ("paced", "flat out"):
        med, p99, p999, p9999, worst, drops = [], [], [], [], [], []
        for run in range(runs):
            cfg = ServiceConfig(journal=journal(run), durability=Durability.INTERVAL, snapshot_every=0)
            with BackgroundService.start(h, cfg) as bg:
                put = bg.producer.put
                samples = [0] * len(trace)
                gc.collect()
                gc.freeze()  # as vLLM's engine does after start-up
                for i, ev in enumerate(trace):
                    t0 = ns()
                    put(ev)
                    samples[i] = ns() - t0
                    if mode == "paced" and i % 256 == 255:
                        time.sleep(0.001)
                gc.unfreeze()
            drops.append(bg.producer.dropped)
            med.append(_pct(samples, 0.5))
            p99.append(_pct(samples, 0.99))
            p999.append(_pct(samples, 0.999))
            p9999.append(_pct(samples, 0.9999))
            worst.append(max(samples))
        out[f"handoff {mode}"] = {
            "median_ns": statistics.median(med),
            "p99_ns": statistics.median(p99),
            "p999_ns": statistics.median(p999),
            "p9999_ns": statistics.median(p9999),
            "max_ns": statistics.median(worst),
            "dropped": statistics.median(drops),
        }

    # --- journaling -----------------------------------------------------------------------
    for replica in (True, False):
        drain, e2e, e2e_drops = [], [], []
        for run in range(runs):
            cfg = ServiceConfig(
                journal=journal(run),
                durability=Durability.INTERVAL,
                replica=replica,
                snapshot_every=0,
                capacity=len(trace) + 1,
            )
            svc = LedgerService(h, cfg)
            for ev in trace:
                svc.producer.put(ev)

            async def run_svc(svc: LedgerService = svc) -> None:
                svc.stop()
                await svc.run()

            s0 = time.perf_counter()
            anyio.run(run_svc)
            drain.append(len(trace) / (time.perf_counter() - s0))
            assert svc.journal_status().events_written == len(trace)

            cfg = ServiceConfig(journal=journal(run), durability=Durability.INTERVAL, replica=replica, snapshot_every=0)
            bg = BackgroundService.start(h, cfg)
            put = bg.producer.put
            s0 = time.perf_counter()
            for tick, start in enumerate(range(0, len(trace), 300)):
                for ev in trace[start : start + 300]:
                    put(ev)
                ahead = s0 + (tick + 1) * 0.001 - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
            bg.close()
            written = bg.service.journal_status().events_written
            e2e.append((written - bg.producer.gaps) / (time.perf_counter() - s0))
            e2e_drops.append(bg.producer.dropped)
        key = "replica" if replica else "no replica"
        out[f"journal {key}"] = {
            "drain_eps": statistics.median(drain),
            "e2e_eps": statistics.median(e2e),
            "e2e_dropped": statistics.median(e2e_drops),
        }

    # --- pins -----------------------------------------------------------------------------
    pinned = synth.header(num_blocks=100_000)  # 10 blocks per page: 10,000 pages
    lg = Ledger(pinned)
    bpp = pinned.page_bytes // pinned.pools[0].block_bytes
    for p in range(lg.num_pages):
        lg.apply(PageMapped(p))
    for p in range(lg.num_pages):
        blocks = tuple(range(p * bpp, p * bpp + bpp))
        lg.apply(RequestAdded(p, f"cmpl-{p:08x}-0123456789abcdef"))
        lg.apply(BlockAlloc(0, blocks))
        lg.apply(JobBuilt(p, JobKind.STORE, p, (blocks,), 2))
    assert lg.pinned_pages == 10_000
    sock = os.path.join(tmp, "run", "ledger.sock")
    with BackgroundService.start(pinned, ServiceConfig(socket=sock, snapshot_every=0), start=lg.snapshot()) as bg:
        # A running engine: an event every 2 ms, so that no answer comes from the pins cache.
        stop = threading.Event()

        def engine() -> None:
            while not stop.wait(0.002):
                bg.producer.put(PrefixCacheReset())

        ticker = threading.Thread(target=engine)
        ticker.start()
        # The client is another process, as kvctl is: in this one it would share the server's GIL.
        n = max(runs, 5) * 2
        proc = subprocess.run(
            [sys.executable, "-P", "-c", _PINS_CLIENT, sock, str(n)], check=True, capture_output=True, text=True
        )
        timed = json.loads(proc.stdout)
        whole = []
        for _ in range(3):
            s0 = time.perf_counter()
            subprocess.run(
                [sys.executable, "-P", "-m", "kvctl.cli", "--socket", sock, "pins"],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            whole.append(time.perf_counter() - s0)
        stop.set()
        ticker.join()
        out["pins"] = {
            "round_trip_ms": statistics.median(timed["trips"]) * 1e3,
            "round_trip_max_ms": max(timed["trips"]) * 1e3,
            "kvctl_ms": statistics.median(timed["cli"]) * 1e3,
            "kvctl_process_ms": statistics.median(whole) * 1e3,
        }

    shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--events", type=int, default=300_000)
    ap.add_argument("--pure-only", action="store_true", help="skip the compiled ledger (no mypyc build)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.runs, args.events)))
        return 0
    from _builds import builds
    from _builds import child as run_child

    with tempfile.TemporaryDirectory() as tmp:
        results: dict[str, dict[str, Any]] = {
            name: run_child(path, __file__, "--runs", str(args.runs), "--events", str(args.events), cwd=tmp)
            for name, path in builds(tmp, compiled=not args.pure_only).items()
        }
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    names = list(results)
    first = results[names[0]]
    print(
        f"median of {args.runs} runs; {first['events']} events of the synthetic workload; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; timer {first['timer_ns']:.0f} ns (included)"
    )
    print(f"{'':44}" + "".join(f"{n:>14}" for n in names) + f"{'target':>12}")

    def row(label: str, get: Any, fmt: str, target: str = "") -> None:
        print(f"{label:44}" + "".join(format(get(results[n]), fmt).rjust(14) for n in names) + f"{target:>12}")

    for mode in ("paced", "flat out"):
        k = f"handoff {mode}"
        row(f"hand-off, {mode}: median (ns)", lambda r, k=k: r[k]["median_ns"], ",.0f", TARGETS["handoff_median_ns"])
        row(f"hand-off, {mode}: p99 (ns)", lambda r, k=k: r[k]["p99_ns"], ",.0f")
        row(f"hand-off, {mode}: p99.9 (ns)", lambda r, k=k: r[k]["p999_ns"], ",.0f", TARGETS["handoff_p999_ns"])
        row(f"hand-off, {mode}: p99.99 (ns)", lambda r, k=k: r[k]["p9999_ns"], ",.0f")
        row(f"hand-off, {mode}: max (ns)", lambda r, k=k: r[k]["max_ns"], ",.0f")
        row(f"hand-off, {mode}: events dropped", lambda r, k=k: r[k]["dropped"], ",.0f")
    for key in ("replica", "no replica"):
        k = f"journal {key}"
        row(f"journal, {key}: drain (events/s)", lambda r, k=k: r[k]["drain_eps"], ",.0f", TARGETS["eps"])
        row(f"journal, {key}: at 300k/s offered (events/s)", lambda r, k=k: r[k]["e2e_eps"], ",.0f")
        row(f"journal, {key}: at 300k/s offered, dropped", lambda r, k=k: r[k]["e2e_dropped"], ",.0f")
    row("pins, 10,000 pinned pages: round trip (ms)", lambda r: r["pins"]["round_trip_ms"], ",.1f", TARGETS["pins_ms"])
    row("pins: worst round trip (ms)", lambda r: r["pins"]["round_trip_max_ms"], ",.1f")
    row("kvctl pins, request + plain table (ms)", lambda r: r["pins"]["kvctl_ms"], ",.1f")
    row("kvctl pins, whole process (ms)", lambda r: r["pins"]["kvctl_process_ms"], ",.1f")
    return 0


if __name__ == "__main__":
    sys.exit(main())
