"""``kvreplay check``: replay a trace through the ledger and report every invariant violation.

This is the command a maintainer runs on a user's journal, so it answers in the order a person
reads (``render``). The replay takes the trace's recorded map/unmap decisions under its recorded
policy by default, because the question is "what did this server do"; ``--derive`` asks instead
what the most eager allocator would have done (``run_check``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import json
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any, Final

import kvcli
import msgspec

from kvcached.ledger.findings import Violation
from kvcached.ledger.journal import TornTail
from kvcached.ledger.ledger import Ledger

from .tracefile import Trace, feed, header_json, json_name, start_ledger

SCHEMA: Final = 1


@dataclasses.dataclass
class CheckResult:
    path: str
    ledger: Ledger
    derived: bool
    from_snapshot: int | None
    torn_tail: TornTail | None
    policy_overridden: bool
    # A rotated journal: which segments exist and which were read (None for one file read whole).
    segments_note: str | None = None
    segments: list[dict[str, object]] | None = None
    # What the trace leaves unfinished at its end (see ``unfinished``); empty for most traces.
    ends: dict[str, Any] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """The cyclic garbage collector off while a trace is decoded and applied.

    A frame decodes to tens of thousands of events whose block tuples the collector tracks;
    it would walk them (and the ledger's growing tables) again and again, about 2% of a pure
    Python replay by callgrind's count, and collect nothing: decoding and applying events
    make no reference cycles, so reference counting frees every frame as the next one comes
    (memory stays flat in the trace's length, as benchmarks/bench_replay.py measures)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def run_check(
    path: str,
    *,
    policy: str | None = None,
    derived: bool = False,
    snapshot: str | None = None,
    progress: bool = True,
) -> CheckResult:
    with Trace(path, progress=progress, note=False) as trace:
        ledger, skip = start_ledger(trace, policy, snapshot)
        with _no_cycle_collection():
            for batch in trace.batches(skip, "checking", require_events=True):
                feed(ledger, batch, derived)
        return CheckResult(
            path=path,
            ledger=ledger,
            derived=derived,
            from_snapshot=skip if snapshot is not None or skip else None,  # skip > 0: the journal's own P.snap
            torn_tail=trace.torn_tail,
            policy_overridden=policy is not None and ledger.policy is not trace.header.policy,
            segments_note=trace.segments_note(),
            segments=trace.segments_json(),
            ends=unfinished(ledger),
        )


def unfinished(lg: Ledger) -> dict[str, Any]:
    """What is still under way when the trace ends: ``outstanding_jobs`` (a count) with the
    ``oldest_job`` among those that pin a page, and ``shrink`` when more pages are mapped than
    the last memory limit allows. Empty when nothing is: a run that stopped cleanly.

    NOTE: a trace that ends with jobs outstanding or a shrink unfinished is not a violation (a
    journal read while its server runs ends so). But it is what a crashed run leaves, so the
    report says so beside "clean" rather than let a crash read as a clean run."""
    out: dict[str, Any] = {}
    if n := lg.outstanding_jobs():
        out["outstanding_jobs"] = n
        # Jobs are found through the pages they pin (O(pinned pages)): the ledger's questions
        # are per page, and a job over no page holds nothing back.
        jobs = {r.job: r for p in lg.pinned() for r in lg.why(p).pins if r.kind == "job"}
        if jobs:
            r = min(jobs.values(), key=lambda r: (r.since_build, r.job or 0))
            out["oldest_job"] = {
                "job": r.job,
                "kind": r.job_kind,
                "request": r.request,
                "build": r.since_build,
                "waiting_workers": r.waiting_workers,
            }
    if lg.limit is not None and lg.mapped_pages > lg.limit:
        out["shrink"] = {"limit": lg.limit, "mapped_pages": lg.mapped_pages}
    return out


def unfinished_lines(ends: dict[str, Any]) -> list[str]:
    """The text form of ``unfinished``: one line per thing under way, indented."""
    lines = []
    if n := ends.get("outstanding_jobs"):
        line = f"  {kvcli.plural(n, 'job')} outstanding"
        if (j := ends.get("oldest_job")) is not None:
            line += (
                f"; the oldest: {j['kind']} job {j['job']} of request {j['request']}, built in build {j['build']}, "
                f"waiting on {kvcli.plural(j['waiting_workers'], 'worker')}"
            )
        lines.append(line)
    if (s := ends.get("shrink")) is not None:
        mapped = kvcli.plural(s["mapped_pages"], "page")
        lines.append(f"  a shrink unfinished: {mapped} mapped over a limit of {s['limit']:,}")
    return lines


# Why an unfinished end is worth a line though it is no violation.
UNFINISHED_WHY: Final = (
    "not a violation: a run that crashed or whose journal was cut short ends so, as does a journal read while its "
    "server runs"
)


def report_head(path: str, lg: Ledger, derived: bool) -> dict[str, Any]:
    """The fields every JSON report of one replayed trace starts with."""
    return {
        "schema": SCHEMA,
        "trace": json_name(path),
        "header": header_json(lg.header),
        "policy": lg.policy.value,
        "decisions": "derived" if derived else "recorded",
    }


def report(result: CheckResult) -> dict[str, Any]:
    """The machine-readable report: what ``check --json`` prints and golden files hold.

    NOTE: it holds the same findings as ``render`` as a deterministic document (sorted keys, file
    name without directories, no times or versions), because golden traces keep it beside them
    as their expected report."""
    lg = result.ledger
    torn = result.torn_tail
    # Only for a trace of several files, so that the report of a one-file trace (every golden
    # trace) keeps its exact form; ``unfinished`` likewise only when something is.
    rotated = {"segments": result.segments} if result.segments is not None else {}
    ends = {"unfinished": result.ends} if result.ends else {}
    return {
        **report_head(result.path, lg, result.derived),
        **rotated,
        **ends,
        "from_snapshot": result.from_snapshot,
        "torn_tail": msgspec.to_builtins(torn) if torn is not None else None,
        "summary": lg.counters(),
        "violations_by_invariant": dict(sorted(Counter(v.invariant for v in lg.violations).items())),
        "violations_by_code": dict(sorted(Counter(v.code for v in lg.violations).items())),
        "violations": msgspec.to_builtins(lg.violations),
        "clean": not lg.violations,
    }


def dumps(doc: object) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def witness_lines(v: Violation, prefix: str = "") -> list[str]:
    lines = [f"{prefix}{v.one_line()}"]
    width = max((len(str(c.index)) for c in v.chain), default=1)
    lines += [f"  {c.step:>9}  event {c.index:>{width}}, build {c.build}: {c.what}" for c in v.chain]
    return lines


def kinds(violations: list[Violation]) -> str:
    counts = Counter(f"{v.invariant} {v.code}" for v in violations)
    return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))


def summary_line(lg: Ledger) -> str:
    c, p = lg.counters(), kvcli.plural
    return (
        f"summary: {p(c['events'], 'event')}, {p(c['builds'], 'build')}, {p(c['jobs'], 'job')} "
        f"({c['outstanding_jobs']:,} outstanding at the end), peak {p(c['peak_pinned_pages'], 'pinned page')}, "
        f"{p(c['maps'], 'map')}, {p(c['unmaps'], 'unmap')}"
    )


def render(result: CheckResult, limit: int) -> str:
    """The report for a person: each violation as one line that names the file, the event index,
    the build, the page, the job and the request, followed by its witness chain (pin -> free ->
    unmap -> late copy), then a count by kind and a one-line summary."""
    lg = result.ledger
    out = io.StringIO()
    how = "re-derived by an eager allocator" if result.derived else "as recorded"
    policy = f"policy {lg.policy.value}" + (" (--policy)" if result.policy_overridden else " (recorded)")
    start = f"; from the snapshot after event {result.from_snapshot:,}" if result.from_snapshot is not None else ""
    print(f"{result.path}: {kvcli.plural(lg.index, 'event')}, {policy}, decisions {how}{start}", file=out)
    if result.segments_note is not None:
        print(f"{result.path}: {result.segments_note}", file=out)
    shown = lg.violations if limit <= 0 else lg.violations[:limit]
    for v in shown:
        print("\n".join(witness_lines(v, f"{result.path}: ")), file=out)
    if len(shown) < len(lg.violations):
        print(f"... and {len(lg.violations) - len(shown):,} more (--limit 0 shows all)", file=out)
    if lg.violations:
        print(f"{kvcli.plural(len(lg.violations), 'violation')}: {kinds(lg.violations)}", file=out)
        if result.ends:
            print(f"the trace ends unfinished ({UNFINISHED_WHY}):", file=out)
    elif result.ends:
        print(f"clean: no invariant violated, but the trace ends unfinished ({UNFINISHED_WHY}):", file=out)
    else:
        print("clean: no invariant violated", file=out)
    for line in unfinished_lines(result.ends):
        print(line, file=out)
    print(summary_line(lg), file=out)
    if not result.derived and lg.maps == 0 and lg.jobs_built + lg.builds > 0:
        print("note: the trace records no map decisions; --derive re-derives them", file=out)
    return out.getvalue()


def cmd_check(args: argparse.Namespace) -> int:
    """``kvreplay check``: exit 1 when a violation was found, else 0.

    NOTE: a malformed event sequence (a report for a job never built, a double free) is an I3
    violation found by the ledger. It is reported like any other and exits 1, and the replay goes
    on, since an I1 after it is still worth seeing. A file that cannot be read exits 1 too, with
    nothing on stdout, and so does a trace with no event in it (nothing was checked: "clean"
    would be a claim about nothing).
    """
    result = run_check(
        args.trace,
        policy=args.policy,
        derived=args.derive,
        snapshot=args.from_snapshot,
        progress=not args.no_progress,
    )
    sys.stdout.write(dumps(report(result)) if args.json else render(result, args.limit))
    return 1 if result.ledger.violations else 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "check",
        parents=[common],
        help="replay a trace and report every invariant violation "
        "(exit 0 clean, 1 a violation or an unreadable or empty trace)",
        description="Replay every event of TRACE through the ledger under its recorded policy with its recorded "
        "map/unmap decisions, and report each invariant violation as a short witness. Exit 0 when clean; 1 when a "
        "violation was found (a malformed sequence, such as a report for a job never built, is an I3 violation), "
        "and 1 with nothing on stdout when the trace cannot be read or holds no event; 2 when the command line is "
        "wrong. A trace that ends with jobs outstanding or a shrink unfinished (as a crashed run's does) is no "
        "violation, but the report says so.",
    )
    p.add_argument("--json", action="store_true", help="print a deterministic JSON report (golden traces keep it)")
    p.add_argument(
        "--limit",
        type=kvcli.whole(0, "a number of witnesses"),
        default=10,
        metavar="N",
        help="witnesses to print (0: all; default 10)",
    )
    p.set_defaults(func=cmd_check)
