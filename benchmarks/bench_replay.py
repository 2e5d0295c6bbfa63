"""kvreplay speed: ``check`` events/s, peak memory over trace sizes, and ``minimize`` time and size.

Three questions, each answered by child processes so that every figure comes from a fresh
interpreter: the pure-Python ledger (the source tree) and the mypyc-compiled one that ``pip
install kvcached`` builds (compiled into a temporary folder by ``scripts/build-compiled.sh``)
run side by side, as in ``bench_ledger.py``.

The synthetic traces are ``synth.workload(7, preempt_every=0)`` (see ``generate`` for why).

* check: events/s of ``kvreplay check``'s replay (``run_check``: streaming read, decode, apply)
  on a recorded synthetic trace (``synth.workload`` with decisions derived under ``ledger``),
  median of ``--runs``.
* memory: peak RSS (``getrusage``) of a process that runs ``kvreplay check --json`` on prefixes
  of one long synthetic trace (default 1M, 5M and 10M events; generated once, in frames of
  65,536 events, by the compiled build). Flat peaks mean memory does not grow with the trace.
* minimize: time and result size of ``kvreplay minimize`` on the randomized workload with
  decisions derived under ``legacy`` (which shows freed-block copies).
* instructions (``--parts instructions``, needs valgrind): instructions per replayed event,
  which do not drift with the machine as its clock does (on this shared 2-core machine
  the same build's events/s swing by 40% within an hour). callgrind counts a whole
  ``run_check`` child on two prefixes of one synthetic trace (131,072 and 300,000 events); the
  difference over the events between them leaves out start-up and imports.
* against (``--against REV``): the same check (and instructions) for the code at git revision
  REV too, pure and compiled, run round by round beside this tree's (``--runs`` rounds of one
  run per build), with each build's ratio over REV's: the median of the per-round ratios. This
  is how a target stated against an old figure is judged on a machine whose speed has moved
  since (the figures the targets were set against, 594k median compiled and 461k pure, were
  measured at 31d5a87; that code replays 409k-561k and 287k-398k on this machine now).

    python benchmarks/bench_replay.py [--runs 3] [--check-events 1000000] [--sizes 1e6,5e6,1e7]
        [--parts check,memory,minimize,instructions] [--against REV] [--json]
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BATCH = 65536
# Targets for kvreplay check on the synthetic workload, in events/s.
TARGETS = {"pure": 500_000, "compiled": 1_000_000}


def generate(path: str, n_events: int, policy: str, marks: list[int]) -> dict[str, Any]:
    """Writes a recorded synthetic trace of ``n_events`` events; returns the byte offsets of the
    frame boundaries at or after each of ``marks`` events (prefixes are valid journals)."""
    import msgspec

    from kvcached.ledger.events import Policy
    from kvcached.ledger.journal import JournalWriter
    from kvcached.ledger.ledger import Ledger
    from kvcached.ledger.simulate import derive
    from kvcached.testing import synth

    t0 = time.perf_counter()
    h = msgspec.structs.replace(synth.header(), policy=Policy(policy))
    # preempt_every=0: synth.workload's preemption can pick a request that finishes in the same
    # step and then fails (KeyError, about every 500,000 events); reported, avoided here.
    stream = derive(Ledger(h), synth.workload(7, preempt_every=0))
    offsets: dict[int, int] = {}
    pending = sorted(marks)
    with JournalWriter.create(path, h) as w:
        while w.events_written < n_events:
            w.append(list(itertools.islice(stream, min(BATCH, n_events - w.events_written))))
            while pending and w.events_written >= pending[0]:
                offsets[pending.pop(0)] = w.bytes_written
    return {"events": n_events, "bytes": os.path.getsize(path), "offsets": offsets, "seconds": time.perf_counter() - t0}


def child_check(path: str, runs: int) -> dict[str, Any]:
    from kvcached.ledger import ledger as ledger_mod
    from kvreplay.check import run_check

    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        res = run_check(path, progress=False)
        rates.append(res.ledger.index / (time.perf_counter() - t0))
    # The best run is reported beside the median: on a shared machine the spread comes from
    # other tenants, and the best is what the code can do.
    return {
        "ledger_module": ledger_mod.__file__,
        "events": res.ledger.index,
        "eps": statistics.median(rates),
        "best_eps": max(rates),
    }


def child_once(path: str) -> dict[str, Any]:
    from kvreplay.check import run_check

    return {"events": run_check(path, progress=False).ledger.index}


def instructions(build: str, short: str, long: str, events: int) -> float:
    """Instructions per event of ``run_check`` under ``build``: callgrind's totals for the two
    prefixes, differenced (the same start-up in both), divided by the events between them."""
    totals = []
    for path in (short, long):
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-P", __file__]
        env = dict(os.environ, PYTHONPATH=build)
        proc = subprocess.run([*cmd, "--child", "once", path], env=env, capture_output=True, text=True, cwd=ROOT)
        found = re.search(r"Collected : (\d+)", proc.stderr)
        if proc.returncode or found is None:
            sys.exit(f"callgrind failed on {path}:\n{proc.stderr[-2000:]}")
        totals.append(int(found.group(1)))
    return (totals[1] - totals[0]) / events


def child_rss(path: str) -> dict[str, Any]:
    from kvreplay.cli import main

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(["check", path, "--json", "--no-progress"])
    seconds = time.perf_counter() - t0
    report = json.loads(buf.getvalue())
    return {
        "code": code,
        "events": report["summary"]["events"],
        "builds": report["summary"]["builds"],
        "violations": len(report["violations"]),
        "seconds": seconds,
        "rss_after_imports_kb": before,
        "peak_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def child_minimize(path: str, out: str) -> dict[str, Any]:
    from kvreplay.minimize import minimize

    res = minimize(path, out)
    return {
        "seconds": res.seconds,
        "events_read": res.events_read,
        "prefix": res.prefix_events,
        "result_events": len(res.events),
        "replays": res.replays,
        "target": res.target,
        "derived": res.derived,
    }


def _child(build: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=build)
    cmd = [sys.executable, "-P", __file__, "--child", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"child {args} failed:\n{proc.stderr}")
    return dict(json.loads(proc.stdout))


def _sizes(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--check-events", type=int, default=1_000_000)
    ap.add_argument("--sizes", type=_sizes, default=[1_000_000, 5_000_000, 10_000_000])
    ap.add_argument("--minimize-events", type=int, default=200_000)
    ap.add_argument("--parts", default="check,memory,minimize", help="which measurements, comma-separated")
    ap.add_argument("--against", metavar="REV", help="also measure the code at git revision REV, round by round")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        what, *rest = args.child
        if what == "generate":
            out = generate(rest[0], int(rest[1]), rest[2], [int(x) for x in rest[3:]])
        elif what == "check":
            out = child_check(rest[0], int(rest[1]))
        elif what == "rss":
            out = child_rss(rest[0])
        elif what == "once":
            out = child_once(rest[0])
        else:
            out = child_minimize(rest[0], rest[1])
        print(json.dumps(out))
        return 0

    results: dict[str, Any] = {"check": {}, "memory": [], "minimize": {}, "instructions": {}}
    with tempfile.TemporaryDirectory() as tmp:
        from _builds import builds as make_builds
        from _builds import builds_at

        # kvreplay comes from the editable install for this tree; PYTHONPATH picks the ledger.
        builds = make_builds(tmp)
        compiled = builds["compiled"]
        ours = dict(builds)
        parts = set(args.parts.split(","))
        if args.against and parts & {"check", "instructions"}:  # the only parts that run REV's code
            builds.update(builds_at(args.against, tmp))
        if "check" in parts:
            check_trace = os.path.join(tmp, "check.kvj")
            results["check_trace"] = _child(compiled, "generate", check_trace, str(args.check_events), "ledger")
            if args.against:
                # Round by round, one run of each build per round: the machine's swings hit all alike.
                rounds: dict[str, list[float]] = {name: [] for name in builds}
                for _ in range(args.runs):
                    for name, build in builds.items():
                        rounds[name].append(_child(build, "check", check_trace, "1")["eps"])
                for name, rates in rounds.items():
                    results["check"][name] = {"eps": statistics.median(rates), "best_eps": max(rates), "rounds": rates}
                for kind in ("pure", "compiled"):
                    old = rounds[f"{kind}@{args.against}"]
                    results.setdefault("ratios", {})[kind] = statistics.median(
                        a / b for a, b in zip(rounds[kind], old, strict=True)
                    )
            else:
                for name, build in builds.items():
                    results["check"][name] = _child(build, "check", check_trace, str(args.runs))
            os.remove(check_trace)
        if "minimize" in parts:
            min_trace = os.path.join(tmp, "legacy.kvj")
            _child(compiled, "generate", min_trace, str(args.minimize_events), "legacy")
            for name, build in ours.items():
                dest = os.path.join(tmp, f"min-{name}.kvj")
                results["minimize"][name] = _child(build, "minimize", min_trace, dest)
        if "instructions" in parts:
            if shutil.which("valgrind") is None:
                sys.exit("--parts instructions needs valgrind (callgrind) on PATH")
            short, long = os.path.join(tmp, "short.kvj"), os.path.join(tmp, "long.kvj")
            gen = _child(compiled, "generate", long, "300000", "ledger", "100000")
            shutil.copyfile(long, short)
            os.truncate(short, gen["offsets"]["100000"])  # the frame boundary at or after 100,000
            first = _child(compiled, "once", short)["events"]
            for name, build in builds.items():
                results["instructions"][name] = instructions(build, short, long, 300_000 - first)
            results["instructions_events"] = 300_000 - first
        if "memory" in parts:
            big = os.path.join(tmp, "big.kvj")
            sizes = sorted(args.sizes)
            gen = _child(compiled, "generate", big, str(sizes[-1]), "ledger", *map(str, sizes))
            results["memory_trace"] = {k: v for k, v in gen.items() if k != "offsets"}
            for n in sizes:
                prefix = big if n == sizes[-1] else os.path.join(tmp, f"prefix-{n}.kvj")
                if prefix != big:
                    shutil.copyfile(big, prefix)
                    os.truncate(prefix, gen["offsets"][str(n)])
                row = _child(compiled, "rss", prefix)
                row["bytes"] = os.path.getsize(prefix)
                results["memory"].append(row)
                if prefix != big:
                    os.remove(prefix)

    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    if results["check"]:
        ct = results["check_trace"]
        how = f"{args.runs} rounds, one run of each build a round" if args.against else f"{args.runs} runs"
        print(
            f"check: {ct['events']:,} events of the synthetic workload, decisions derived under ledger "
            f"({ct['bytes'] / ct['events']:.1f} bytes/event); median of {how}"
        )
        for name in builds:
            r = results["check"][name]
            target = f" (target >= {TARGETS[name]:,})" if name in TARGETS else ""
            print(f"  {name:>18}: {r['eps']:>10,.0f} events/s median, {r['best_eps']:>10,.0f} best{target}")
        for kind, ratio in results.get("ratios", {}).items():
            print(f"  {kind} / {kind}@{args.against}: {ratio:.2f}x (median of the rounds' ratios)")
    if results["instructions"]:
        n = results["instructions_events"]
        print(f"instructions: callgrind, per event of kvreplay check over {n:,} synthetic events")
        for name in builds:
            print(f"  {name:>18}: {results['instructions'][name]:>8,.0f} instructions/event")
    if results["memory"]:
        print(
            "memory: kvreplay check --json on prefixes of one trace (compiled build; trace generated in "
            f"{results['memory_trace']['seconds']:.0f} s)"
        )
        print(f"  {'events':>12} {'builds':>8} {'MB on disk':>11} {'seconds':>8} {'events/s':>10} {'RSS':>20}")
        for r in results["memory"]:
            print(
                f"  {r['events']:>12,} {r['builds']:>8,} {r['bytes'] / 1e6:>11.0f} {r['seconds']:>8.1f} "
                f"{r['events'] / r['seconds']:>10,.0f}   {r['rss_after_imports_kb'] / 1024:.1f} MB after imports, "
                f"{r['peak_rss_kb'] / 1024:.1f} MB peak"
            )
    if results["minimize"]:
        m = results["minimize"]
        what = f"{args.minimize_events:,}-event randomized workload under legacy, target {m['compiled']['target']}"
        print(f"minimize: {what}")
        for name in ours:
            r = m[name]
            print(
                f"  {name:>8}: {r['seconds']:.1f} s, {r['replays']:,} replays: {r['events_read']:,} events read, "
                f"{r['prefix']:,} before the violation -> {r['result_events']} events"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
