"""``kvreplay stats``: where the KV memory went, build by build, as a table or JSON.

At the end of every build the replay samples five page counts: mapped; in use (mapped and
holding an allocated block); empty (mapped, no block: memory that kept only because of a pin
or because the allocator had not given it back yet); pinned; and free (not mapped, so another
model may have it). The ledger keeps the mapped and pinned counts itself; the empty count is
kept here, incrementally, by re-examining at each build only the pages that the build's allocs,
frees and decisions touched, so the cost is per event, never per page per build. The samples
are stored in flat integer arrays (8 bytes a build) and summarized into a fixed number of rows,
so that the same numbers serve a ten-build scenario and a ten-million-event trace; ``plot``
draws the same samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import sys
from array import array
from typing import Any

import kvcli

from kvcached.ledger.events import BlockAlloc, BlockFree, BuildBoundary, PageMapped, PageUnmapped
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.simulate import derive

from .check import dumps, report_head
from .tracefile import Trace, start_ledger

METRICS = ("mapped", "in_use", "empty", "pinned", "releasable", "free")


@dataclasses.dataclass
class Series:
    path: str
    ledger: Ledger
    derived: bool
    build: array[int] = dataclasses.field(default_factory=lambda: array("q"))
    values: dict[str, array[int]] = dataclasses.field(default_factory=lambda: {m: array("q") for m in METRICS})
    violations: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # (build, invariant), first ones
    # The counts after the last event, when events follow the last boundary (a prefix-cache
    # reset's frees and unmaps often do): the samples stop at that boundary.
    end: dict[str, int] | None = None
    events_after_last_build: int = 0


MAX_MARKED_VIOLATIONS = 200


def collect(trace: Trace, lg: Ledger, skip: int, derived: bool) -> Series:
    s = Series(trace.path, lg, derived)
    npools = len(lg.header.pools)
    nblocks = [p.num_blocks for p in lg.header.pools]
    n = lg.num_pages
    empty = {p for p in range(n) if lg.is_mapped(p) and not lg.allocated_blocks(p)}
    dirty: set[int] = set()
    page_of, is_mapped, allocated = lg.page_of, lg.is_mapped, lg.allocated_blocks
    seen = len(lg.violations)
    bs = s.build
    columns = [s.values[m] for m in METRICS]

    def sample() -> tuple[int, ...]:
        """The counts of METRICS now; re-examines only the pages touched since the last sample."""
        for p in dirty:
            if is_mapped(p) and not allocated(p):
                empty.add(p)
            else:
                empty.discard(p)
        dirty.clear()
        mapped = lg.mapped_pages
        return mapped, mapped - len(empty), len(empty), lg.pinned_pages, len(lg.releasable), n - mapped

    since = 0  # events since the last boundary
    for batch in trace.batches(skip, "sampling"):
        for ev in derive(lg, batch) if derived else batch:
            since += 1
            if not derived:
                lg.apply(ev)
            if isinstance(ev, BlockAlloc | BlockFree):
                pool = ev.pool
                if pool < npools:
                    nb = nblocks[pool]
                    dirty.update(page_of(pool, b) for b in ev.blocks if b < nb)
            elif isinstance(ev, PageMapped | PageUnmapped):
                if ev.page < n:
                    dirty.add(ev.page)
            elif isinstance(ev, BuildBoundary):
                since = 0
                bs.append(ev.build)
                for column, value in zip(columns, sample(), strict=True):
                    column.append(value)
            if len(lg.violations) != seen:
                for v in lg.violations[seen:]:
                    if len(s.violations) < MAX_MARKED_VIOLATIONS:
                        s.violations.append((v.build, v.invariant))
                seen = len(lg.violations)
    if since and bs:
        s.events_after_last_build = since
        s.end = dict(zip(METRICS, sample(), strict=True))
    return s


def rows(s: Series, buckets: int) -> list[dict[str, Any]]:
    """``buckets`` rows of equal numbers of builds (0: one row per build), mean and max of each."""
    n = len(s.build)
    k = n if buckets <= 0 else min(buckets, n)
    out: list[dict[str, Any]] = []
    for i in range(k):
        lo, hi = n * i // k, n * (i + 1) // k
        row: dict[str, Any] = {"first_build": s.build[lo], "last_build": s.build[hi - 1]}
        for m in METRICS:
            part = s.values[m][lo:hi]
            row[f"{m}_mean"] = round(sum(part) / len(part), 2)
            row[f"{m}_max"] = max(part)
        out.append(row)
    return out


def report(s: Series, buckets: int) -> dict[str, Any]:
    lg = s.ledger
    v = s.values
    return {
        **report_head(s.path, lg, s.derived),
        "num_pages": lg.num_pages,
        "builds": len(s.build),
        "totals": {
            "mapped_page_builds": sum(v["mapped"]),
            "empty_page_builds": sum(v["empty"]),
            "pinned_page_builds": sum(v["pinned"]),
            "peak_mapped_pages": max(v["mapped"], default=0),
            "peak_empty_pages": max(v["empty"], default=0),
            "peak_pinned_pages": lg.peak_pinned_pages,
            "violations": len(lg.violations),
        },
        "rows": rows(s, buckets),
        "end": None if s.end is None else {"events_after_last_build": s.events_after_last_build, **s.end},
    }


def render(s: Series, buckets: int) -> str:
    lg = s.ledger
    out = io.StringIO()
    how = "derived" if s.derived else "recorded"
    print(
        f"{s.path}: {kvcli.plural(len(s.build), 'build')}, {kvcli.plural(lg.num_pages, 'page')} of "
        f"{kvcli.format_size(lg.header.page_bytes)}; policy {lg.policy.value}, "
        f"{how} decisions; page counts at the end of each build, mean (max) per row",
        file=out,
    )
    if not s.build:
        print("no build boundaries in the trace: nothing to sample", file=out)
        return out.getvalue()
    cols = [
        ("mapped", True),
        ("in_use", False),
        ("empty", True),
        ("pinned", True),
        ("releasable", False),
        ("free", False),
    ]
    table = [["builds", *(c.replace("_", " ") for c, _ in cols)]]
    for r in rows(s, buckets):
        first, last = r["first_build"], r["last_build"]
        cells = [f"{first}-{last}" if first != last else str(first)]
        for c, with_max in cols:
            cells.append(f"{r[c + '_mean']:.1f}" + (f" ({r[c + '_max']})" if with_max else ""))
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)), file=out)
    if s.end is not None:
        e = s.end
        print(
            f"after the last build ({s.events_after_last_build:,} more events): mapped {e['mapped']}, "
            f"in use {e['in_use']}, empty {e['empty']}, pinned {e['pinned']}, free {e['free']}",
            file=out,
        )
    t = report(s, 1)["totals"]
    print(
        f"mapped page-builds {t['mapped_page_builds']:,}, of which empty {t['empty_page_builds']:,}; "
        f"peak mapped {t['peak_mapped_pages']:,}, peak pinned {t['peak_pinned_pages']:,}; "
        f"{kvcli.plural(t['violations'], 'violation')}",
        file=out,
    )
    return out.getvalue()


def cmd_stats(args: argparse.Namespace) -> int:
    with Trace(args.trace, progress=not args.no_progress) as trace:
        lg, skip = start_ledger(trace, args.policy, args.from_snapshot)
        s = collect(trace, lg, skip, args.derive)
    sys.stdout.write(dumps(report(s, args.rows)) if args.json else render(s, args.rows))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "stats",
        parents=[common],
        help="mapped, in-use, empty, pinned and free pages over builds, as a table",
        description="Replay TRACE and sample at the end of every build the pages mapped, in use (holding a block), "
        "empty (mapped without a block), pinned, releasable and free (not mapped); print them summarized over "
        "rows of builds.",
    )
    p.add_argument(
        "--rows",
        type=kvcli.whole(0, "a number of rows"),
        default=20,
        metavar="N",
        help="rows of builds (0: one per build; default 20)",
    )
    p.add_argument("--json", action="store_true", help="print a deterministic JSON report")
    p.set_defaults(func=cmd_stats)
