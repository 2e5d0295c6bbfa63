"""The ledger's state as a value: outstanding jobs, and the snapshot that restores a ledger.

A snapshot holds the *inputs* to the derivation (blocks, pins, jobs, requests) and none of its
outputs: the releasable set is recomputed on restore by the same ``_refresh`` the live path
uses, so a snapshot cannot disagree with the events that produced it. Snapshots let kvreplay
start a long trace in the middle and let the journal service write checkpoints.
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any

import msgspec

from .events import Header, Policy
from .findings import Violation

if TYPE_CHECKING:
    from .ledger import Ledger


# An outstanding job, as the ledger keeps it: [kind, req, pages, workers, reported, build,
# index]. A list, not an object, because it is made and dropped on the hot path.
JobState = list[Any]


class JobRecord(msgspec.Struct, frozen=True, array_like=True):
    job: int
    kind: int
    req: int
    pages: tuple[int, ...]
    workers: int
    reported: int
    build: int
    index: int


class PoolState(msgspec.Struct, frozen=True):
    alloc: bytes
    epoch: list[int]
    alloc_ix: list[int]
    free_ix: list[int]


class LedgerSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``Ledger.restore`` needs to continue exactly where ``snapshot`` was taken."""

    header: Header
    policy: Policy
    liveness_builds: int
    index: int
    build: int
    pools: list[PoolState]
    page_alloc: list[int]
    mapped: bytes
    epoch: list[int]
    unmap_ix: list[int]
    pfree_ix: list[int]
    grace: dict[int, int]
    holds: dict[int, dict[int, int]]
    jobs: list[JobRecord]
    names: dict[int, str]
    finished: dict[int, int]
    finish_due: dict[int, list[int]]
    preempted: dict[int, int]
    boundary_ix: list[int]
    boundary_build: list[int]
    limit: int | None
    peak_pinned_pages: int
    lossy: bool
    dropped_events: int
    violations: list[Violation]
    job_violation: dict[int, list[int]]
    stall_since: int | None
    stall_reported: bool
    hold_reported: list[int]
    builds: int
    jobs_built: int
    maps: int
    unmaps: int
    prefix_cache_resets: int


def take_snapshot(lg: Ledger) -> LedgerSnapshot:
    return LedgerSnapshot(
        header=lg.header,
        policy=lg.policy,
        liveness_builds=lg.liveness_builds,
        index=lg.index,
        build=lg.build,
        pools=[
            PoolState(alloc=bytes(a), epoch=list(e), alloc_ix=list(ai), free_ix=list(fi))
            for a, e, ai, fi in zip(lg._alloc, lg._bepoch, lg._balloc_ix, lg._bfree_ix, strict=True)
        ],
        page_alloc=list(lg._page_alloc),
        mapped=bytes(lg._mapped),
        epoch=list(lg._epoch),
        unmap_ix=list(lg._unmap_ix),
        pfree_ix=list(lg._pfree_ix),
        grace=dict(sorted(lg._grace.items())),
        holds={p: dict(sorted(h.items())) for p, h in sorted(lg._holds.items())},
        jobs=[
            JobRecord(job, int(st[0]), *st[1:])
            for job, st in sorted(lg._jobs.items())
        ],
        names=dict(sorted(lg._names.items())),
        finished=dict(sorted(lg._finished.items())),
        finish_due={k: list(v) for k, v in sorted(lg._finish_due.items())},
        preempted=dict(sorted(lg._preempted.items())),
        boundary_ix=list(lg._boundary_ix),
        boundary_build=list(lg._boundary_build),
        limit=lg.limit,
        peak_pinned_pages=lg.peak_pinned_pages,
        lossy=lg.lossy,
        dropped_events=lg.dropped_events,
        violations=list(lg.violations),
        job_violation={k: list(v) for k, v in sorted(lg._job_violation.items())},
        stall_since=lg._stall_since,
        stall_reported=lg._stall_reported,
        hold_reported=sorted(lg._hold_reported),
        builds=lg.builds,
        jobs_built=lg.jobs_built,
        maps=lg.maps,
        unmaps=lg.unmaps,
        prefix_cache_resets=lg.prefix_cache_resets,
    )


def restore_snapshot(lg: Ledger, s: LedgerSnapshot) -> None:
    """Load ``s`` into a fresh ledger built from the same header; derive the rest."""
    lg.index, lg.build = s.index, s.build
    for i, ps in enumerate(s.pools):
        lg._alloc[i] = bytearray(ps.alloc)
        lg._bepoch[i] = list(ps.epoch)
        lg._balloc_ix[i] = list(ps.alloc_ix)
        lg._bfree_ix[i] = list(ps.free_ix)
    lg._page_alloc = list(s.page_alloc)
    lg._mapped = bytearray(s.mapped)
    lg._epoch = list(s.epoch)
    lg._unmap_ix = list(s.unmap_ix)
    lg._pfree_ix = list(s.pfree_ix)
    pins = [0] * lg.num_pages
    lg._grace = dict(s.grace)
    lg._grace_due = {s.build: sorted(s.grace)} if s.grace else {}
    for p in s.grace:
        pins[p] += 1
    lg._holds = {p: dict(h) for p, h in s.holds.items()}
    lg._req_holds = {}
    for p, h in s.holds.items():
        for req in h:
            lg._req_holds.setdefault(req, set()).add(p)
            pins[p] += 1
    lg._jobs, lg._req_jobs, lg._page_jobs = {}, {}, {}
    lg._jobpins = [0] * lg.num_pages
    for r in s.jobs:
        lg._jobs[r.job] = [r.kind, r.req, r.pages, r.workers, r.reported, r.build, r.index]
        lg._req_jobs[r.req] = lg._req_jobs.get(r.req, 0) + 1
        for p in r.pages:
            lg._page_jobs.setdefault(p, []).append(r.job)
            lg._jobpins[p] += 1
            pins[p] += 1
    lg._pins = pins
    lg.pinned_pages = sum(1 for n in pins if n)
    lg.peak_pinned_pages = s.peak_pinned_pages
    lg.mapped_pages = sum(lg._mapped)
    lg._names = dict(s.names)
    lg._finished = dict(s.finished)
    lg._finish_due = {k: list(v) for k, v in s.finish_due.items()}
    lg._preempted = dict(s.preempted)
    lg._boundary_ix = array("q", s.boundary_ix)
    lg._boundary_build = array("q", s.boundary_build)
    lg.limit = s.limit
    lg.lossy = s.lossy
    lg.dropped_events = s.dropped_events
    lg.violations = list(s.violations)
    lg._job_violation = {k: list(v) for k, v in s.job_violation.items()}
    lg._stall_since = s.stall_since
    lg._stall_reported = s.stall_reported
    lg._hold_reported = set(s.hold_reported)
    lg.builds, lg.jobs_built, lg.maps, lg.unmaps = s.builds, s.jobs_built, s.maps, s.unmaps
    lg.prefix_cache_resets = s.prefix_cache_resets
    lg._releasable = set()
    for p in range(lg.num_pages):
        lg._refresh(p)
    lg._fresh = []
