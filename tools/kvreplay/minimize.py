"""``kvreplay minimize``: shrink a trace with a violation to a small trace with the same kind of it.

A user's journal holds millions of events; the bug needs a handful. The shrinking is delta
debugging (ddmin, ``_ddmin``) over *atoms* that can be removed without making the trace
ill-formed (``_atomize``). A candidate is kept only if its replay still shows the target kind and
nothing new (``_Shrinker``); ``minimize`` says in what order atoms go and how the map/unmap
decisions are treated.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import kvcli
import msgspec

from kvcached.ledger.events import (
    DECISIONS,
    BlockAlloc,
    BlockFree,
    BuildBoundary,
    Event,
    Header,
    JobBuilt,
    JobReported,
    Policy,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    WindowHold,
    WindowRelease,
)
from kvcached.ledger.findings import INVARIANTS, Violation
from kvcached.ledger.journal import JournalWriter
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.simulate import derive

from .check import run_check, witness_lines
from .timeline_text import describe_event
from .tracefile import ReplayError, Trace

# A piece of an event: (position in the trace, block id), block -1 meaning the whole event.
Piece = tuple[int, int]
Atom = tuple[Piece, ...]
WHOLE: Final = -1
SHOW_EVENTS: Final = 60

# Every code the ledger reports (kvcached.ledger's ``violate`` calls), with its invariant: a
# ``--only`` naming neither an invariant nor one of these is refused before the trace is read
# (else a typo costs a whole replay, and then says it found none). tests/test_kvreplay.py keeps it
# equal to the codes in the ledger's source.
CODES: Final[dict[str, str]] = {
    "unmap-under-job": "I1",
    "copy-of-lost-block": "I1",
    "alloc-on-unmapped": "I2",
    "unmap-with-blocks": "I2",
    "build-out-of-order": "I3",
    "double-alloc": "I3",
    "double-free": "I3",
    "duplicate-job": "I3",
    "report-unknown-job": "I3",
    "over-report": "I3",
    "page-out-of-range": "I3",
    "double-map": "I3",
    "double-unmap": "I3",
    "unknown-pool": "I3",
    "block-out-of-range": "I3",
    "job-on-unwritten-block": "I3",
    "pin-outlives-request": "I4",
    "shrink-stalled": "I4",
    "holds-block-shrink": "I4",
    "store-of-foreign-block": "I5",
}


def _kind(text: str) -> str:
    """An argparse ``type`` for ``--only``: an invariant id or a code the ledger reports."""
    if text not in INVARIANTS and text not in CODES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither an invariant ({', '.join(INVARIANTS)}) nor a violation code "
            f"({', '.join(sorted(CODES))})"
        )
    return text


class _Target:
    """Which violations a candidate must show: invariant ids or codes, each matched by one."""

    def __init__(self, specs: Sequence[str], complete: bool) -> None:
        self.specs = list(specs)
        # An unmap under a job is only half of the freed-block copy; when the original shows the
        # job completing afterwards (the late copy), the minimized trace must show it too.
        self.complete = complete

    def matches(self, spec: str, v: Violation) -> bool:
        if spec not in (v.invariant, v.code):
            return False
        return not self.complete or v.code != "unmap-under-job" or (bool(v.chain) and v.chain[-1].step == "late copy")

    def met(self, violations: Sequence[Violation]) -> bool:
        return all(any(self.matches(s, v) for v in violations) for s in self.specs)

    def __str__(self) -> str:
        return ", ".join(self.specs)


def _run(
    header: Header, policy: Policy, events: Sequence[Event], derived: bool, target: _Target, allowed: set[str] | None
) -> tuple[int | None, set[str]]:
    """Replays ``events``; returns (position where ``target`` is met or None, codes seen by then).

    Stops early at the first violation of a code outside ``allowed`` (when given).
    """
    lg = Ledger(header, policy)
    seen = 0
    codes: set[str] = set()
    stream: Iterable[Event] = derive(lg, events) if derived else events
    pos = -1
    apply = lg.apply
    for ev in stream:
        if derived:
            if type(ev) not in DECISIONS:
                pos += 1
        else:
            pos += 1
            apply(ev)
        vs = lg.violations
        if len(vs) != seen or (type(ev) is JobReported and seen):
            for v in vs[seen:]:
                if allowed is not None and v.code not in allowed:
                    return None, codes
                codes.add(v.code)
            seen = len(vs)
            if target.met(vs):
                return pos, codes
    return None, codes


def _renumber(events: Iterable[Event]) -> list[Event]:
    # The ledger insists on consecutive builds; removing a boundary must not read as disorder.
    out: list[Event] = []
    n = 0
    for ev in events:
        if type(ev) is BuildBoundary:
            out.append(BuildBoundary(n) if ev.build != n else ev)
            n += 1
        else:
            out.append(ev)
    return out


def _req_of(ev: Event) -> int | None:
    if type(ev) in (JobBuilt, RequestFinished, RequestPreempted, WindowHold, WindowRelease, RequestAdded):
        return ev.req  # type: ignore[union-attr]
    return None


@dataclasses.dataclass
class _Atoms:
    atoms: list[Atom]
    groups: dict[int, list[int]]  # request -> its atoms
    loose: list[int]  # atoms of no request


def _atomize(events: Sequence[Event]) -> _Atoms:
    """The atoms of ``events``, grouped by the request they belong to.

    NOTE: an atom is a block allocation together with its free (the per-block pieces of
    BlockAlloc and BlockFree events), a job together with all its reports, a build boundary
    (builds are renumbered afterwards so they stay consecutive: ``_renumber``), or any other
    event on its own. A RequestAdded stays exactly while some kept event names its request
    (``_rebuild``).
    """
    pieces: list[list[Piece]] = []
    owner: list[int | None] = []
    life: dict[tuple[int, int], int] = {}  # (pool, block) -> its latest allocation's atom
    open_: set[tuple[int, int]] = set()
    job_atom: dict[int, int] = {}

    def new(*ps: Piece, req: int | None = None) -> int:
        pieces.append(list(ps))
        owner.append(req)
        return len(pieces) - 1

    for pos, ev in enumerate(events):
        t = type(ev)
        if t is BlockAlloc:
            assert isinstance(ev, BlockAlloc)
            for b in ev.blocks:
                key = (ev.pool, b)
                if key in open_:
                    new((pos, b))  # a double alloc stays its own atom
                else:
                    life[key] = new((pos, b))
                    open_.add(key)
        elif t is BlockFree:
            assert isinstance(ev, BlockFree)
            for b in ev.blocks:
                key = (ev.pool, b)
                if key in open_:
                    open_.discard(key)
                    pieces[life[key]].append((pos, b))
                else:
                    new((pos, b))
        elif t is JobBuilt:
            assert isinstance(ev, JobBuilt)
            a = new((pos, WHOLE), req=ev.req)
            if ev.job not in job_atom:
                job_atom[ev.job] = a
            for pool, ids in enumerate(ev.blocks):
                for b in ids:
                    # The allocation a job copies belongs with the job's request: removing the
                    # request must take the blocks too, or the rest would be a trace of orphans.
                    la = life.get((pool, b))
                    if la is not None and owner[la] is None:
                        owner[la] = ev.req
        elif t is JobReported:
            assert isinstance(ev, JobReported)
            if ev.job in job_atom:
                pieces[job_atom[ev.job]].append((pos, WHOLE))
            else:
                new((pos, WHOLE))
        elif t is RequestAdded:
            continue  # kept exactly while its request is named (see _rebuild)
        else:
            new((pos, WHOLE), req=_req_of(ev))
    groups: dict[int, list[int]] = {}
    loose: list[int] = []
    for i, req in enumerate(owner):
        if req is None:
            loose.append(i)
        else:
            groups.setdefault(req, []).append(i)
    return _Atoms([tuple(p) for p in pieces], groups, loose)


def _rebuild(events: Sequence[Event], atoms: Sequence[Atom], keep: Iterable[int], renumber: bool) -> list[Event]:
    whole: set[int] = set()
    blocks: dict[int, set[int]] = {}
    for i in keep:
        for pos, b in atoms[i]:
            if b == WHOLE:
                whole.add(pos)
            else:
                blocks.setdefault(pos, set()).add(b)
    named = {r for pos in whole if (r := _req_of(events[pos])) is not None}
    for pos, ev in enumerate(events):
        if type(ev) is RequestAdded and ev.req in named:
            whole.add(pos)
    out: list[Event] = []
    for pos in sorted(whole | blocks.keys()):
        ev = events[pos]
        if pos in whole:
            out.append(ev)
        else:
            assert isinstance(ev, BlockAlloc | BlockFree)
            kept = blocks[pos]
            out.append(type(ev)(ev.pool, tuple(b for b in ev.blocks if b in kept)))
    return _renumber(out) if renumber else out


def _size(events: Sequence[Event]) -> tuple[int, int]:
    """What the shrinking minimizes: events first, then the block ids they name."""
    ids = 0
    for ev in events:
        if isinstance(ev, BlockAlloc | BlockFree | WindowHold):
            ids += len(ev.blocks)
        elif isinstance(ev, JobBuilt):
            ids += sum(len(b) for b in ev.blocks)
    return len(events), ids


class _Deadline(Exception):
    pass


def _ddmin(items: list[int], test: Callable[[list[int]], bool]) -> list[int]:
    """Zeller's ddmin: a 1-minimal subset of ``items`` that passes ``test`` (``items`` passes)."""
    n = 2
    while len(items) >= 2:
        size = len(items)
        chunks = [items[size * k // n : size * (k + 1) // n] for k in range(n)]
        chunks = [c for c in chunks if c]
        for c in chunks:
            if test(c):
                items, n = c, 2
                break
        else:
            for k in range(len(chunks)):
                rest = [x for j, c in enumerate(chunks) if j != k for x in c]
                if test(rest):
                    items, n = rest, max(n - 1, 2)
                    break
            else:
                if n >= len(items):
                    return items
                n = min(len(items), 2 * n)
    return items


@dataclasses.dataclass
class _Shrinker:
    """The shrinking of one trace: the test of a candidate (``cut``) and the phases that use it.

    NOTE: the test of a candidate replays it and accepts it only if it shows the target kind *and
    no kind of violation the original prefix did not show* (``allowed``). The ledger's own
    accounting checks (I3: report of an unknown job, free of a free block, a build out of order)
    are thus the well-formedness test, with no second set of rules to keep in step.
    """

    header: Header
    policy: Policy
    derived: bool
    target: _Target
    allowed: set[str]
    renumber: bool
    deadline: float
    replays: int = 0
    timed_out: bool = False

    def cut(self, events: list[Event]) -> int | None:
        """The length of the shortest prefix of ``events`` that still shows the target.

        NOTE: every replay stops at the event that completes the target, and the trace is cut
        there, so the work after the first occurrence is never repeated."""
        if time.monotonic() > self.deadline:
            self.timed_out = True
            raise _Deadline
        self.replays += 1
        pos, _ = _run(self.header, self.policy, events, self.derived, self.target, self.allowed)
        return None if pos is None else pos + 1

    def atoms_phase(self, events: list[Event], by_request: bool) -> list[Event]:
        parts = _atomize(events)
        if by_request:
            units = [parts.groups[r] for r in sorted(parts.groups)]
            fixed = parts.loose
        else:
            units = [[i] for i in range(len(parts.atoms))]
            fixed = []
        best = events

        def test(keep: list[int]) -> bool:
            nonlocal best
            chosen = [*fixed, *(a for u in keep for a in units[u])]
            cand = _rebuild(events, parts.atoms, chosen, self.renumber)
            n = self.cut(cand)
            if n is not None and _size(cand[:n]) < _size(best):
                best = cand[:n]
            return n is not None

        with contextlib.suppress(_Deadline):
            _ddmin(list(range(len(units))), test)
        return best

    def blocks_phase(self, events: list[Event]) -> list[Event]:
        """Shrinks the block lists of jobs and window holds, one event at a time."""
        for pos in range(len(events)):
            ev = events[pos]
            if isinstance(ev, JobBuilt):
                pairs = [(pool, b) for pool, ids in enumerate(ev.blocks) for b in ids]
            elif isinstance(ev, WindowHold):
                pairs = [(0, b) for b in ev.blocks]
            else:
                continue
            if len(pairs) < 2:
                continue

            def make(keep: list[int], ev: Event = ev, pairs: list[tuple[int, int]] = pairs) -> Event:
                chosen = [pairs[i] for i in keep]
                if isinstance(ev, JobBuilt):
                    per = tuple(tuple(b for p, b in chosen if p == pool) for pool in range(len(ev.blocks)))
                    return msgspec.structs.replace(ev, blocks=per)
                assert isinstance(ev, WindowHold)
                return msgspec.structs.replace(ev, blocks=tuple(b for _, b in chosen))

            def test(
                keep: list[int], pos: int = pos, make: Callable[[list[int]], Event] = make, events: list[Event] = events
            ) -> bool:
                cand = [*events[:pos], make(keep), *events[pos + 1 :]]
                return self.cut(cand) is not None

            try:
                keep = _ddmin(list(range(len(pairs))), test)
            except _Deadline:
                return events
            events = [*events[:pos], make(keep), *events[pos + 1 :]]
        return events


@dataclasses.dataclass
class MinimizeResult:
    events: list[Event]  # the minimized trace as written: inputs and decisions
    header: Header
    derived: bool
    target: str
    events_read: int  # events read from the trace: up to where the target was met
    stopped_early: bool  # the target was met before the end of the trace
    prefix_events: int
    replays: int
    seconds: float
    timed_out: bool


def _read_prefix(
    path: str, only: Sequence[str], policy: str | None
) -> tuple[Header, list[Event], bool, list[str], bool]:
    """Streams the trace until the target is met the way ``check`` would see it.

    Returns the header, the events read, whether the trace records decisions, the target
    (``only``, else the code of the first violation; empty if there is none) and whether reading
    stopped before the end. Reading stops there because nothing after
    the violation can be part of its witness, and a long trace need not be held in memory.
    """
    with Trace(path, progress=False) as trace:
        header = trace.header
        lg = Ledger(header, Policy(policy) if policy else header.policy)
        events: list[Event] = []
        recorded: bool | None = None
        specs = list(only)
        seen = 0
        for batch in trace.batches():
            for ev in batch:
                events.append(ev)
                t = type(ev)
                if recorded is None and (t is BlockAlloc or t in DECISIONS):
                    # A trace with decisions maps a page before the first block on it is handed out.
                    recorded = t in DECISIONS
                if recorded is False:
                    deque(derive(lg, (ev,)), maxlen=0)
                else:
                    # Before the first alloc or decision no page is mapped: deriving adds nothing.
                    lg.apply(ev)
                vs = lg.violations
                if len(vs) != seen or (t is JobReported and seen):
                    seen = len(vs)
                    if not specs:
                        specs.append(vs[0].code)
                    if _Target(specs, complete=True).met(vs):
                        return header, events, bool(recorded), specs, True
        return header, events, bool(recorded), specs, False


def minimize(
    path: str,
    out: str,
    *,
    only: Sequence[str] = (),
    policy: str | None = None,
    decisions: str = "auto",
    seconds: float = 60.0,
) -> MinimizeResult:
    """Shrink the trace at ``path`` to one that still shows the target, and write it to ``out``.

    NOTE: atoms are first removed a request at a time (its jobs, holds, lifecycle events and the
    block allocations its jobs copy), then one by one, then the block lists of the remaining jobs
    and holds are shrunk.

    NOTE: decisions are re-derived under the trace's policy by the eager allocator at each test
    when that reproduces the target (the usual case, and it keeps map/unmap consistent with
    whatever inputs remain). Otherwise the recorded decisions are kept and shrunk as atoms like
    the inputs.
    """
    t0 = time.monotonic()
    header, events, recorded, specs, early = _read_prefix(path, only, policy)
    pol = Policy(policy) if policy else header.policy
    inputs = [ev for ev in events if type(ev) not in DECISIONS]
    if not specs and recorded and decisions != "recorded":
        # Clean as recorded; the question may be what another policy would have done.
        lg = Ledger(header, pol)
        for _ in derive(lg, inputs):
            if lg.violations:
                specs = [lg.violations[0].code]
                break
    if not specs:
        raise ReplayError(f"{path}: no violation to minimize: clean under {pol.value} (kvreplay check says so too)")
    modes: list[bool] = []
    if decisions in ("auto", "derive"):
        modes.append(True)
    if decisions in ("auto", "recorded") and recorded:
        modes.append(False)
    chosen: tuple[bool, _Target, int, set[str]] | None = None
    for derived in modes:
        for complete in (True, False):
            target = _Target(specs, complete)
            pos, codes = _run(header, pol, inputs if derived else events, derived, target, None)
            if pos is not None:
                chosen = (derived, target, pos + 1, codes)
                break
        if chosen:
            break
    if chosen is None:
        what = "no recorded decisions to keep" if decisions == "recorded" and not recorded else "not reproduced"
        raise ReplayError(f"{path}: no violation of {', '.join(specs)} to minimize ({what}; --decisions {decisions})")
    derived, target, n, allowed = chosen
    prefix = (inputs if derived else events)[:n]
    renumber = "build-out-of-order" not in specs
    shrinker = _Shrinker(header, pol, derived, target, allowed, renumber, t0 + seconds)
    cur = prefix
    # Shrinking a job's block list can free block allocations for the atom phase, and removing
    # atoms can make blocks removable: go round until a round changes nothing.
    for _ in range(4):
        before = cur
        if not shrinker.timed_out:
            cur = shrinker.atoms_phase(cur, by_request=True)
        if not shrinker.timed_out:
            cur = shrinker.atoms_phase(cur, by_request=False)
        if not shrinker.timed_out:
            cur = shrinker.blocks_phase(cur)
        if cur == before or shrinker.timed_out:
            break
    final = list(derive(Ledger(header, pol), cur)) if derived else cur
    out_header = msgspec.structs.replace(
        header,
        policy=pol,
        meta={**header.meta, "minimized_from": os.path.basename(path), "minimized_target": str(target)},
    )
    _write(out, out_header, final)
    return MinimizeResult(
        events=final,
        header=out_header,
        derived=derived,
        target=str(target),
        events_read=len(events),
        stopped_early=early,
        prefix_events=len(prefix),
        replays=shrinker.replays,
        seconds=time.monotonic() - t0,
        timed_out=shrinker.timed_out,
    )


def _write(path: str, header: Header, events: list[Event]) -> None:
    with JournalWriter.create(path, header) as w:
        for i in range(0, len(events), 4096):
            w.append(events[i : i + 4096])


def render(res: MinimizeResult, src: str, out: str) -> str:
    buf = io.StringIO()
    how = f"decisions re-derived under {res.header.policy.value}" if res.derived else "recorded decisions kept"
    print(f"{src}: target {res.target}; {how}", file=buf)
    n_dec = sum(1 for ev in res.events if type(ev) in DECISIONS)
    stop = " (stopped at the time limit)" if res.timed_out else ""
    what, p = ("input" if res.derived else "event"), kvcli.plural
    upto = " (up to the violation)" if res.stopped_early else ""
    print(
        f"read {p(res.events_read, 'event')}{upto}; shrank the {p(res.prefix_events, what)} before it to "
        f"{p(len(res.events), 'event')} ({p(len(res.events) - n_dec, 'input')}, {p(n_dec, 'decision')}) in "
        f"{res.seconds:.1f} s, {p(res.replays, 'replay')}{stop}",
        file=buf,
    )
    if len(res.events) <= SHOW_EVENTS:
        for i, ev in enumerate(res.events):
            print(f"  {i:>3}  {describe_event(ev)}", file=buf)
    check = run_check(out, progress=False)
    print(f"wrote {out}; kvreplay check {out}:", file=buf)
    for v in check.ledger.violations[:3]:
        print("\n".join(witness_lines(v, "  ")), file=buf)
    return buf.getvalue()


def cmd_minimize(args: argparse.Namespace) -> int:
    res = minimize(
        args.trace,
        args.output,
        only=args.only or (),
        policy=args.policy,
        decisions=args.decisions,
        seconds=args.max_seconds,
    )
    if args.json:
        decisions = sum(1 for ev in res.events if type(ev) in DECISIONS)
        doc = {
            "file": args.output,
            "target": res.target,
            "derived": res.derived,
            "events_read": res.events_read,
            "events": len(res.events),
            "decisions": decisions,
            "replays": res.replays,
            "seconds": round(res.seconds, 3),
            "timed_out": res.timed_out,
        }
        sys.stdout.write(msgspec.json.encode(doc).decode() + "\n")
        return 0
    sys.stdout.write(render(res, args.trace, args.output))
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "minimize",
        help="shrink a trace with a violation to a small well-formed one with the same kind of violation",
        description="Shrink TRACE to a small, well-formed trace that still shows the same kind of violation (by "
        "default the kind of the first one `check` reports) and write it to OUT. Exit 0 when written, 1 when there "
        "is nothing to minimize or the trace cannot be read, 2 when the command line is wrong.",
    )
    p.add_argument("trace", metavar="TRACE", help="a kvcached journal (.kvj)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="where to write the minimized trace")
    p.add_argument(
        "--only",
        action="append",
        type=_kind,
        metavar="KIND",
        help=f"keep this kind: an invariant ({', '.join(INVARIANTS)}) or a code such as unmap-under-job; repeatable",
    )
    p.add_argument("--policy", choices=[p.value for p in Policy], help="policy to replay under (default: recorded)")
    p.add_argument(
        "--decisions",
        choices=["auto", "derive", "recorded"],
        default="auto",
        help="re-derive map/unmap decisions at each test (derive), keep and shrink the recorded ones (recorded), "
        "or derive when that shows the target (auto, the default)",
    )
    p.add_argument(
        "--max-seconds",
        type=kvcli.positive_seconds(7 * 86_400),
        default=60.0,
        metavar="S",
        help="stop shrinking after S seconds",
    )
    p.add_argument("--json", action="store_true", help="what was written, as JSON: file, target, events, replays")
    p.set_defaults(func=cmd_minimize)
