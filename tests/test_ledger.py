"""Unit tests of the pin ledger: each pin kind, each invariant, each policy, the scenarios of kvcached PR #598."""

from __future__ import annotations

import ast
from itertools import islice
from pathlib import Path

import msgspec
import pytest

from kvcached.errors import ConfigError
from kvcached.ledger import state
from kvcached.ledger.events import (
    BlockAlloc,
    BlockFree,
    BuildBoundary,
    Event,
    Gap,
    Header,
    JobBuilt,
    JobKind,
    JobReported,
    MemoryLimit,
    PageMapped,
    PageUnmapped,
    PoolGeometry,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    WindowHold,
    WindowRelease,
)
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.simulate import derive, replay
from kvcached.ledger.state import LedgerSnapshot
from kvcached.testing import synth
from kvcached.testing.seed_cases import SCENARIOS, preempt_shrink

ROOT = Path(__file__).resolve().parent.parent
KiB = 1024
STORE, LOAD = JobKind.STORE, JobKind.LOAD


def header(pools: int = 1, workers: int = 1) -> Header:
    # 4 blocks per page, 16 blocks per pool: pool 0 is pages 0-3, pool 1 pages 4-7.
    return Header(page_bytes=4 * KiB, pools=(PoolGeometry(block_bytes=KiB, num_blocks=16),) * pools, workers=workers)


def ledger(policy: str = "ledger", *events: Event, pools: int = 1, liveness: int = 16) -> Ledger:
    lg = Ledger(header(pools), policy, liveness_builds=liveness)
    lg.apply_all(events)
    return lg


def codes(lg: Ledger) -> list[str]:
    return [v.code for v in lg.violations]


# --- geometry ---------------------------------------------------------------------------------


def test_geometry_pages_per_pool() -> None:
    lg = Ledger(Header(page_bytes=4096, pools=(PoolGeometry(1024, 10), PoolGeometry(3000, 3))))
    # 4 blocks per page (10 blocks -> 3 pages); a 3000-byte block: 1 per page, tail unused.
    assert lg.num_pages == 6
    assert [lg.page_of(0, b) for b in (0, 3, 4, 9)] == [0, 0, 1, 2]
    assert [lg.page_of(1, b) for b in (0, 1, 2)] == [3, 4, 5]
    assert list(lg.pool_pages(1)) == [3, 4, 5]


def test_block_larger_than_page_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="KVCACHED_PAGE_SIZE_MB"):
        Ledger(Header(page_bytes=4096, pools=(PoolGeometry(8192, 4),)))


# --- policies -----------------------------------------------------------------------------------


def test_empty_mapped_page_is_releasable_under_both_policies_without_pins() -> None:
    for policy in ("legacy", "ledger"):
        lg = ledger(policy, PageMapped(0), PageMapped(1))
        assert set(lg.releasable) == {0, 1}
        lg.apply(BlockAlloc(0, (1,)))
        assert set(lg.releasable) == {1}


def test_legacy_ignores_pins_ledger_honours_them() -> None:
    evs = (PageMapped(0), BlockAlloc(0, (0,)), JobBuilt(1, STORE, 0, ((0,),), 1), BlockFree(0, (0,)))
    assert ledger("legacy", *evs).is_releasable(0)
    lg = ledger("ledger", *evs)
    assert not lg.is_releasable(0)
    assert lg.is_pinned(0)


# --- the three pins ---------------------------------------------------------------------------


def test_job_pin_lasts_until_every_worker_reported() -> None:
    lg = ledger("ledger", PageMapped(0), BlockAlloc(0, (0, 1)), JobBuilt(7, STORE, 3, ((0, 1),), 2), BuildBoundary(0))
    lg.apply(BlockFree(0, (0, 1)))
    lg.apply(BuildBoundary(1))  # grace over
    assert not lg.is_releasable(0)
    (reason,) = lg.why(0).pins
    assert (reason.kind, reason.job, reason.job_kind, reason.waiting_workers, reason.since_build) == (
        "job",
        7,
        "store",
        2,
        0,
    )
    lg.apply(JobReported(7, 1))
    assert lg.why(0).pins[0].waiting_workers == 1
    assert not lg.is_releasable(0)
    lg.apply(JobReported(7, 1))
    assert lg.is_releasable(0)
    assert lg.outstanding_jobs() == 0


def test_grace_lasts_exactly_one_more_build() -> None:
    lg = ledger("ledger", PageMapped(0), BlockAlloc(0, (0,)), BuildBoundary(0), BlockFree(0, (0,)))
    # Freed while build 1 is being assembled: kept until build 1 has been built.
    (reason,) = lg.why(0).pins
    assert (reason.kind, reason.since_build, reason.until_build) == ("grace", 1, 1)
    assert not lg.is_releasable(0)
    lg.apply(JobBuilt(0, STORE, 0, ((0,),), 1))  # build 1 stores the freed block: pinned in time
    lg.apply(BuildBoundary(1))
    assert [p.kind for p in lg.why(0).pins] == ["job"]
    lg.apply(JobReported(0, 1))
    assert lg.is_releasable(0)


def test_grace_only_for_a_free_that_empties_the_page() -> None:
    lg = ledger("ledger", PageMapped(0), BlockAlloc(0, (0, 1)), BlockFree(0, (0,)))
    assert lg.why(0).pins == ()
    lg.apply(BlockFree(0, (1,)))
    assert [p.kind for p in lg.why(0).pins] == ["grace"]


def test_window_hold_until_release_and_job_pin_survives_the_drop() -> None:
    lg = ledger(
        "ledger",
        PageMapped(4),
        RequestAdded(5, "req-w"),
        BlockAlloc(1, (0, 1)),
        WindowHold(5, 1, (0, 1)),
        BuildBoundary(0),
        BlockFree(1, (0, 1)),
        JobBuilt(9, STORE, 5, ((), (0,)), 1),
        BuildBoundary(1),
        pools=2,
    )
    assert [(p.kind, p.request) for p in lg.why(4).pins] == [("job", "req-w"), ("window", "req-w")]
    lg.apply(WindowRelease(5))  # native matching dropped the old block lists
    assert [p.kind for p in lg.why(4).pins] == ["job"]  # the in-flight copy still pins
    lg.apply(JobReported(9, 1))
    assert lg.is_releasable(4)


def test_request_finished_ends_window_holds() -> None:
    lg = ledger("ledger", PageMapped(4), BlockAlloc(1, (0,)), WindowHold(2, 1, (0,)), BlockFree(1, (0,)), pools=2)
    lg.apply(BuildBoundary(0))
    assert not lg.is_releasable(4)
    lg.apply(RequestFinished(2))
    assert lg.is_releasable(4)


def test_take_fresh_releasable_reports_each_page_once() -> None:
    lg = ledger("legacy", PageMapped(0), PageMapped(1))
    assert lg.has_fresh_releasable
    assert sorted(lg.take_fresh_releasable()) == [0, 1]
    assert not lg.has_fresh_releasable
    assert lg.take_fresh_releasable() == []
    lg.apply_all([BlockAlloc(0, (0,)), BlockFree(0, (0,))])
    assert lg.has_fresh_releasable
    assert lg.take_fresh_releasable() == [0]


# --- invariants -------------------------------------------------------------------------------


def test_i1_unmap_under_outstanding_job_with_chain_and_late_copy() -> None:
    lg = ledger(
        "legacy",
        PageMapped(0),
        RequestAdded(1, "req-a"),
        BlockAlloc(0, (0,)),
        JobBuilt(3, STORE, 1, ((0,),), 1),
        BuildBoundary(0),
        BlockFree(0, (0,)),
        PageUnmapped(0),
        BuildBoundary(1),
        JobReported(3, 1),
    )
    (v,) = lg.violations
    assert (v.invariant, v.code, v.index, v.page, v.job, v.request) == ("I1", "unmap-under-job", 6, 0, 3, "req-a")
    assert [(c.step, c.index) for c in v.chain] == [("pin", 3), ("free", 5), ("unmap", 6), ("late copy", 8)]
    assert [c.build for c in v.chain] == [0, 1, 1, 2]


def test_i1_store_of_a_block_whose_page_was_unmapped_and_remapped() -> None:
    lg = ledger(
        "legacy",
        PageMapped(0),
        BlockAlloc(0, (0,)),
        BlockFree(0, (0,)),
        PageUnmapped(0),
        PageMapped(0),  # re-backed: another tenant's bytes now
        JobBuilt(1, STORE, 0, ((0,),), 1),
    )
    assert codes(lg) == ["copy-of-lost-block"]
    assert [c.step for c in lg.violations[0].chain] == ["alloc", "free", "unmap", "late copy"]


def test_i1_load_into_unmapped_page() -> None:
    lg = ledger("ledger", JobBuilt(1, LOAD, 0, ((0,),), 1))
    assert codes(lg) == ["copy-of-lost-block"]
    assert lg.violations[0].invariant == "I1"


def test_i2_both_halves() -> None:
    lg = ledger("ledger", BlockAlloc(0, (0,)), PageMapped(1), BlockAlloc(0, (4,)), PageUnmapped(1))
    assert [(v.invariant, v.code) for v in lg.violations] == [
        ("I2", "alloc-on-unmapped"),
        ("I2", "unmap-with-blocks"),
    ]


@pytest.mark.parametrize(
    ("events", "code"),
    [
        ((PageMapped(0), BlockAlloc(0, (0,)), BlockAlloc(0, (0,))), "double-alloc"),
        ((PageMapped(0), BlockFree(0, (0,))), "double-free"),
        ((JobReported(4, 1),), "report-unknown-job"),
        ((PageMapped(0), BlockAlloc(0, (0,)), JobBuilt(1, STORE, 0, ((0,),), 1), JobReported(1, 2)), "over-report"),
        ((PageMapped(0), BlockAlloc(0, (0,)), *(JobBuilt(1, STORE, 0, ((0,),), 1),) * 2), "duplicate-job"),
        ((BlockAlloc(0, (99,)),), "block-out-of-range"),
        ((BlockAlloc(3, (0,)),), "unknown-pool"),
        ((PageMapped(0), PageMapped(0)), "double-map"),
        ((PageUnmapped(0),), "double-unmap"),
        ((PageMapped(400),), "page-out-of-range"),
        ((BuildBoundary(3),), "build-out-of-order"),
        ((PageMapped(0), JobBuilt(1, STORE, 0, ((2,),), 1)), "job-on-unwritten-block"),
    ],
)
def test_i3_accounting(events: tuple[Event, ...], code: str) -> None:
    lg = ledger("ledger", *events)
    assert code in codes(lg)
    assert all(v.invariant == "I3" for v in lg.violations if v.code == code)


def test_i3_unknown_references_are_not_blamed_after_a_gap() -> None:
    lg = ledger("ledger", Gap(12), JobReported(4, 1), BuildBoundary(7))
    assert lg.violations == []
    assert lg.dropped_events == 12


def test_i4_pin_outlives_finished_request() -> None:
    evs: list[Event] = [PageMapped(0), BlockAlloc(0, (0,)), JobBuilt(1, STORE, 0, ((0,),), 1), RequestFinished(0)]
    evs += [BuildBoundary(n) for n in range(6)]
    lg = ledger("ledger", *evs, liveness=3)
    assert codes(lg) == ["pin-outlives-request"]
    assert lg.violations[0].invariant == "I4"
    ok = ledger("ledger", *evs[:4], JobReported(1, 1), *evs[4:], liveness=3)
    assert ok.violations == []


def test_i4_shrink_stalled_although_pages_could_go() -> None:
    evs: list[Event] = [PageMapped(0), PageMapped(1), MemoryLimit(1)]
    evs += [BuildBoundary(n) for n in range(6)]
    lg = ledger("ledger", *evs, liveness=3)
    assert codes(lg) == ["shrink-stalled"]
    done = ledger("ledger", *evs[:3], PageUnmapped(1), *evs[3:], liveness=3)
    assert done.violations == []


def test_i4_preempted_holds_block_a_shrink_p2() -> None:
    bad = replay(Ledger(preempt_shrink(release_on_match=False).header, "ledger"), preempt_shrink(False).events)
    assert {v.code for v in bad.violations} == {"holds-block-shrink"}
    good = replay(Ledger(preempt_shrink().header, "ledger"), preempt_shrink().events)
    assert good.violations == []
    assert good.mapped_pages == 0 and good.pinned_pages == 0


def test_i4_clock_of_preempted_holds_runs_from_when_the_shrink_began() -> None:
    # A request preempted long before any limit: its holds block a shrink only from the build the
    # pages went over the limit, so no I4 until 16 builds after that.
    lg = ledger("ledger", PageMapped(0), BlockAlloc(0, (0,)), WindowHold(7, 0, (0,)))
    lg.apply_all([BlockFree(0, (0,)), RequestPreempted(7)])
    for b in range(30):
        lg.apply(BuildBoundary(b))
    lg.apply(MemoryLimit(0))  # from build 30 on, the held page is over the limit
    for b in range(30, 46):
        lg.apply(BuildBoundary(b))
    assert codes(lg) == []
    for b in range(46, 48):
        lg.apply(BuildBoundary(b))
    assert codes(lg) == ["holds-block-shrink"]
    assert "for 17 builds" in lg.violations[0].message
    # Kept across a snapshot: a ledger restored mid-shrink reports at the same build.
    snap = Ledger.restore(msgspec.msgpack.decode(msgspec.msgpack.encode(lg.snapshot()), type=LedgerSnapshot))
    assert snap.tables.over_limit_since == 30


def test_ledger_keeps_going_after_a_violation() -> None:
    lg = ledger("ledger", PageMapped(0), BlockFree(0, (0,)), BlockFree(0, (1,)), JobReported(9, 1))
    assert codes(lg) == ["double-free", "double-free", "report-unknown-job"]
    assert [v.index for v in lg.violations] == [1, 2, 3]


# --- the scenarios of kvcached PR #598 ---------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_seed_scenarios_violate_i1_under_legacy_and_nothing_under_ledger(name: str) -> None:
    sc = SCENARIOS[name]()
    legacy = replay(Ledger(sc.header, "legacy"), sc.events)
    assert any(v.invariant == "I1" for v in legacy.violations), legacy.violations
    fixed = replay(Ledger(sc.header, "ledger"), sc.events)
    assert fixed.violations == []
    assert fixed.pinned_pages == 0 and fixed.outstanding_jobs() == 0  # every pin released
    assert fixed.mapped_pages == 0  # and every page given back in the end


def test_derive_replaces_recorded_decisions() -> None:
    sc = SCENARIOS["finish-in-write-step"]()
    recorded = list(derive(Ledger(sc.header, "legacy"), sc.events))
    # Re-deriving the legacy run's decisions under ledger moves the unmap after the report.
    names = [type(e).__name__ for e in derive(Ledger(sc.header, "ledger"), recorded)]
    assert names.index("PageUnmapped") > names.index("JobReported")


# --- snapshot ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_snapshot_plus_suffix_equals_whole(name: str) -> None:
    sc = SCENARIOS[name]()
    events = list(derive(Ledger(sc.header, "legacy"), sc.events))
    whole = Ledger(sc.header, "legacy")
    whole.apply_all(events)
    for k in range(0, len(events) + 1, 3):
        head = Ledger(sc.header, "legacy")
        head.apply_all(events[:k])
        wire = msgspec.msgpack.encode(head.snapshot())
        resumed = Ledger.restore(msgspec.msgpack.decode(wire, type=LedgerSnapshot))
        resumed.apply_all(events[k:])
        assert resumed.snapshot() == whole.snapshot()
        assert set(resumed.releasable) == set(whole.releasable)
        assert resumed.violations == whole.violations


def _declared_tables() -> list[str]:
    """LedgerTables' fields, read from its declaration (a class compiled by mypyc keeps no annotations)."""
    tree = ast.parse((ROOT / "kvcached" / "ledger" / "tables.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LedgerTables")
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def test_every_table_is_kept_by_a_snapshot_fixed_by_the_header_or_rebuilt_on_restore() -> None:
    # A table added to LedgerTables must be put in exactly one of these, or a restart loses it.
    declared = _declared_tables()
    tables = Ledger(header(2)).tables
    assert all(hasattr(tables, name) for name in declared)  # the constructor sets each one
    kept = {*state.KEPT, *state.POOL_TABLES, "jobs"}
    groups = [kept, state.FIXED, state.DERIVED]
    assert set(declared) == set().union(*groups)
    assert sum(len(g) for g in groups) == len(declared)


@pytest.mark.parametrize("policy", ["legacy", "ledger"])
def test_restore_rebuilds_every_table_as_it_was(policy: str) -> None:
    # Table by table, not only through the questions: a table that restore forgot to rebuild
    # would hold its empty initial value. Three tables are equal in meaning only: pages due at a
    # build come in the order of their frees, restore starts with no fresh pages (the allocator
    # heard of them before the snapshot), and it counts only the requests with outstanding jobs
    # (a live request keeps a zero count until it finishes).
    for sc in (f() for f in SCENARIOS.values()):
        events = list(derive(Ledger(sc.header, policy), sc.events))
        for k in range(len(events) + 1):
            lg = Ledger(sc.header, policy)
            lg.apply_all(events[:k])
            wire = msgspec.msgpack.encode(lg.snapshot())
            back = Ledger.restore(msgspec.msgpack.decode(wire, type=LedgerSnapshot))
            a, b = lg.tables, back.tables
            for name in set(_declared_tables()) - {"grace_due", "fresh", "req_jobs"}:
                assert getattr(a, name) == getattr(b, name), (sc.name, k, name)
            assert {r: c for r, c in a.req_jobs.items() if c[0]} == b.req_jobs
            assert [a.jobs_on(p) for p in range(a.num_pages)] == [b.jobs_on(p) for p in range(b.num_pages)]
            assert {k: set(v) for k, v in a.grace_due.items()} == {k: set(v) for k, v in b.grace_due.items()}
            assert b.fresh == []


def test_why_explains_in_words() -> None:
    job = JobBuilt(2, STORE, 1, ((0,),), 2)
    lg = ledger("ledger", PageMapped(0), RequestAdded(1, "req-x"), BlockAlloc(0, (0,)), job)
    lg.apply(BlockFree(0, (0,)))
    text = lg.why(0).describe()
    assert "store job 2 of request req-x since build 0, waiting on 2 workers" in text
    assert "grace" in text


def test_a_page_that_never_comes_free_names_only_its_outstanding_job() -> None:
    # One job always in flight over page 0, thousands built and reported: nothing of the
    # history is kept, and why() must name exactly the outstanding job.
    lg = ledger("ledger", PageMapped(0), BlockAlloc(0, (0,)), JobBuilt(0, STORE, 0, ((0,),), 1))
    for job in range(1, 5000):
        lg.apply(JobBuilt(job, STORE, 0, ((0,),), 1))
        lg.apply(JobReported(job - 1, 1))
    assert [p.job for p in lg.why(0).pins] == [4999]
    assert len(lg.tables.jobs) == 1


def test_fresh_pages_nobody_takes_stay_within_the_pages() -> None:
    # The journal service's replica and kvreplay apply recorded decisions and never take the
    # fresh releasable pages an allocator would: the list must not grow with the trace (it
    # held 12,863 pages after a million synthetic events), and a late take still gives exactly
    # the releasable pages, each once.
    h = synth.header()
    events = list(derive(Ledger(h), islice(synth.workload(3, preempt_every=0), 60_000)))
    lg = Ledger(h)
    t = lg.tables
    for ev in events:
        lg.apply(ev)
        if type(ev) is BuildBoundary:
            assert len(t.fresh) <= 2 * len(t.releasable) + 64, t.index
    taken = lg.take_fresh_releasable()
    assert len(taken) == len(set(taken)) and set(taken) <= lg.tables.releasable


def test_settled_says_whether_a_boundary_would_move_anything() -> None:
    """An engine whose loop steps while idle (SGLang's) skips boundaries only while settled."""
    lg = ledger("ledger", PageMapped(0), BlockAlloc(0, (0,)))
    assert lg.settled  # a block in use: a boundary ends nothing
    lg.apply(JobBuilt(1, STORE, 0, ((0,),), 1))
    assert not lg.settled  # an outstanding job: I4 counts boundaries
    lg.apply(BuildBoundary(0))
    lg.apply(JobReported(1, 1))
    assert lg.settled
    lg.apply(BlockFree(0, (0,)))
    assert not lg.settled  # the page's grace ends at the next boundary
    lg.apply(BuildBoundary(1))
    assert lg.settled and lg.is_releasable(0)
