"""The ledger's state as a value: the snapshot that restores a ledger, taken from its tables.

A snapshot holds the *inputs* to the derivation (blocks, pins, jobs, requests) and none of its
outputs: the releasable set is recomputed on restore by the same rule the live path uses
(``Ledger.restore``), so a snapshot cannot disagree with the events that produced it. Snapshots
let kvreplay start a long trace in the middle and let the journal service write checkpoints.
"""

from __future__ import annotations

from array import array
from typing import Any, Final

import msgspec

from .events import Header, Policy
from .findings import Violation
from .tables import LedgerTables

# The wire format is the Structs below (JobRecord, PoolState, LedgerSnapshot); keep their fields
# as they are.


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
    """Everything ``Ledger.restore`` needs to continue exactly where ``snapshot`` was taken.

    NOTE: taking and restoring one reads and writes ``LedgerTables`` (the ledger's state,
    declared once in ``tables``) and is generic over it. Each field here is the table of the same
    name, copied (``_frozen`` and ``_thawed`` say how, by the table's type), except ``pools`` and
    ``jobs``, which regroup tables into records. The tables a snapshot leaves out are either
    fixed by the header (``FIXED``) or indexes over the kept ones that restore rebuilds
    (``DERIVED``).

    NOTE: so a new table that must survive a restart needs one field here, of the same name,
    with a default so that snapshots written before it still decode; tests/test_ledger.py checks
    that every table is kept, fixed or derived."""

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
    # Added after format 1's first snapshots: a default, so that those still decode.
    over_limit_since: int | None = None
    # Added with RequestBlocks (I5): defaults, so that older snapshots still decode.
    owners_known: bool = False
    owned: dict[int, dict[int, int]] = {}
    written: dict[int, list[int]] = {}
    owned_due: dict[int, list[int]] = {}
    # Added with JobFailed (vLLM 0.34's failed transfer jobs): a default, as above.
    jobs_failed: int = 0


# The tables behind ``pools``, in PoolState's field order (``jobs`` is the table ``jobs``).
POOL_TABLES: Final = ("alloc", "bepoch", "balloc_ix", "bfree_ix")
# The constructor's arguments: restore builds the tables from them before filling them in.
CONFIG: Final = ("header", "policy", "liveness_builds")
# Snapshot fields that are the table of the same name.
KEPT: Final = tuple(f for f in LedgerSnapshot.__struct_fields__ if f not in ("pools", "jobs"))
# Tables of 0/1 flags: lists in the ledger (tables.py says why), bytes in a snapshot.
FLAGS: Final = frozenset({"mapped"})
# Tables fixed by the header and the policy.
FIXED: Final = frozenset({"legacy", "num_pages", "npools", "bpp", "first", "bpage"})
# Tables that restore rebuilds from the kept ones (and the ledger's output, which it re-derives).
DERIVED: Final = frozenset(
    {"pins", "jobpins", "grace_due", "req_holds", "req_jobs", "mapped_pages", "pinned_pages", "written_by"}
    | {"releasable", "fresh"}
)


def _frozen(value: Any) -> Any:
    """A table as the snapshot keeps it: copied, dicts in key order, sets sorted."""
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in sorted(value.items())}
    if isinstance(value, set):
        return sorted(value)
    if isinstance(value, list | array):
        return list(value)
    return value  # an int, a bool, None, or an immutable Struct or enum


def _thawed(value: Any, like: Any) -> Any:
    """A snapshot field as a table of the type of ``like`` (the fresh table), copied."""
    if isinstance(like, array):
        return array(like.typecode, value)
    if isinstance(like, set):
        return set(value)
    if isinstance(value, dict):  # at most two levels deep: {page: {req: build}}, {build: [req]}
        return {k: dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v for k, v in value.items()}
    if isinstance(like, list):  # a list, or the bytes of a flag table (FLAGS)
        return list(value)
    return value


def take_snapshot(t: LedgerTables) -> LedgerSnapshot:
    tables = zip(t.alloc, t.bepoch, t.balloc_ix, t.bfree_ix, strict=True)  # POOL_TABLES
    pools = [PoolState(bytes(a), list(e), list(ai), list(fi)) for a, e, ai, fi in tables]
    # A JobState less its request's count; its pages are a list (the hot path's, unconverted).
    jobs = [JobRecord(job, int(st[0]), st[1], tuple(st[2]), *st[3:7]) for job, st in sorted(t.jobs.items())]
    kept: dict[str, Any] = {n: bytes(getattr(t, n)) if n in FLAGS else _frozen(getattr(t, n)) for n in KEPT}
    # The tables keep a block's last fresh allocation as two ints (tables.py says why), a
    # snapshot as the [event index, request] it always kept.
    kept["written"] = {k: [ix, t.written_by[k]] for k, ix in sorted(t.written.items())}
    return LedgerSnapshot(pools=pools, jobs=jobs, **kept)


def restore_snapshot(t: LedgerTables, s: LedgerSnapshot) -> None:
    """Load ``s`` into fresh tables built from its header, policy and liveness_builds.

    Rebuilds the derived tables except the ledger's output (``releasable`` and ``fresh`` are left
    empty): ``Ledger.restore`` derives it by the rule of the live path.
    """
    for name in KEPT:
        if name not in CONFIG:
            setattr(t, name, _thawed(getattr(s, name), getattr(t, name)))
    t.written = {k: ix for k, (ix, _) in s.written.items()}
    t.written_by = {k: req for k, (_, req) in s.written.items()}
    for i, ps in enumerate(s.pools):  # POOL_TABLES
        t.alloc[i] = list(ps.alloc)
        t.bepoch[i] = list(ps.epoch)
        t.balloc_ix[i] = list(ps.alloc_ix)
        t.bfree_ix[i] = list(ps.free_ix)
    pins = [0] * t.num_pages
    t.grace_due = {s.build: sorted(s.grace)} if s.grace else {}
    for p in s.grace:
        pins[p] += 1
    t.req_holds = {}
    for p, h in s.holds.items():
        for req in h:
            t.req_holds.setdefault(req, set()).add(p)
            pins[p] += 1
    t.jobs, t.req_jobs = {}, {}
    t.jobpins = [0] * t.num_pages
    for r in s.jobs:
        outstanding = t.req_jobs.setdefault(r.req, [0])
        outstanding[0] += 1
        t.jobs[r.job] = [r.kind, r.req, list(r.pages), r.workers, r.reported, r.build, r.index, outstanding]
        for p in r.pages:
            t.jobpins[p] += 1
            pins[p] += 1
    t.pins = pins
    t.pinned_pages = sum(1 for n in pins if n)
    t.mapped_pages = sum(t.mapped)
    t.releasable, t.fresh = set(), []
