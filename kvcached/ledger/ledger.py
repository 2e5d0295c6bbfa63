"""The pin ledger: the one place where events become the set of pages that may be unmapped.

The allocator (live) and kvreplay (offline) both feed events to ``Ledger.apply`` and both ask
it the same questions, so a bug reproduced by replay is a bug of the code that serves. The
ledger is synchronous, pure (it performs no I/O and no unmapping) and incremental: an event
touches only the pages it names, so it can sit on vLLM's scheduler thread. ``Ledger`` says
which pages are *releasable* under each policy, what pins a page, and which invariants it checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

import msgspec

from . import checks
from .events import (
    BlockAlloc,
    BlockFree,
    BuildBoundary,
    Event,
    Gap,
    Header,
    JobBuilt,
    JobFailed,
    JobKind,
    JobReported,
    MemoryLimit,
    PageMapped,
    PageUnmapped,
    Policy,
    PrefixCacheReset,
    RequestAdded,
    RequestBlocks,
    RequestFinished,
    RequestPreempted,
    WindowHold,
    WindowRelease,
)
from .findings import plural
from .queries import LedgerQueries
from .state import LedgerSnapshot, restore_snapshot, take_snapshot
from .tables import LedgerTables

# Compared by identity: msgspec decodes a JobKind to its member, and mypyc keeps a Final in a C static.
_STORE: Final = JobKind.STORE
# An event's fields in declaration order (the order of its wire array), in one C call: compiled,
# each ``ev.field`` is a generic attribute lookup (~160 instructions), and a field typed ``int``
# is unboxed on the way, then boxed again where it is used as a key. Unpacked, the ids stay the
# int objects msgspec decoded. Used by the hot handlers only.
_fields: Final = msgspec.structs.astuple

DEFAULT_LIVENESS_BUILDS = 16


class Ledger(LedgerQueries):
    """Derives the releasable pages from events and checks invariants I1-I5 on each.

    The questions (``why``, ``releasable``, ``index``, ...) are ``LedgerQueries``'; the state is
    ``tables`` (a ``LedgerTables``), which the rules below change (and ``checks``, when they
    record what they found).

    NOTE: a page is *releasable* (it may be unmapped now, its memory given back) under ``legacy``
    when it is mapped and holds no allocated block, and under ``ledger`` when, in addition,
    nothing pins it. The word is "releasable", not "unmappable", which most readers take to mean
    "cannot be mapped". Pins are of three kinds:

    * job pin: the pages of a transfer job's blocks, from the build that returns the job until
      its workers have reported it as many times as it has workers;
    * grace: a page emptied by a free stays until the build open at the time of the free has been
      built, because vLLM builds the last-block store of a finished request in that build;
    * window hold: pages of a request's sliding-window blocks, until its last build
      (``RequestFinished``) or until native matching drops its old block lists (``WindowRelease``).

    NOTE: invariants I1-I5 (see ``findings.INVARIANTS``) are checked on every event. A violation
    is recorded as a value and the ledger keeps going: replay must see every violation, not the
    first.

    NOTE: this module holds the rules only. The state they change is declared in ``tables``, the
    questions that read it are in ``queries``, the slow paths (witnesses, I4) in ``checks``, and
    snapshots in ``state``; all of them take the tables, none of them the ledger.
    """

    def __init__(
        self,
        header: Header,
        policy: Policy | str | None = None,
        *,
        liveness_builds: int = DEFAULT_LIVENESS_BUILDS,
    ) -> None:
        # All state lives in the tables (see tables.py for why): this class is the rules.
        self.tables = LedgerTables(header, Policy(policy) if policy is not None else header.policy, liveness_builds)
        self._dispatch: dict[type, Callable[[Any], None]] = {
            BuildBoundary: self._build_boundary,
            BlockAlloc: self._block_alloc,
            BlockFree: self._block_free,
            JobBuilt: self._job_built,
            JobReported: self._job_reported,
            JobFailed: self._job_failed,
            WindowHold: self._window_hold,
            WindowRelease: self._window_release,
            RequestAdded: self._request_added,
            RequestFinished: self._request_finished,
            RequestPreempted: self._request_preempted,
            PrefixCacheReset: self._prefix_cache_reset,
            MemoryLimit: self._memory_limit,
            RequestBlocks: self._request_blocks,
            PageMapped: self._page_mapped,
            PageUnmapped: self._page_unmapped,
            Gap: self._gap,
        }

    # --- applying events ----------------------------------------------------------------------
    # The handlers below are the scheduler's hot path (budget: about 1 us per free or report on
    # a 2-core machine) and replay's inner loop, so they bind locals and inline the pin
    # bookkeeping; the rare paths (violations, I4) live in ``checks``. They are written for
    # mypyc as much as for CPython (each change measured with callgrind). A local typed ``int``
    # is a native integer, so an id that is only a dict key or a stored value is left untyped
    # (``_fields`` hands it over as the int object msgspec decoded). The event index stored per
    # block is boxed once per event (``ix``); typed ``int``, each use would box it again, a new
    # int object for every value above 256. Tables are updated as
    # ``k = table[p]; table[p] = k + 1``: mypyc compiles ``table[p] += 1`` as generic
    # arithmetic on objects.

    def apply(self, event: Event) -> None:
        # The five events that make up nearly every trace are tested first: compiled by mypyc
        # this chain is a few pointer compares, where a dict of bound methods is a generic call.
        t = type(event)
        if t is JobReported:
            self._job_reported(event)  # type: ignore[arg-type]
        elif t is BlockFree:
            self._block_free(event)  # type: ignore[arg-type]
        elif t is BlockAlloc:
            self._block_alloc(event)  # type: ignore[arg-type]
        elif t is JobBuilt:
            self._job_built(event)  # type: ignore[arg-type]
        elif t is BuildBoundary:
            self._build_boundary(event)  # type: ignore[arg-type]
        else:
            self._dispatch[t](event)
        self.tables.index += 1

    def apply_all(self, events: Iterable[Event]) -> None:
        # Replay's loop (kvreplay check applies a journal frame at a time): ``apply``'s dispatch
        # written out once more, so that an event costs no call of ``apply`` itself. The handlers
        # are called as methods, not bound to locals: compiled by mypyc a method call is native
        # and a local bound method a generic Python call.
        # The classes bound to locals: a module global is a dict lookup per use, pure or compiled.
        t = self.tables
        reported, alloc, built, free, boundary = JobReported, BlockAlloc, JobBuilt, BlockFree, BuildBoundary
        for event in events:
            k = type(event)
            if k is reported:
                self._job_reported(event)  # type: ignore[arg-type]
            elif k is alloc:
                self._block_alloc(event)  # type: ignore[arg-type]
            elif k is built:
                self._job_built(event)  # type: ignore[arg-type]
            elif k is free:
                self._block_free(event)  # type: ignore[arg-type]
            elif k is boundary:
                self._build_boundary(event)  # type: ignore[arg-type]
            else:
                self._dispatch[k](event)
            t.index += 1

    def _refresh(self, p: int) -> None:
        t = self.tables
        if t.mapped[p] and not t.page_alloc[p] and (t.legacy or not t.pins[p]):
            if p not in t.releasable:
                t.releasable.add(p)
                t.fresh.append(p)
        else:
            t.releasable.discard(p)

    def _pin(self, p: int) -> None:
        t = self.tables
        n = t.pins[p]
        t.pins[p] = n + 1
        if not n:
            t.pinned_pages += 1
            if t.pinned_pages > t.peak_pinned_pages:
                t.peak_pinned_pages = t.pinned_pages
            if not t.legacy:
                t.releasable.discard(p)

    def _unpin(self, p: int) -> None:
        t = self.tables
        n = t.pins[p] - 1
        t.pins[p] = n
        if not n:
            t.pinned_pages -= 1
            if not t.legacy and t.mapped[p] and not t.page_alloc[p] and p not in t.releasable:
                t.releasable.add(p)
                t.fresh.append(p)

    # inputs

    def _build_boundary(self, ev: BuildBoundary) -> None:
        t = self.tables
        n = ev.build
        if n != t.build and not t.lossy:
            t.violate("I3", "build-out-of-order", f"build {n} closed while build {t.build} was open")
        due = t.grace_due
        keys: Iterable[int] = range(t.build, n + 1) if 0 <= n - t.build <= 64 else [k for k in due if k <= n]
        grace = t.grace
        for k in keys:
            pages = due.pop(k, None)
            if pages:
                for p in pages:
                    if grace.pop(p, None) is not None:
                        self._unpin(p)
            reqs = t.finish_due.pop(k, None)
            if reqs:
                for req in reqs:
                    checks.finished_request(t, req, n)
            if t.owned_due:
                for req in t.owned_due.pop(k, ()):
                    t.owned.pop(req, None)
        t.boundary_ix.append(t.index)
        t.boundary_build.append(n)
        t.build = n + 1
        t.builds += 1
        if len(t.fresh) > 2 * len(t.releasable) + 64:
            # Nobody takes them (the journal service's replica, kvreplay replaying recorded
            # decisions): keep what a take would return, so that the list stays within the pages.
            t.fresh = t.fresh_releasable()
        if t.limit is not None and t.mapped_pages > t.limit:
            if t.over_limit_since is None:
                t.over_limit_since = n
            checks.shrink(t, n)
        elif t.over_limit_since is not None or t.stall_since is not None or t.stall_reported:
            t.over_limit_since = t.stall_since = None
            t.stall_reported = False

    def _block_alloc(self, ev: BlockAlloc) -> None:
        t = self.tables
        pool: int
        blocks: tuple[int, ...]
        pool, blocks = _fields(ev)
        if pool >= t.npools:
            checks.bad_pool(t, pool, "BlockAlloc")
            return
        alloc, bpage, bepoch, aix = t.alloc[pool], t.bpage[pool], t.bepoch[pool], t.balloc_ix[pool]
        page_alloc, mapped, epoch, nb = t.page_alloc, t.mapped, t.epoch, len(alloc)
        ix: Any = t.index  # boxed once (see the note above apply)
        for b in blocks:
            if b >= nb:
                checks.bad_block(t, pool, b, "BlockAlloc")
                continue
            p: int = bpage[b]
            if alloc[b]:
                t.violate("I3", "double-alloc", f"block {b} of pool {pool} allocated twice", page=p)
                continue
            if not mapped[p]:
                t.violate("I2", "alloc-on-unmapped", f"block {b} of pool {pool} given on an unmapped page", page=p)
            alloc[b] = 1
            bepoch[b] = epoch[p]
            aix[b] = ix
            n: int = page_alloc[p]
            page_alloc[p] = n + 1
            if not n:
                t.releasable.discard(p)

    def _block_free(self, ev: BlockFree) -> None:
        t = self.tables
        pool: int
        blocks: tuple[int, ...]
        pool, blocks = _fields(ev)
        if pool >= t.npools:
            checks.bad_pool(t, pool, "BlockFree")
            return
        alloc, bpage, fix, pfix = t.alloc[pool], t.bpage[pool], t.bfree_ix[pool], t.pfree_ix
        page_alloc, grace, pins, nb = t.page_alloc, t.grace, t.pins, len(alloc)
        ix: Any = t.index  # boxed once (see the note above apply)
        for b in blocks:
            if b >= nb:
                checks.bad_block(t, pool, b, "BlockFree")
                continue
            p: int = bpage[b]
            if not alloc[b]:
                t.violate("I3", "double-free", f"block {b} of pool {pool} freed while not allocated", page=p)
                continue
            alloc[b] = 0
            fix[b] = ix
            pfix[p] = ix
            n: int = page_alloc[p] - 1
            page_alloc[p] = n
            if n:
                continue
            # The page is empty: grace until the open build is built (its jobs may still read it).
            if p not in grace:
                due = t.grace_due.get(t.build)
                if due is None:
                    t.grace_due[t.build] = [p]
                else:
                    due.append(p)
                k: int = pins[p]
                pins[p] = k + 1
                if not k:
                    t.pinned_pages += 1
                    if t.pinned_pages > t.peak_pinned_pages:
                        t.peak_pinned_pages = t.pinned_pages
            grace[p] = ix
            if t.legacy and t.mapped[p] and p not in t.releasable:
                t.releasable.add(p)
                t.fresh.append(p)

    def _job_built(self, ev: JobBuilt) -> None:
        t = self.tables
        groups: tuple[tuple[int, ...], ...]
        job, kind, req, groups, workers = _fields(ev)
        jobs = t.jobs
        if job in jobs:
            t.violate("I3", "duplicate-job", f"job {job} built again while outstanding", job=job)
            return
        store = kind is _STORE
        pages: list[int] = []
        epoch, mapped = t.epoch, t.mapped
        lost = False
        last = -1
        for pool in range(len(groups)):
            ids: tuple[int, ...] = groups[pool]
            if not ids:
                continue
            if pool >= t.npools:
                checks.bad_pool(t, pool, f"job {job}")
                return
            bpage, bepoch = t.bpage[pool], t.bepoch[pool]
            try:
                # A store reads intact data only if the page was not unmapped since the block
                # was written (epoch -1: never written); a load needs its page mapped. Blocks
                # of a job come in runs, so comparing with the last page dedupes most of them.
                if store:
                    for b in ids:
                        p: int = bpage[b]
                        if p != last:
                            pages.append(p)
                            last = p
                        e: int = bepoch[b]
                        if e != epoch[p]:
                            lost = True
                else:
                    for b in ids:
                        p = bpage[b]
                        if p != last:
                            pages.append(p)
                            last = p
                        if not mapped[p]:
                            lost = True
            except IndexError:
                checks.bad_block(t, pool, max(ids), f"job {job}")
                return
        if len(pages) > 1 and not _increasing(pages):  # runs of blocks give increasing pages
            pages = sorted(set(pages))
        if lost:
            checks.lost_blocks(t, ev)
        if store and t.owners_known:
            checks.store_owner(t, ev)
        outstanding = t.req_jobs.get(req)
        if outstanding is None:
            outstanding = t.req_jobs[req] = [0]
        n: int = outstanding[0]
        outstanding[0] = n + 1
        # A JobState list (see tables.py): building a slotted object costs a third of this budget.
        jobs[job] = [kind, req, pages, workers, 0, t.build, t.index, outstanding]
        jobpins, pins, page_alloc = t.jobpins, t.pins, t.page_alloc
        legacy, unm = t.legacy, t.releasable
        newly = 0
        for p in pages:
            k: int = jobpins[p]
            jobpins[p] = k + 1
            k = pins[p]
            pins[p] = k + 1
            if not k:
                newly += 1
                if not legacy and not page_alloc[p]:  # a page with blocks is never releasable
                    unm.discard(p)
        if newly:  # pins only grow here: the peak is at the end of the event
            n = t.pinned_pages + newly
            t.pinned_pages = n
            if n > t.peak_pinned_pages:
                t.peak_pinned_pages = n
        t.jobs_built += 1

    def _job_failed(self, ev: JobFailed) -> None:
        # Counted only: the pins go with the report that accompanies it (a failed copy is
        # still a finished one, and the memory it read or wrote is no longer touched).
        self.tables.jobs_failed += 1

    def _job_reported(self, ev: JobReported) -> None:
        t = self.tables
        count: int
        job, count = _fields(ev)
        jobs = t.jobs
        st = jobs.pop(job, None)  # one lookup: a job is nearly always done at its first report
        if st is None:
            if not t.lossy:
                t.violate(
                    "I3",
                    "report-unknown-job",
                    f"job {job} reported but not outstanding (never built, or already fully reported)",
                    job=job,
                )
            return
        reported: int = st[4]
        reported += count
        st[4] = reported
        workers: int = st[3]
        if reported < workers:
            jobs[job] = st  # more workers to hear from
            return
        if reported > workers:
            t.violate(
                "I3",
                "over-report",
                f"job {job} reported {plural(reported, 'time')} for {plural(workers, 'worker')}",
                job=job,
                request=t.request_name(st[1]),
            )
        jobpins, pins, legacy = t.jobpins, t.pins, t.legacy
        pages: list[int] = st[2]
        unpinned = 0
        for p in pages:
            k: int = jobpins[p]
            jobpins[p] = k - 1
            n: int = pins[p] - 1
            pins[p] = n
            if not n:
                unpinned += 1
                if not legacy and t.mapped[p] and not t.page_alloc[p]:
                    t.releasable.add(p)
                    t.fresh.append(p)
        t.pinned_pages -= unpinned
        outstanding: list[int] = st[7]  # its request's count in req_jobs
        left: int = outstanding[0] - 1
        outstanding[0] = left
        if not left and t.finished:
            req: Any = st[1]
            if req in t.finished:  # its last job: the finished request is gone
                del t.finished[req]
                del t.req_jobs[req]
                t.names.pop(req, None)
        if t.job_violation:
            checks.late_copy(t, job)

    def _window_hold(self, ev: WindowHold) -> None:
        t = self.tables
        if ev.pool >= t.npools:
            checks.bad_pool(t, ev.pool, "WindowHold")
            return
        bpage = t.bpage[ev.pool]
        pages = {bpage[b] for b in ev.blocks if b < len(bpage) or checks.bad_block(t, ev.pool, b, "WindowHold")}
        req = ev.req
        if t.owners_known:  # a block held in the request's window is its own (I5)
            owned = t.owned.setdefault(req, {})
            for b in ev.blocks:
                owned[ev.pool << 32 | b] = t.index
        mine = t.req_holds.setdefault(req, set())
        for p in pages - mine:
            mine.add(p)
            t.holds.setdefault(p, {})[req] = t.build
            self._pin(p)

    def _release_holds(self, req: int) -> None:
        t = self.tables
        for p in t.req_holds.pop(req, ()):
            h = t.holds[p]
            del h[req]
            if not h:
                del t.holds[p]
            self._unpin(p)

    def _window_release(self, ev: WindowRelease) -> None:
        self._release_holds(ev.req)
        self.tables.preempted.pop(ev.req, None)

    def _request_added(self, ev: RequestAdded) -> None:
        self.tables.names[ev.req] = ev.name

    def _request_finished(self, ev: RequestFinished) -> None:
        t = self.tables
        req = ev.req
        self._release_holds(req)
        t.preempted.pop(req, None)
        if t.owners_known and req in t.owned:
            # Its last stores may still be built in the next build (after the free): forget
            # what it held once that build is built.
            t.owned_due.setdefault(t.build + 1, []).append(req)
        outstanding = t.req_jobs.get(req)
        if outstanding is not None and outstanding[0]:
            t.finished[req] = t.build
            t.finish_due.setdefault(t.build + t.liveness_builds, []).append(req)
        else:
            t.req_jobs.pop(req, None)
            t.names.pop(req, None)

    def _request_preempted(self, ev: RequestPreempted) -> None:
        t = self.tables
        t.preempted[ev.req] = t.build
        t.hold_reported.discard(ev.req)

    def _prefix_cache_reset(self, ev: PrefixCacheReset) -> None:
        self.tables.prefix_cache_resets += 1

    def _request_blocks(self, ev: RequestBlocks) -> None:
        # I5's bookkeeping: who holds a block, and when it was last written (fresh allocation).
        # Hot (hundreds of blocks a step), so as the note above apply says: ids stay the event's
        # int objects, which in pool 0 are the block keys (``pool << 32 | b``), and the tables
        # are used through ``Any`` locals (a ``dict[int, int]`` store unboxes and boxes again).
        t = self.tables
        pool: int
        fresh: tuple[Any, ...]
        shared: tuple[Any, ...]
        req, pool, fresh, shared = _fields(ev)
        if pool >= t.npools:
            checks.bad_pool(t, pool, "RequestBlocks")
            return
        t.owners_known = True
        ix: Any = t.index
        nb = len(t.alloc[pool])
        base: Any = pool << 32
        tables_owned: dict[Any, Any] = t.owned
        owned: dict[Any, Any] | None = tables_owned.get(req)
        if owned is None:
            owned = tables_owned[req] = {}
        written: dict[Any, Any] = t.written
        written_by: dict[Any, Any] = t.written_by
        n: int  # an id unboxed, for a native range check
        for b in fresh:
            n = b
            if n >= nb:
                checks.bad_block(t, pool, b, "RequestBlocks")
                continue
            key = base | b if pool else b
            owned[key] = ix
            written[key] = ix
            written_by[key] = req
        for b in shared:
            n = b
            if n >= nb:
                checks.bad_block(t, pool, b, "RequestBlocks")
                continue
            owned[base | b if pool else b] = ix

    def _memory_limit(self, ev: MemoryLimit) -> None:
        self.tables.limit = ev.pages

    # decisions

    def _page_mapped(self, ev: PageMapped) -> None:
        t = self.tables
        p = ev.page
        if p >= t.num_pages:
            t.violate("I3", "page-out-of-range", f"page {p} mapped; there are {t.num_pages}")
            return
        if t.mapped[p]:
            t.violate("I3", "double-map", f"page {p} mapped while mapped", page=p)
            return
        t.mapped[p] = 1
        t.mapped_pages += 1
        t.maps += 1
        self._refresh(p)

    def _page_unmapped(self, ev: PageUnmapped) -> None:
        t = self.tables
        p = ev.page
        if p >= t.num_pages:
            t.violate("I3", "page-out-of-range", f"page {p} unmapped; there are {t.num_pages}")
            return
        if not t.mapped[p]:
            t.violate("I3", "double-unmap", f"page {p} unmapped while unmapped", page=p)
            return
        if t.page_alloc[p]:
            n = t.page_alloc[p]
            t.violate("I2", "unmap-with-blocks", f"page {p} unmapped with {plural(n, 'block')} allocated", page=p)
        if t.jobpins[p]:
            checks.unmap_under_jobs(t, p)
        t.mapped[p] = 0
        t.epoch[p] += 1
        t.unmap_ix[p] = t.index
        t.mapped_pages -= 1
        t.unmaps += 1
        t.releasable.discard(p)

    def _gap(self, ev: Gap) -> None:
        t = self.tables
        t.lossy = True
        t.dropped_events += ev.dropped

    # --- snapshot and restore -----------------------------------------------------------------

    def snapshot(self) -> LedgerSnapshot:
        return take_snapshot(self.tables)

    @classmethod
    def restore(cls, snap: LedgerSnapshot) -> Ledger:
        """A ledger that goes on exactly where ``snap`` was taken."""
        ledger = cls(snap.header, snap.policy, liveness_builds=snap.liveness_builds)
        restore_snapshot(ledger.tables, snap)  # the inputs, and the indexes over them
        for p in range(ledger.tables.num_pages):  # the output, by the rule of the live path
            ledger._refresh(p)
        ledger.tables.fresh = []
        return ledger


def _increasing(xs: list[int]) -> bool:
    prev = -1
    for x in xs:
        if x <= prev:
            return False
        prev = x
    return True
