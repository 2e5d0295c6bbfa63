"""``kvreplay show``: the timeline of one page, job or request, as the ledger saw it.

A witness says *that* a page went away under a job; the timeline says how it got there: every
event that names the page (its blocks allocated and freed, jobs over it and their reports,
window holds, the allocator's map and unmap), every change of its state that no event names
(a grace pin ending at a build boundary), and every violation about it, each line with its
event index and build so that it can be matched against ``check``. The replay is the same as
``check``'s (recorded decisions unless ``--derive``) and goes through the whole trace, because
the page's state at the end is part of the answer; only the printing is limited.
"""

from __future__ import annotations

import argparse
import io
import sys

import kvcli
import msgspec

from kvcached.ledger.events import (
    BlockAlloc,
    BlockFree,
    Event,
    JobBuilt,
    JobFailed,
    JobReported,
    PageMapped,
    PageUnmapped,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    WindowHold,
    WindowRelease,
)
from kvcached.ledger.findings import Violation
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.simulate import derive

from .timeline_text import describe_event as _describe
from .timeline_text import when
from .tracefile import ReplayError, Trace, start_ledger


def _pages(lg: Ledger, pool: int, blocks: tuple[int, ...]) -> set[int]:
    if pool >= len(lg.header.pools):
        return set()
    nb = lg.header.pools[pool].num_blocks
    return {lg.page_of(pool, b) for b in blocks if b < nb}


def _job_pages(lg: Ledger, ev: JobBuilt) -> set[int]:
    return {p for pool, ids in enumerate(ev.blocks) for p in _pages(lg, pool, ids)}


class _Focus:
    """What one timeline follows; subclasses say which events and violations belong to it."""

    title = ""
    # A job or request exists only through the events that name it: one no event names is not in
    # the trace, and an empty timeline of it would read as one that is there and idle. A page is
    # there by the header's geometry (checked up front), named or not.
    needs_an_event = False
    named = False  # set by ``timeline``: some event or violation names it

    def start(self, lg: Ledger) -> None:
        """Takes what a ledger restored from a snapshot already knows of it (none otherwise)."""

    def relevant(self, lg: Ledger, ev: Event) -> bool:
        raise NotImplementedError

    def about(self, v: Violation) -> bool:
        raise NotImplementedError

    def state(self, lg: Ledger) -> str:
        return ""

    def final(self, lg: Ledger) -> str:
        return self.state(lg)


class _Page(_Focus):
    def __init__(self, page: int) -> None:
        self.page = page
        self.title = f"page {page}"
        self.jobs: set[int] = set()
        self.holders: set[int] = set()

    def relevant(self, lg: Ledger, ev: Event) -> bool:
        p = self.page
        if isinstance(ev, BlockAlloc | BlockFree):
            return p in _pages(lg, ev.pool, ev.blocks)
        if isinstance(ev, JobBuilt):
            if p in _job_pages(lg, ev):
                self.jobs.add(ev.job)
                return True
            return False
        if isinstance(ev, JobReported | JobFailed):
            return ev.job in self.jobs
        if isinstance(ev, PageMapped | PageUnmapped):
            return ev.page == p
        if isinstance(ev, WindowHold):
            if p in _pages(lg, ev.pool, ev.blocks):
                self.holders.add(ev.req)
                return True
            return False
        if isinstance(ev, WindowRelease | RequestFinished):
            return ev.req in self.holders
        return False

    def about(self, v: Violation) -> bool:
        return v.page == self.page

    def state(self, lg: Ledger) -> str:
        p = self.page
        parts = ["mapped" if lg.is_mapped(p) else "unmapped", kvcli.plural(lg.allocated_blocks(p), "block")]
        if lg.is_pinned(p):
            parts.append("pinned")
        if lg.is_releasable(p):
            parts.append("releasable")
        return ", ".join(parts)

    def final(self, lg: Ledger) -> str:
        return lg.why(self.page).describe()


class _Job(_Focus):
    needs_an_event = True

    def __init__(self, job: int) -> None:
        self.job = job
        self.title = f"job {job}"
        self.pages: set[int] = set()
        self.built = False
        self.reported = 0
        self.workers = 0
        self.failed = False  # a worker reported the copy failed (JobFailed)

    def start(self, lg: Ledger) -> None:
        st = lg.tables.jobs.get(self.job)  # outstanding at the snapshot: built before it
        if st is not None:
            self.pages, self.workers, self.reported = set(st[2]), st[3], st[4]
            self.built = self.named = True

    def relevant(self, lg: Ledger, ev: Event) -> bool:
        if isinstance(ev, JobBuilt) and ev.job == self.job:
            self.pages = _job_pages(lg, ev)
            self.built, self.reported, self.workers = True, 0, ev.workers
            return True
        if isinstance(ev, JobReported) and ev.job == self.job:
            self.reported += ev.count
            return True
        if isinstance(ev, JobFailed) and ev.job == self.job:
            self.failed = True
            return True
        if not self.built or self.reported >= self.workers:
            return False
        # While the job is outstanding, what happens to its pages is its story.
        if isinstance(ev, BlockFree):
            return bool(self.pages & _pages(lg, ev.pool, ev.blocks))
        if isinstance(ev, PageMapped | PageUnmapped):
            return ev.page in self.pages
        return False

    def about(self, v: Violation) -> bool:
        return v.job == self.job

    def state(self, lg: Ledger) -> str:
        if not self.built:
            return "not built"
        if self.reported >= self.workers:
            # Once complete, its pages are no longer its story: freeze the state line.
            return f"reported {self.reported}/{self.workers}: complete" + (", failed" if self.failed else "")
        pages = ", ".join(f"{p}{'' if lg.is_mapped(p) else ' (unmapped)'}" for p in sorted(self.pages)[:8])
        more = f" +{len(self.pages) - 8} more" if len(self.pages) > 8 else ""
        return f"reported {self.reported}/{self.workers}; pages {pages or 'none'}{more}"


class _Request(_Focus):
    needs_an_event = True

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.req: int | None = int(spec) if spec.isdigit() else None
        self.name: str | None = None if spec.isdigit() else spec
        self.title = f"request {spec}"
        self.jobs: dict[int, int] = {}  # job -> reports still awaited

    def start(self, lg: Ledger) -> None:
        # Added before the snapshot and still live there (itself or its jobs): its name is known.
        names = lg.tables.names
        req = self.req if self.req in names else next((r for r, n in names.items() if n == self.name), None)
        if req is not None:
            self.req, self.name, self.named = req, names[req], True
            self.title = f"request {self.name} (r{req})"
            self.jobs = {j: st[3] - st[4] for j, st in lg.tables.jobs.items() if st[1] == req}

    def relevant(self, lg: Ledger, ev: Event) -> bool:
        if isinstance(ev, RequestAdded) and (ev.name == self.name or ev.req == self.req):
            self.req, self.name = ev.req, ev.name
            self.title = f"request {ev.name} (r{ev.req})"
            return True
        if self.req is None:
            return False
        if isinstance(ev, JobBuilt) and ev.req == self.req:
            self.jobs[ev.job] = ev.workers
            return True
        if isinstance(ev, JobReported) and ev.job in self.jobs:
            self.jobs[ev.job] -= ev.count
            return True
        if isinstance(ev, JobFailed):
            return ev.job in self.jobs
        if isinstance(ev, RequestFinished | RequestPreempted | WindowHold | WindowRelease):
            return ev.req == self.req
        return False

    def about(self, v: Violation) -> bool:
        return (self.name is not None and v.request == self.name) or (v.job is not None and v.job in self.jobs)

    def state(self, lg: Ledger) -> str:
        if self.req is None:
            return "not named (yet)"
        waiting = sum(1 for n in self.jobs.values() if n > 0)
        return f"{kvcli.plural(len(self.jobs), 'job')}, {waiting} not fully reported"


def timeline(
    trace: Trace, lg: Ledger, skip: int, focus: _Focus, derived: bool, limit: int, as_json: bool = False
) -> str:
    out = io.StringIO()
    items: list[dict[str, object]] = []  # what --json prints: the same lines, as fields
    lines = hidden = 0
    seen = len(lg.violations)
    before = focus.state(lg)
    base = trace.header.clock_base_unix

    def emit(text: str, item: dict[str, object]) -> None:
        nonlocal lines, hidden
        if limit <= 0 or lines < limit:
            print(text, file=out)
            items.append(item)
            lines += 1
        else:
            hidden += 1

    for batch in trace.batches(skip, "showing"):
        stream = derive(lg, batch) if derived else batch
        for ev in stream:
            if not derived:
                lg.apply(ev)
            # derive yields each event after applying it, so both ways the event is the last applied.
            index = lg.index - 1
            build = lg.build_of(index)
            hit = focus.relevant(lg, ev)
            focus.named |= hit
            after = focus.state(lg)
            if hit or after != before:
                text = _describe(ev, base)
                shown = text if hit else f"({text})"
                item = {"index": index, "build": build, "event": text, "names_it": hit, "state": after}
                emit(f"  event {index:>7}  build {build:>5}  {shown}  -> {after}", item)
            before = after
            if len(lg.violations) != seen:
                for v in lg.violations[seen:]:
                    if focus.about(v):
                        focus.named = True
                        emit(f"  !! {v.one_line()}", {"violation": v.one_line()})
                seen = len(lg.violations)
    if as_json:
        doc = {
            "trace": trace.path,
            "focus": focus.title,
            "events_replayed": lg.index,
            "policy": lg.policy.value,
            "lines": items,
            "hidden": hidden,
            "end": focus.final(lg),
        }
        return msgspec.json.encode(doc).decode() + "\n"
    if hidden:
        print(f"  ... and {kvcli.plural(hidden, 'more line')} (--limit 0 shows all)", file=out)
    head = f"{trace.path}: {focus.title}, {kvcli.plural(lg.index, 'event')} replayed under {lg.policy.value}\n"
    return head + out.getvalue() + f"at the end: {focus.final(lg)}\n"


def cmd_show(args: argparse.Namespace) -> int:
    if args.at is not None:
        from .at import show_at

        return show_at(args)
    with Trace(args.trace, progress=not args.no_progress) as trace:
        lg, skip = start_ledger(trace, args.policy, args.from_snapshot)
        focus: _Focus
        if args.page is not None:
            if not 0 <= args.page < lg.num_pages:
                has = kvcli.plural(lg.num_pages, "page")
                raise ReplayError(f"{args.trace}: there is no page {args.page}; the trace has {has}")
            focus = _Page(args.page)
        elif args.job is not None:
            focus = _Job(args.job)
        else:
            focus = _Request(args.request)
        focus.start(lg)
        text = timeline(trace, lg, skip, focus, args.derive, args.limit, args.json)
        if focus.needs_an_event and not focus.named:
            events = kvcli.plural(lg.index - skip, "event")
            after = f" after the snapshot at event {skip:,}" if skip else ""
            raise ReplayError(f"{args.trace}: the trace has no {focus.title}: none of its {events}{after} names it")
        sys.stdout.write(text)
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "show",
        parents=[common],
        help="the timeline of one page, job or request",
        description="Replay TRACE and print every event about one page, job or request, with the state after it "
        "(for a page: mapped, blocks allocated, pinned, releasable) and every violation about it. Lines in "
        "parentheses are events that do not name it but changed its state (a grace pin ending at a build).",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--page", type=kvcli.whole(0, "a page id"), metavar="P", help="a page id, as in a witness")
    what.add_argument("--job", type=kvcli.whole(0, "a job id"), metavar="J", help="a job id")
    what.add_argument("--request", metavar="R", help="a request: the engine's id (e.g. cmpl-...) or the small integer")
    what.add_argument(
        "--at",
        type=when,
        metavar="TIME",
        help="the build that ran at TIME (2026-12-03T14:05:00 local, with an offset, or Unix seconds): "
        "its events and the ledger's state, for an incident seen on a dashboard (needs a served engine's journal)",
    )
    p.add_argument(
        "--limit",
        type=kvcli.whole(0, "a number of lines"),
        default=200,
        metavar="N",
        help="lines to print (0: all; default 200)",
    )
    p.add_argument("--json", action="store_true", help="the same lines as JSON fields (index, build, event, state)")
    p.set_defaults(func=cmd_show)
