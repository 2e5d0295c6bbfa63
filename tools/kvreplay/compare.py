"""``kvreplay compare``: the same trace's inputs under several policies, side by side.

The recorded decisions answer "what did the server do"; this answers "what would each policy
have done with the same engine behaviour". So the decisions are re-derived per policy by the most
eager allocator (``PolicyRun.feed``), and the memory cost of safety is measured in page-builds
(``PolicyRun``).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
from collections import Counter
from typing import Any

import kvcli

from kvcached.ledger.events import DECISIONS, BuildBoundary, Event, Policy
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.simulate import derive

from .check import SCHEMA, dumps, witness_lines
from .tracefile import Trace, header_json, json_name


@dataclasses.dataclass
class PolicyRun:
    """One policy's replay, and what it held in memory.

    NOTE: the memory cost of safety is measured as page-builds: the number of mapped pages at the
    end of each build, summed over builds. The difference between two policies is the memory one
    held that the other had already given back, and the per-build maximum of that difference says
    how large the extra footprint got at worst.
    """

    ledger: Ledger
    page_builds: int = 0
    peak_mapped: int = 0
    extra_page_builds: int = 0  # versus the baseline (the first policy)
    peak_extra: int = 0
    samples: list[int] = dataclasses.field(default_factory=list)  # mapped pages per build, this batch

    def feed(self, batch: list[Event]) -> None:
        """Apply one batch, its decisions re-derived under this run's policy.

        NOTE: the decisions come from the most eager allocator (``simulate.derive``: map right
        before a block is handed out, unmap the moment the ledger allows). That is the worst case
        for the freed-block copy and the cheapest case for memory, so both columns are bounds, not
        guesses."""
        lg = self.ledger
        samples: list[int] = []
        for ev in derive(lg, batch):
            if type(ev) is BuildBoundary:
                samples.append(lg.mapped_pages)
        self.samples = samples
        self.page_builds += sum(samples)
        self.peak_mapped = max(self.peak_mapped, lg.mapped_pages, *samples)


@dataclasses.dataclass
class CompareResult:
    path: str
    events: int
    inputs: int
    runs: list[PolicyRun]


def run_compare(path: str, policies: list[str], *, progress: bool = True) -> CompareResult:
    """Replay ``path``'s inputs under each of ``policies``; the first is the baseline.

    NOTE: all policies run in lockstep over one streamed pass of the file (each batch is fed to
    every ledger in turn), so a long trace is read once and memory stays bounded."""
    with Trace(path, progress=progress) as trace:
        runs = [PolicyRun(Ledger(trace.header, Policy(p))) for p in dict.fromkeys(policies)]
        base = runs[0]
        inputs = 0
        for batch in trace.batches(0, "comparing"):
            inputs += sum(1 for ev in batch if type(ev) not in DECISIONS)
            for run in runs:
                run.feed(batch)
            for run in runs[1:]:
                # Every policy sees the same build boundaries, so the samples line up build by build.
                diffs = [a - b for a, b in zip(run.samples, base.samples, strict=True)]
                run.extra_page_builds += sum(diffs)
                run.peak_extra = max(run.peak_extra, *diffs) if diffs else run.peak_extra
        return CompareResult(path=path, events=trace.events, inputs=inputs, runs=runs)


def _by(attr: str, run: PolicyRun) -> dict[str, int]:
    return dict(sorted(Counter(str(getattr(v, attr)) for v in run.ledger.violations).items()))


def report(result: CompareResult) -> dict[str, Any]:
    base = result.runs[0].ledger
    policies = []
    for run in result.runs:
        lg = run.ledger
        policies.append(
            {
                "policy": lg.policy.value,
                "violations": len(lg.violations),
                "violations_by_invariant": _by("invariant", run),
                "violations_by_code": _by("code", run),
                "first_violation": lg.violations[0].one_line() if lg.violations else None,
                "maps": lg.maps,
                "unmaps": lg.unmaps,
                "peak_mapped_pages": run.peak_mapped,
                "peak_pinned_pages": lg.peak_pinned_pages,
                "mapped_page_builds": run.page_builds,
                "extra_page_builds": run.extra_page_builds,
                "peak_extra_pages": run.peak_extra,
                "outstanding_jobs": lg.outstanding_jobs(),
            }
        )
    return {
        "schema": SCHEMA,
        "trace": json_name(result.path),
        "header": header_json(base.header),
        "decisions": "derived",
        "events": result.events,
        "inputs": result.inputs,
        "builds": base.builds,
        "baseline": base.policy.value,
        "policies": policies,
    }


def _cost_line(run: PolicyRun, base: PolicyRun, builds: int, page_bytes: int) -> str:
    name, other = run.ledger.policy.value, base.ledger.policy.value
    avg = run.extra_page_builds / builds if builds else 0.0
    more = "more" if run.extra_page_builds >= 0 else "fewer"
    size = ("-" if avg < 0 else "+") + kvcli.format_size(round(abs(avg) * page_bytes))  # '+12.8 KiB', not '+0.0 MiB'
    return (
        f"memory cost of safety: {name} held {kvcli.plural(abs(run.extra_page_builds), 'page-build')} {more} than "
        f"{other} ({avg:+.2f} pages = {size} per build on average, at most +{kvcli.plural(run.peak_extra, 'page')} "
        "in one build)"
    )


def render(result: CompareResult, limit: int) -> str:
    runs = result.runs
    base = runs[0]
    lg0 = base.ledger
    out = io.StringIO()
    print(
        f"{result.path}: {kvcli.plural(result.events, 'event')} ({kvcli.plural(result.inputs, 'input')}), "
        f"{kvcli.plural(lg0.builds, 'build')}; "
        "decisions re-derived per policy by an eager allocator",
        file=out,
    )
    width = max(12, *(len(r.ledger.policy.value) + 2 for r in runs))
    rows: list[tuple[str, list[str]]] = [("", [r.ledger.policy.value for r in runs])]
    rows.append(("violations", [f"{len(r.ledger.violations):,}" for r in runs]))
    codes = sorted({(v.invariant, v.code) for r in runs for v in r.ledger.violations})
    for inv, code in codes:
        counts = [sum(1 for v in r.ledger.violations if v.code == code) for r in runs]
        rows.append((f"  {inv} {code}", [f"{n:,}" if n else "-" for n in counts]))
    rows += [
        ("maps", [f"{r.ledger.maps:,}" for r in runs]),
        ("unmaps", [f"{r.ledger.unmaps:,}" for r in runs]),
        ("peak mapped pages", [f"{r.peak_mapped:,}" for r in runs]),
        ("peak pinned pages", [f"{r.ledger.peak_pinned_pages:,}" for r in runs]),
        ("mapped page-builds", [f"{r.page_builds:,}" for r in runs]),
        (f"  beyond {lg0.policy.value}", ["-"] + [f"{r.extra_page_builds:+,}" for r in runs[1:]]),
        ("  at most in one build", ["-"] + [f"{r.peak_extra:+,}" for r in runs[1:]]),
    ]
    label = max(len(name) for name, _ in rows) + 2
    for name, cells in rows:
        print(f"{name:<{label}}" + "".join(f"{c:>{width}}" for c in cells), file=out)
    for run in runs:
        lg = run.ledger
        if lg.violations and limit != 0:
            print(f"\n{lg.policy.value}: first violations", file=out)
            for v in lg.violations[: max(limit, 0)]:
                print("\n".join(witness_lines(v, "  ")), file=out)
    print(file=out)
    for run in runs[1:]:
        print(_cost_line(run, base, lg0.builds, lg0.header.page_bytes), file=out)
    return out.getvalue()


def cmd_compare(args: argparse.Namespace) -> int:
    policies = args.policy or ["legacy", "ledger"]
    result = run_compare(args.trace, policies, progress=not args.no_progress)
    sys.stdout.write(dumps(report(result)) if args.json else render(result, args.limit))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "compare",
        help="replay a trace's inputs under several policies and compare violations, unmaps and memory",
        description="Replay the inputs of TRACE under each --policy (default: legacy, then ledger), re-deriving the "
        "map/unmap decisions with the most eager allocator, and show side by side the violations, the unmaps and "
        "the memory cost of safety: mapped page-builds beyond the first policy's. Exit 0 unless the trace is "
        "unreadable (2).",
    )
    p.add_argument("trace", metavar="TRACE", help="a kvcached journal (.kvj)")
    p.add_argument(
        "--policy",
        action="append",
        choices=[p.value for p in Policy],
        help="a policy to replay under, repeatable (default: legacy, then ledger); the first is the baseline",
    )
    p.add_argument("--json", action="store_true", help="print a deterministic JSON report")
    p.add_argument(
        "--limit",
        type=kvcli.whole(0, "a number of witnesses"),
        default=1,
        metavar="N",
        help="witnesses to print per policy (default 1)",
    )
    p.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    p.set_defaults(func=cmd_compare)
