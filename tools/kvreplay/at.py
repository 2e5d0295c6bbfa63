"""``kvreplay show --at TIME``: the build that ran at a wall-clock time, from a served engine's journal.

An operator sees something on a dashboard at 14:05 (memory that did not go back, a violation
counter that moved) and has the engine's journal; what the journal knows is events and builds,
not minutes. A served engine stamps every build boundary with the time on its monotonic clock
after the header's wall-clock base (``BuildBoundary.at_us``, ``Header.clock_base_unix``), so the
replay can stop at the first boundary past TIME: the build that closed there is the one that was
running at TIME, and its events, the violations among them and the ledger's state at its close
are the answer. The replay is ``check``'s (recorded decisions unless ``--derive``), from a snapshot
if asked; it goes no further than that boundary, so an early TIME in a long journal is fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import kvcli
import msgspec

from kvcached.ledger.events import BuildBoundary, Event
from kvcached.ledger.simulate import derive

from .timeline_text import describe_event as _describe
from .timeline_text import wall
from .tracefile import ReplayError, Trace, start_ledger


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s < 60 else f"{s / 60:.1f} min"


def show_at(args: argparse.Namespace) -> int:
    at: float = args.at
    with Trace(args.trace, progress=not args.no_progress) as trace:
        base = trace.header.clock_base_unix
        if not base:
            raise ReplayError(
                f"{args.trace}: its build boundaries carry no time (a journal of a test or scenario, or of a kvcached "
                "that did not stamp them); use --page, --job or --request"
            )
        if at < base:
            raise ReplayError(f"{args.trace}: {wall(at)} is before its engine started, {wall(base)}")
        lg, skip = start_ledger(trace, args.policy, args.from_snapshot)
        seen = len(lg.violations)
        rows: list[tuple[int, int, Event]] = []  # the events since the last boundary: (index, build, event)
        # When the build now running began: its previous boundary; the first began with the engine.
        opened = base
        last: float | None = None
        found: BuildBoundary | None = None
        for batch in trace.batches(skip, "showing"):
            stream = derive(lg, batch) if args.derive else batch
            for ev in stream:
                if not args.derive:
                    lg.apply(ev)
                index = lg.index - 1
                rows.append((index, lg.build_of(index), ev))
                if type(ev) is not BuildBoundary or ev.at_us is None:
                    continue
                last = base + ev.at_us / 1e6
                if last >= at:
                    found = ev
                    break
                opened, rows, seen = last, [], len(lg.violations)
            if found is not None:
                break
        if found is None:
            if last is None:
                raise ReplayError(f"{args.trace}: no build boundary in it carries a time")
            raise ReplayError(
                f"{args.trace}: {wall(at)} is after its last build boundary, {wall(last)} "
                f"(its builds run from {wall(base)} on)"
            )
        closed = base + (found.at_us or 0) / 1e6
        new = lg.violations[seen:]
        state = {
            "mapped_pages": lg.mapped_pages,
            "pinned_pages": lg.pinned_pages,
            "num_pages": lg.num_pages,
            "outstanding_jobs": lg.outstanding_jobs(),
            "violations": len(lg.violations),
            "limit": lg.limit,
        }
        if args.json:
            doc: dict[str, Any] = {
                "trace": args.trace,
                "at": at,
                "build": found.build,
                "began": opened,
                "closed": closed,
                "events": [{"index": i, "build": b, "event": _describe(e, base)} for i, b, e in rows],
                "violations": [v.one_line() for v in new],
                "state": state,
            }
            sys.stdout.write(msgspec.json.encode(doc).decode() + "\n")
            return kvcli.OK
        out = [
            f"{args.trace}: at {wall(at)} build {found.build} was running: it began {wall(opened)} "
            f"({_seconds(at - opened)} before) and closed {wall(closed)} ({_seconds(closed - at)} after), "
            f"{kvcli.plural(len(rows), 'event')}",
        ]
        shown = rows if args.limit <= 0 else rows[: args.limit]
        out += [f"  event {i:>7}  build {b:>5}  {_describe(e, base)}" for i, b, e in shown]
        if len(shown) < len(rows):
            out.append(f"  ... and {kvcli.plural(len(rows) - len(shown), 'more event')} (--limit 0 shows all)")
        out += [f"  !! {v.one_line()}" for v in new]
        limit = "none" if lg.limit is None else kvcli.plural(lg.limit, "page")
        out.append(
            f"at its close: {lg.mapped_pages:,} of {kvcli.plural(lg.num_pages, 'page')} mapped, "
            f"{lg.pinned_pages:,} pinned, limit {limit}; {kvcli.plural(lg.outstanding_jobs(), 'job')} outstanding, "
            f"{kvcli.plural(len(lg.violations), 'violation')} so far"
        )
        sys.stdout.write("\n".join(out) + "\n")
    return kvcli.OK
