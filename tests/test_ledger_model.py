"""The ledger against a deliberately naive reference model, driven by Hypothesis.

``NaiveModel`` keeps every event it was given and answers each question by replaying the whole
history from the first event: no pin counters, no due lists, no fresh list, no incremental
state. It is written from the specification (``Ledger``'s docstring), not from the
ledger's code, so that the two can only agree by both being right.

The generators below produce LEGAL sequences only (no double alloc, no unmap of a page the
model does not call releasable under the policy, builds in order, no over-report, request ids
never reused once finished): these tests are about the *derivation* of the releasable set and of
the pin reasons, and about snapshot/restore, not about detecting violations. The one exception
is the legacy policy: unmapping a legacy-releasable page that a job still pins is exactly the
bug the ledger policy exists to fix, and the ledger reports it as I1 ``unmap-under-job``; the
model predicts those reports and the test checks they match one for one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcached.ledger.events import (
    BlockAlloc,
    BlockFree,
    BuildBoundary,
    Event,
    Header,
    JobBuilt,
    JobKind,
    JobReported,
    PageMapped,
    PageUnmapped,
    Policy,
    PoolGeometry,
    RequestAdded,
    RequestFinished,
    WindowHold,
    WindowRelease,
    describe,
)
from kvcached.ledger.findings import PageStatus, PinReason
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.state import LedgerSnapshot

# Pool 0: 4 blocks a page, 10 blocks -> 3 pages (the last one half used).
# Pool 1: 2 blocks a page, 5 blocks -> 3 pages (the last one half used).
PAGE_BYTES = 4096
POOLS = (PoolGeometry(block_bytes=1024, num_blocks=10), PoolGeometry(block_bytes=2048, num_blocks=5))
JOB_IDS = range(48)  # fresh job ids are drawn from here, not in order, so that id order matters
REQ_IDS = range(16)
# Liveness (I4) is not what these tests are about: a job may legally stay outstanding for many
# builds after its request finished, as far as derivation is concerned.
NO_LIVENESS = 10**6

FAST = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def header_for(policy: Policy, pools: tuple[PoolGeometry, ...] = POOLS, page_bytes: int = PAGE_BYTES) -> Header:
    return Header(page_bytes=page_bytes, pools=pools, workers=2, policy=policy)


def new_ledger(header: Header) -> Ledger:
    return Ledger(header, liveness_builds=NO_LIVENESS)


# --- the reference model -----------------------------------------------------------------------


@dataclass
class NaiveJob:
    kind: JobKind
    req: int
    pages: frozenset[int]
    workers: int
    since: int
    reported: int = 0


@dataclass
class Facts:
    """What one replay of the whole history established; thrown away after each question."""

    open_build: int = 0
    allocated: set[tuple[int, int]] = field(default_factory=set)  # (pool, block)
    mapped: set[int] = field(default_factory=set)
    names: dict[int, str] = field(default_factory=dict)
    jobs: dict[int, NaiveJob] = field(default_factory=dict)  # outstanding only
    grace: dict[int, int] = field(default_factory=dict)  # page -> open build at the emptying free
    holds: dict[tuple[int, int], int] = field(default_factory=dict)  # (page, req) -> since build
    seen_jobs: set[int] = field(default_factory=set)
    seen_reqs: set[int] = field(default_factory=set)
    finished_reqs: set[int] = field(default_factory=set)
    unmaps_under_job: list[tuple[int, int, int]] = field(default_factory=list)  # (index, page, job)


class NaiveModel:
    """Keeps the full event list; every answer is a replay of it from the beginning."""

    def __init__(self, header: Header, policy: Policy) -> None:
        self.header = header
        self.policy = Policy(policy)
        self.events: list[Event] = []

    def apply(self, event: Event) -> None:
        self.events.append(event)

    # geometry

    def bpp(self, pool: int) -> int:
        return self.header.page_bytes // self.header.pools[pool].block_bytes

    def first_page(self, pool: int) -> int:
        pools = self.header.pools
        return sum(math.ceil(pools[i].num_blocks / self.bpp(i)) for i in range(pool))

    @property
    def num_pages(self) -> int:
        return self.first_page(len(self.header.pools))

    def page(self, pool: int, block: int) -> int:
        return self.first_page(pool) + block // self.bpp(pool)

    # the replay

    def facts(self) -> Facts:
        f = Facts()
        for index, ev in enumerate(self.events):
            if isinstance(ev, BlockAlloc):
                for b in ev.blocks:
                    f.allocated.add((ev.pool, b))
            elif isinstance(ev, BlockFree):
                for b in ev.blocks:
                    f.allocated.discard((ev.pool, b))
                    p = self.page(ev.pool, b)
                    if self.count_allocated(f, p) == 0:
                        f.grace[p] = f.open_build
            elif isinstance(ev, PageMapped):
                f.mapped.add(ev.page)
            elif isinstance(ev, PageUnmapped):
                for job in sorted(f.jobs):
                    if ev.page in f.jobs[job].pages:
                        f.unmaps_under_job.append((index, ev.page, job))
                f.mapped.discard(ev.page)
            elif isinstance(ev, BuildBoundary):
                f.grace = {p: b for p, b in f.grace.items() if b != ev.build}
                f.open_build = ev.build + 1
            elif isinstance(ev, JobBuilt):
                pages = frozenset(self.page(pool, b) for pool, ids in enumerate(ev.blocks) for b in ids)
                f.jobs[ev.job] = NaiveJob(JobKind(ev.kind), ev.req, pages, ev.workers, f.open_build)
                f.seen_jobs.add(ev.job)
                f.seen_reqs.add(ev.req)
            elif isinstance(ev, JobReported):
                job = f.jobs[ev.job]
                job.reported += ev.count
                if job.reported >= job.workers:
                    del f.jobs[ev.job]
            elif isinstance(ev, WindowHold):
                for b in ev.blocks:
                    f.holds.setdefault((self.page(ev.pool, b), ev.req), f.open_build)
                f.seen_reqs.add(ev.req)
            elif isinstance(ev, WindowRelease | RequestFinished):
                f.holds = {k: since for k, since in f.holds.items() if k[1] != ev.req}
                f.seen_reqs.add(ev.req)
                if isinstance(ev, RequestFinished):
                    f.finished_reqs.add(ev.req)
            elif isinstance(ev, RequestAdded):
                f.names[ev.req] = ev.name
                f.seen_reqs.add(ev.req)
        return f

    # answers computed from one replay

    def count_allocated(self, f: Facts, page: int) -> int:
        return sum(1 for pool, b in f.allocated if self.page(pool, b) == page)

    def pins_in(self, f: Facts, page: int) -> tuple[PinReason, ...]:
        def name(req: int) -> str:
            return f.names.get(req, f"r{req}")

        pins = [
            PinReason(
                kind="job",
                since_build=j.since,
                job=job,
                job_kind="store" if j.kind == JobKind.STORE else "load",
                request=name(j.req),
                waiting_workers=j.workers - j.reported,
            )
            for job, j in sorted(f.jobs.items())
            if page in j.pages
        ]
        if page in f.grace:
            pins.append(PinReason(kind="grace", since_build=f.grace[page], until_build=f.grace[page]))
        pins += [
            PinReason(kind="window", since_build=since, request=name(req))
            for (p, req), since in sorted(f.holds.items(), key=lambda kv: kv[0][1])
            if p == page
        ]
        return tuple(pins)

    def releasable_in(self, f: Facts) -> set[int]:
        return {
            p
            for p in f.mapped
            if self.count_allocated(f, p) == 0 and (self.policy is Policy.LEGACY or not self.pins_in(f, p))
        }

    def status_in(self, f: Facts, page: int) -> PageStatus:
        return PageStatus(
            page=page,
            mapped=page in f.mapped,
            allocated_blocks=self.count_allocated(f, page),
            releasable=page in self.releasable_in(f),
            policy=self.policy.value,
            pins=self.pins_in(f, page),
        )

    def pinned_in(self, f: Facts) -> set[int]:
        return {p for p in range(self.num_pages) if self.pins_in(f, p)}

    # the public questions: each one replays the whole history

    def releasable(self) -> set[int]:
        return self.releasable_in(self.facts())

    def pinned(self) -> set[int]:
        return self.pinned_in(self.facts())

    def why(self, page: int) -> PageStatus:
        return self.status_in(self.facts(), page)

    def expected_violations(self) -> list[tuple[int, str, str, int, int]]:
        """Only the legacy policy's unmaps under a job, one per (unmap, job) in job order."""
        return self.violations_in(self.facts())

    def violations_in(self, f: Facts) -> list[tuple[int, str, str, int, int]]:
        return [(i, "I1", "unmap-under-job", p, job) for i, p, job in f.unmaps_under_job]


# --- legal moves, shared by the state machine and the history generator --------------------------

Draw = Callable[[st.SearchStrategy[Any]], Any]


def unmapped_pages(m: NaiveModel, f: Facts) -> list[int]:
    return [p for p in range(m.num_pages) if p not in f.mapped]


def free_blocks(m: NaiveModel, f: Facts, pool: int) -> list[int]:
    return [
        b
        for b in range(m.header.pools[pool].num_blocks)
        if (pool, b) not in f.allocated and m.page(pool, b) in f.mapped
    ]


def allocated_of(f: Facts, pool: int) -> list[int]:
    return sorted(b for q, b in f.allocated if q == pool)


def active_reqs(f: Facts) -> list[int]:
    return sorted(f.seen_reqs - f.finished_reqs)


def fresh_reqs(f: Facts) -> list[int]:
    return [r for r in REQ_IDS if r not in f.seen_reqs]


def some(draw: Draw, items: list[int], most: int = 3) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.sampled_from(items), min_size=1, max_size=most, unique=True)))


def draw_req(draw: Draw, f: Facts) -> tuple[int, list[Event]]:
    """An active request, or a fresh one, sometimes named by ``RequestAdded`` first."""
    active, fresh = active_reqs(f), fresh_reqs(f)
    if active and (not fresh or draw(st.booleans())):
        return draw(st.sampled_from(active)), []
    req = draw(st.sampled_from(fresh))
    if draw(st.booleans()):
        return req, [RequestAdded(req=req, name=f"cmpl-{req}-{draw(st.sampled_from('xyz'))}")]
    return req, []


def can_map(m: NaiveModel, f: Facts) -> bool:
    return bool(unmapped_pages(m, f))


def move_map(draw: Draw, m: NaiveModel, f: Facts) -> list[Event]:
    return [PageMapped(page=draw(st.sampled_from(unmapped_pages(m, f))))]


def can_alloc(m: NaiveModel, f: Facts) -> bool:
    return any(free_blocks(m, f, pool) for pool in range(len(m.header.pools)))


def move_alloc(draw: Draw, m: NaiveModel, f: Facts) -> list[Event]:
    pool = draw(st.sampled_from([q for q in range(len(m.header.pools)) if free_blocks(m, f, q)]))
    return [BlockAlloc(pool=pool, blocks=some(draw, free_blocks(m, f, pool)))]


def can_free(m: NaiveModel, f: Facts) -> bool:
    return bool(f.allocated)


def move_free(draw: Draw, m: NaiveModel, f: Facts) -> list[Event]:
    pool = draw(st.sampled_from(sorted({q for q, _ in f.allocated})))
    return [BlockFree(pool=pool, blocks=some(draw, allocated_of(f, pool)))]


def can_build_job(m: NaiveModel, f: Facts) -> bool:
    return bool(f.allocated) and len(f.seen_jobs) < len(JOB_IDS) and bool(active_reqs(f) or fresh_reqs(f))


def move_build_job(draw: Draw, m: NaiveModel, f: Facts) -> list[Event]:
    npools = len(m.header.pools)
    pools = some(draw, sorted({q for q, _ in f.allocated}), most=2)
    per_pool = {q: some(draw, allocated_of(f, q)) for q in pools}
    blocks = tuple(per_pool.get(q, ()) for q in range(npools))
    if draw(st.booleans()):  # a producer may leave out trailing empty pools
        while blocks and not blocks[-1]:
            blocks = blocks[:-1]
    job = draw(st.sampled_from([j for j in JOB_IDS if j not in f.seen_jobs]))
    req, named = draw_req(draw, f)
    kind = draw(st.sampled_from(JobKind))
    workers = draw(st.integers(1, 2))
    return [*named, JobBuilt(job=job, kind=kind, req=req, blocks=blocks, workers=workers)]


def can_report(m: NaiveModel, f: Facts) -> bool:
    return bool(f.jobs)


def move_report(draw: Draw, m: NaiveModel, f: Facts) -> list[Event]:
    return [JobReported(job=draw(st.sampled_from(sorted(f.jobs))), count=1)]


def can_hold(m: NaiveModel, f: Facts) -> bool:
    return bool(allocated_of(f, 1)) and bool(active_reqs(f) or fresh_reqs(f))


def move_hold(draw: Draw, m: NaiveModel, f: Facts) -> list[Event]:
    blocks = some(draw, allocated_of(f, 1))
    req, named = draw_req(draw, f)
    return [*named, WindowHold(req=req, pool=1, blocks=blocks)]


def can_end_request(m: NaiveModel, f: Facts) -> bool:
    return bool(active_reqs(f))


def move_release(draw: Draw, m: NaiveModel, f: Facts) -> list[Event]:
    return [WindowRelease(req=draw(st.sampled_from(active_reqs(f))))]


def move_finish(draw: Draw, m: NaiveModel, f: Facts) -> list[Event]:
    return [RequestFinished(req=draw(st.sampled_from(active_reqs(f))))]


def can_boundary(m: NaiveModel, f: Facts) -> bool:
    return True


def move_boundary(draw: Draw, m: NaiveModel, f: Facts) -> list[Event]:
    return [BuildBoundary(build=f.open_build)]


def can_unmap(m: NaiveModel, f: Facts) -> bool:
    return bool(m.releasable_in(f))


def move_unmap(draw: Draw, m: NaiveModel, f: Facts) -> list[Event]:
    return [PageUnmapped(page=draw(st.sampled_from(sorted(m.releasable_in(f)))))]


MOVES = (
    (can_map, move_map),
    (can_alloc, move_alloc),
    (can_free, move_free),
    (can_build_job, move_build_job),
    (can_report, move_report),
    (can_hold, move_hold),
    (can_end_request, move_release),
    (can_end_request, move_finish),
    (can_boundary, move_boundary),
    (can_unmap, move_unmap),
)


@st.composite
def legal_history(draw: Draw, policy: Policy, max_steps: int = 40) -> tuple[Header, list[Event]]:
    header = header_for(policy)
    model = NaiveModel(header, policy)
    for _ in range(draw(st.integers(0, max_steps))):
        f = model.facts()
        _can, move = draw(st.sampled_from([mv for mv in MOVES if mv[0](model, f)]))
        for ev in move(draw, model, f):
            model.apply(ev)
    return header, model.events


# --- comparing a ledger with the model -----------------------------------------------------------


def violation_keys(lg: Ledger) -> list[tuple[int, str, str, int | None, int | None]]:
    return [(v.index, v.invariant, v.code, v.page, v.job) for v in lg.violations]


@dataclass(frozen=True)
class Expected:
    """The model's answers to every question, asked once per check and compared to each ledger."""

    policy: Policy
    num_pages: int
    releasable: set[int]
    pinned: set[int]
    why: list[PageStatus]
    violations: list[tuple[int, str, str, int, int]]

    @classmethod
    def of(cls, m: NaiveModel) -> Expected:
        f = m.facts()  # one replay of the whole history per check
        return cls(
            policy=m.policy,
            num_pages=m.num_pages,
            releasable=m.releasable_in(f),
            pinned=m.pinned_in(f),
            why=[m.status_in(f, p) for p in range(m.num_pages)],
            violations=m.violations_in(f),
        )


def assert_agrees(lg: Ledger, want: Expected) -> None:
    assert lg.num_pages == want.num_pages
    assert set(lg.releasable) == want.releasable
    assert set(lg.pinned()) == want.pinned
    for p, status in enumerate(want.why):
        assert lg.why(p) == status, f"page {p}"
        assert lg.is_releasable(p) == status.releasable
        assert lg.is_pinned(p) == bool(status.pins)
        assert lg.is_mapped(p) == status.mapped
        assert lg.allocated_blocks(p) == status.allocated_blocks
    assert violation_keys(lg) == want.violations
    if want.policy is Policy.LEDGER:
        assert lg.violations == []


def round_trip(snap: LedgerSnapshot) -> LedgerSnapshot:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=LedgerSnapshot)


# --- the state machine ---------------------------------------------------------------------------


def _when(can: Callable[[NaiveModel, Facts], bool]) -> Callable[[Any], Any]:
    return precondition(lambda self: can(self.model, self.f))


class LedgerVsModel(RuleBasedStateMachine):
    """Applies legal events to a ledger (and to restored copies of it) and to the naive model."""

    policy = Policy.LEDGER

    def __init__(self) -> None:
        super().__init__()
        self.header = header_for(self.policy)
        self.ledger = new_ledger(self.header)
        self.followers: list[Ledger] = []  # restored from snapshots, fed every later event
        self.model = NaiveModel(self.header, self.policy)
        self.f = self.model.facts()

    def emit(self, data: st.DataObject, move: Callable[[Draw, NaiveModel, Facts], list[Event]]) -> None:
        for ev in move(data.draw, self.model, self.f):
            note(f"{len(self.model.events)}: {describe(ev)}")
            self.ledger.apply(ev)
            for lg in self.followers:
                lg.apply(ev)
            self.model.apply(ev)
        self.f = self.model.facts()

    @_when(can_map)
    @rule(data=st.data())
    def map_page(self, data: st.DataObject) -> None:
        self.emit(data, move_map)

    @_when(can_alloc)
    @rule(data=st.data())
    def alloc(self, data: st.DataObject) -> None:
        self.emit(data, move_alloc)

    @_when(can_free)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.emit(data, move_free)

    @_when(can_build_job)
    @rule(data=st.data())
    def build_job(self, data: st.DataObject) -> None:
        self.emit(data, move_build_job)

    @_when(can_report)
    @rule(data=st.data())
    def report(self, data: st.DataObject) -> None:
        self.emit(data, move_report)

    @_when(can_hold)
    @rule(data=st.data())
    def window_hold(self, data: st.DataObject) -> None:
        self.emit(data, move_hold)

    @_when(can_end_request)
    @rule(data=st.data())
    def window_release(self, data: st.DataObject) -> None:
        self.emit(data, move_release)

    @_when(can_end_request)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        self.emit(data, move_finish)

    @rule(data=st.data())
    def build_boundary(self, data: st.DataObject) -> None:
        self.emit(data, move_boundary)

    @_when(can_unmap)
    @rule(data=st.data())
    def unmap(self, data: st.DataObject) -> None:
        self.emit(data, move_unmap)

    @rule()
    def snapshot_and_restore(self) -> None:
        snap = self.ledger.snapshot()
        decoded = round_trip(snap)
        assert decoded == snap
        note(f"{len(self.model.events)}: snapshot + restore")
        want = Expected.of(self.model)
        for s in (snap, decoded):
            restored = Ledger.restore(s)
            assert restored.snapshot() == snap
            assert_agrees(restored, want)
            self.followers.append(restored)
        del self.followers[:-4]  # keep the newest few: each is checked after every step

    @invariant()
    def agrees_with_model(self) -> None:
        want = Expected.of(self.model)
        assert_agrees(self.ledger, want)
        if self.followers:
            snap = self.ledger.snapshot()
            for lg in self.followers:
                assert_agrees(lg, want)
                assert lg.snapshot() == snap


class LegacyVsModel(LedgerVsModel):
    policy = Policy.LEGACY


MACHINE_SETTINGS = settings(FAST, max_examples=100, stateful_step_count=40)
LedgerVsModel.TestCase.settings = MACHINE_SETTINGS
LegacyVsModel.TestCase.settings = MACHINE_SETTINGS
TestLedgerPolicyMachine = LedgerVsModel.TestCase
TestLegacyPolicyMachine = LegacyVsModel.TestCase


# --- plain properties ----------------------------------------------------------------------------


@settings(FAST, max_examples=120)
@given(data=st.data(), policy=st.sampled_from(Policy))
def test_restore_mid_trace_continues_identically(data: st.DataObject, policy: Policy) -> None:
    header, events = data.draw(legal_history(policy), label="history")
    k = data.draw(st.integers(0, len(events)), label="split")
    full = new_ledger(header)
    full.apply_all(events)
    head = new_ledger(header)
    head.apply_all(events[:k])
    snap = head.snapshot()
    for start in (snap, round_trip(snap)):
        resumed = Ledger.restore(start)
        resumed.apply_all(events[k:])
        assert resumed.snapshot() == full.snapshot()
        assert set(resumed.releasable) == set(full.releasable)
        assert [resumed.why(p) for p in range(full.num_pages)] == [full.why(p) for p in range(full.num_pages)]


@st.composite
def geometries(draw: Draw) -> tuple[int, tuple[PoolGeometry, ...]]:
    page_bytes = draw(st.integers(1, 64))
    pools = draw(
        st.lists(
            st.builds(PoolGeometry, block_bytes=st.integers(1, page_bytes), num_blocks=st.integers(0, 40)),
            min_size=1,
            max_size=4,
        )
    )
    return page_bytes, tuple(pools)


@settings(FAST, max_examples=150)
@given(geometries())
def test_geometry_matches_the_model(geometry: tuple[int, tuple[PoolGeometry, ...]]) -> None:
    page_bytes, pools = geometry
    header = header_for(Policy.LEDGER, pools=pools, page_bytes=page_bytes)
    lg, m = new_ledger(header), NaiveModel(header, Policy.LEDGER)
    assert lg.num_pages == m.num_pages
    for pool, geo in enumerate(pools):
        pages = {m.page(pool, b) for b in range(geo.num_blocks)}
        assert [lg.page_of(pool, b) for b in range(geo.num_blocks)] == [m.page(pool, b) for b in range(geo.num_blocks)]
        assert set(lg.pool_pages(pool)) == pages
    assert lg.releasable == set() and list(lg.pinned()) == []


def test_model_and_ledger_on_a_hand_checked_trace() -> None:
    """Pins the model itself to hand-written answers, so that both sides cannot drift together."""
    header = header_for(Policy.LEDGER)
    events: list[Event] = [
        PageMapped(page=0),  # pool 0, blocks 0-3
        PageMapped(page=3),  # pool 1, blocks 0-1
        RequestAdded(req=5, name="cmpl-a"),
        BlockAlloc(pool=0, blocks=(0, 1)),
        BlockAlloc(pool=1, blocks=(0,)),
        JobBuilt(job=9, kind=JobKind.STORE, req=5, blocks=((1,), (0,)), workers=2),
        BuildBoundary(build=0),
        WindowHold(req=7, pool=1, blocks=(0, 1)),
        WindowHold(req=5, pool=1, blocks=(1,)),
        JobBuilt(job=2, kind=JobKind.LOAD, req=7, blocks=((0,),), workers=1),
        BlockFree(pool=0, blocks=(0, 1)),
        JobReported(job=9, count=1),
        BlockFree(pool=1, blocks=(0,)),
    ]
    lg, m = new_ledger(header), NaiveModel(header, Policy.LEDGER)
    for ev in events:
        lg.apply(ev)
        m.apply(ev)
    job9 = PinReason(kind="job", since_build=0, job=9, job_kind="store", request="cmpl-a", waiting_workers=1)
    job2 = PinReason(kind="job", since_build=1, job=2, job_kind="load", request="r7", waiting_workers=1)
    grace = PinReason(kind="grace", since_build=1, until_build=1)
    hold5 = PinReason(kind="window", since_build=1, request="cmpl-a")
    hold7 = PinReason(kind="window", since_build=1, request="r7")
    page0 = PageStatus(
        page=0, mapped=True, allocated_blocks=0, releasable=False, policy="ledger", pins=(job2, job9, grace)
    )
    page3 = PageStatus(
        page=3, mapped=True, allocated_blocks=0, releasable=False, policy="ledger", pins=(job9, grace, hold5, hold7)
    )
    assert m.why(0) == page0 == lg.why(0)
    assert m.why(3) == page3 == lg.why(3)
    assert m.pinned() == set(lg.pinned()) == {0, 3}
    assert m.releasable() == set(lg.releasable) == set()

    tail: list[Event] = [
        BuildBoundary(build=1),  # grace ends
        JobReported(job=9, count=1),  # job 9 done
        JobReported(job=2, count=1),  # job 2 done: page 0 is free to go
        WindowRelease(req=7),
        RequestFinished(req=5),  # page 3's last hold ends
    ]
    expected_releasable = [set(), set(), {0}, {0}, {0, 3}]
    for ev, want in zip(tail, expected_releasable, strict=True):
        lg.apply(ev)
        m.apply(ev)
        assert m.releasable() == set(lg.releasable) == want, describe(ev)
    assert m.pinned() == set(lg.pinned()) == set()
    assert m.expected_violations() == [] and lg.violations == []
