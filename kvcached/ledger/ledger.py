"""The pin ledger: the one place where events become the set of pages that may be unmapped.

The allocator (live) and kvreplay (offline) both feed events to ``Ledger.apply`` and both ask
it the same questions, so a bug reproduced by replay is a bug of the code that serves. The
ledger is synchronous, pure (it performs no I/O and no unmapping) and incremental: an event
touches only the pages it names, so it can sit on vLLM's scheduler thread.

A page is *unmappable* under ``legacy`` when it is mapped and holds no allocated block, and
under ``ledger`` when, in addition, nothing pins it. Pins are of three kinds:

* job pin: the pages of a transfer job's blocks, from the build that returns the job until its
  workers have reported it as many times as it has workers;
* grace: a page emptied by a free stays until the build open at the time of the free has been
  built, because vLLM builds the last-block store of a finished request in that build;
* window hold: pages of a request's sliding-window blocks, until its last build
  (``RequestFinished``) or until native matching drops its old block lists (``WindowRelease``).

Invariants I1-I4 (see ``findings.INVARIANTS``) are checked on every event. A violation is
recorded as a value and the ledger keeps going: replay must see every violation, not the first.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Set
from typing import Any

import msgspec

from .events import (
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
    Policy,
    PrefixCacheReset,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    WindowHold,
    WindowRelease,
)
from .findings import ChainLink, PageStatus, PinReason, Violation
from .state import JobState, LedgerSnapshot

DEFAULT_LIVENESS_BUILDS = 16


class Ledger:
    """Derives the unmappable pages from events and checks invariants I1-I4 on each."""

    def __init__(
        self,
        header: Header,
        policy: Policy | str | None = None,
        *,
        liveness_builds: int = DEFAULT_LIVENESS_BUILDS,
    ) -> None:
        self.header = header
        self.policy = Policy(policy) if policy is not None else header.policy
        self._legacy = self.policy is Policy.LEGACY
        self.liveness_builds = liveness_builds
        self._bpp: list[int] = []
        self._first: list[int] = []
        pages = 0
        for pool in header.pools:
            bpp = header.page_bytes // pool.block_bytes
            if bpp < 1:
                from ..errors import ConfigError

                raise ConfigError(
                    f"a block of {pool.block_bytes} bytes does not fit a {header.page_bytes}-byte page: "
                    "raise KVCACHED_PAGE_SIZE_MB or lower the block size"
                )
            self._bpp.append(bpp)
            self._first.append(pages)
            pages += -(-pool.num_blocks // bpp)
        self.num_pages = pages
        nb = [p.num_blocks for p in header.pools]
        # Per block: allocated flag, page epoch when written, event indices for witnesses.
        self._alloc = [bytearray(n) for n in nb]
        self._bepoch = [[0] * n for n in nb]
        self._balloc_ix = [[-1] * n for n in nb]
        self._bfree_ix = [[-1] * n for n in nb]
        # Per page.
        self._page_alloc = [0] * pages
        self._mapped = bytearray(pages)
        self._epoch = [0] * pages  # number of unmaps so far: a block written in another epoch is lost
        self._unmap_ix = [-1] * pages
        self._pfree_ix = [-1] * pages
        self._pins = [0] * pages
        self._page_jobs: dict[int, set[int]] = {}
        self._grace: dict[int, int] = {}  # page -> index of the free that emptied it
        self._grace_due: dict[int, list[int]] = {}  # build -> pages whose grace ends there
        self._holds: dict[int, dict[int, int]] = {}  # page -> {req: since build}
        self._req_holds: dict[int, set[int]] = {}
        self._jobs: dict[int, JobState] = {}
        self._req_jobs: dict[int, set[int]] = {}
        self._names: dict[int, str] = {}
        self._finished: dict[int, int] = {}  # req -> build of its last build, while jobs remain
        self._finish_due: dict[int, list[int]] = {}
        self._preempted: dict[int, int] = {}
        self._unmappable: set[int] = set()
        self._fresh: list[int] = []
        self.index = 0
        self.build = 0  # the build being assembled: jobs seen now belong to it
        # Event index of each BuildBoundary and the build it closed, so that a witness can say
        # in which build an old event happened (8 bytes per build, not per event).
        self._boundary_ix: list[int] = []
        self._boundary_build: list[int] = []
        self.limit: int | None = None
        self.mapped_pages = 0
        self.pinned_pages = 0
        self.peak_pinned_pages = 0
        self.lossy = False
        self.dropped_events = 0
        self.violations: list[Violation] = []
        self._job_violation: dict[int, list[int]] = {}
        self._stall_since: int | None = None
        self._stall_reported = False
        self._hold_reported: set[int] = set()
        self.counts: dict[str, int] = {}
        self._dispatch: dict[type, Callable[[Any], None]] = {
            BuildBoundary: self._build_boundary,
            BlockAlloc: self._block_alloc,
            BlockFree: self._block_free,
            JobBuilt: self._job_built,
            JobReported: self._job_reported,
            WindowHold: self._window_hold,
            WindowRelease: self._window_release,
            RequestAdded: self._request_added,
            RequestFinished: self._request_finished,
            RequestPreempted: self._request_preempted,
            PrefixCacheReset: self._prefix_cache_reset,
            MemoryLimit: self._memory_limit,
            PageMapped: self._page_mapped,
            PageUnmapped: self._page_unmapped,
            Gap: self._gap,
        }

    # --- the questions ----------------------------------------------------------------------

    @property
    def unmappable(self) -> Set[int]:
        """Pages that may be unmapped now under the policy (a live view: do not keep it)."""
        return self._unmappable

    def is_unmappable(self, page: int) -> bool:
        return page in self._unmappable

    def is_mapped(self, page: int) -> bool:
        return bool(self._mapped[page])

    def is_pinned(self, page: int) -> bool:
        return self._pins[page] > 0

    def allocated_blocks(self, page: int) -> int:
        return self._page_alloc[page]

    def page_of(self, pool: int, block: int) -> int:
        return self._first[pool] + block // self._bpp[pool]

    def pool_pages(self, pool: int) -> range:
        """The global page ids of ``pool``'s blocks."""
        nb = self.header.pools[pool].num_blocks
        return range(self._first[pool], self._first[pool] + -(-nb // self._bpp[pool]))

    def take_fresh_unmappable(self) -> list[int]:
        """Pages that became unmappable since the last call and still are (for an allocator)."""
        fresh, self._fresh = self._fresh, []
        unm = self._unmappable
        return [p for p in dict.fromkeys(fresh) if p in unm]

    def build_of(self, index: int) -> int:
        """The build an event index belonged to (-1 for an index before the trace)."""
        if index < 0:
            return -1
        k = bisect.bisect_left(self._boundary_ix, index)
        return self._boundary_build[k] if k < len(self._boundary_ix) else self.build

    def outstanding_jobs(self) -> int:
        return len(self._jobs)

    def request_name(self, req: int) -> str:
        return self._names.get(req, f"r{req}")

    def why(self, page: int) -> PageStatus:
        """Every reason ``page`` is kept, in O(pins on the page)."""
        pins: list[PinReason] = []
        for job in sorted(self._page_jobs.get(page, ())):
            st = self._jobs[job]
            pins.append(
                PinReason(
                    kind="job",
                    since_build=st.build,
                    job=job,
                    job_kind="store" if st.kind == JobKind.STORE else "load",
                    request=self.request_name(st.req),
                    waiting_workers=st.workers - st.reported,
                )
            )
        if page in self._grace:
            pins.append(PinReason(kind="grace", since_build=self.build, until_build=self.build))
        for req, since in sorted(self._holds.get(page, {}).items()):
            pins.append(PinReason(kind="window", since_build=since, request=self.request_name(req)))
        return PageStatus(
            page=page,
            mapped=bool(self._mapped[page]),
            allocated_blocks=self._page_alloc[page],
            unmappable=page in self._unmappable,
            policy=self.policy.value,
            pins=tuple(pins),
        )

    def pinned(self) -> Iterable[int]:
        """Pages with at least one pin, in page order (O(pages): for views, not hot paths)."""
        return (p for p, n in enumerate(self._pins) if n)

    # --- applying events ----------------------------------------------------------------------

    def apply(self, event: Event) -> None:
        self._dispatch[type(event)](event)
        self.index += 1

    def apply_all(self, events: Iterable[Event]) -> None:
        dispatch = self._dispatch
        for event in events:
            dispatch[type(event)](event)
            self.index += 1

    # pin bookkeeping; every change of a page's pins or blocks ends in _refresh

    def _refresh(self, p: int) -> None:
        if self._mapped[p] and not self._page_alloc[p] and (self._legacy or not self._pins[p]):
            if p not in self._unmappable:
                self._unmappable.add(p)
                self._fresh.append(p)
        else:
            self._unmappable.discard(p)

    def _pin(self, p: int) -> None:
        n = self._pins[p]
        self._pins[p] = n + 1
        if not n:
            self.pinned_pages += 1
            if self.pinned_pages > self.peak_pinned_pages:
                self.peak_pinned_pages = self.pinned_pages
            if not self._legacy:
                self._unmappable.discard(p)

    def _unpin(self, p: int) -> None:
        n = self._pins[p] - 1
        self._pins[p] = n
        if not n:
            self.pinned_pages -= 1
            self._refresh(p)

    def _violate(self, invariant: Any, code: str, message: str, **kw: Any) -> None:
        self.violations.append(
            Violation(invariant=invariant, code=code, index=self.index, build=self.build, message=message, **kw)
        )

    def _blocks_ok(self, pool: int, blocks: Iterable[int], what: str) -> bool:
        if pool >= len(self._bpp):
            self._violate("I3", "unknown-pool", f"{what} names pool {pool}; the header has {len(self._bpp)}")
            return False
        nb = len(self._alloc[pool])
        bad = [b for b in blocks if b >= nb]
        if bad:
            self._violate("I3", "block-out-of-range", f"{what} names block {bad[0]} of pool {pool}, which has {nb}")
            return False
        return True

    # inputs

    def _build_boundary(self, ev: BuildBoundary) -> None:
        n = ev.build
        if n != self.build and not self.lossy:
            self._violate("I3", "build-out-of-order", f"build {n} closed while build {self.build} was open")
        due = self._grace_due
        if n - self.build <= 64:
            keys: Iterable[int] = range(self.build, n + 1)
        else:
            keys = [k for k in due if k <= n]
        for k in keys:
            for p in due.pop(k, ()):
                if self._grace.pop(p, None) is not None:
                    self._unpin(p)
            for req in self._finish_due.pop(k, ()):
                self._check_finished(req, n)
        self._boundary_ix.append(self.index)
        self._boundary_build.append(n)
        self.build = n + 1
        self.counts["builds"] = self.counts.get("builds", 0) + 1
        if self.limit is not None and self.mapped_pages > self.limit:
            self._check_shrink(n)
        else:
            self._stall_since = None
            self._stall_reported = False

    def _block_alloc(self, ev: BlockAlloc) -> None:
        pool = ev.pool
        if not self._blocks_ok(pool, ev.blocks, "BlockAlloc"):
            return
        alloc, bepoch, aix = self._alloc[pool], self._bepoch[pool], self._balloc_ix[pool]
        first, bpp = self._first[pool], self._bpp[pool]
        page_alloc, mapped, epoch, i = self._page_alloc, self._mapped, self._epoch, self.index
        for b in ev.blocks:
            if alloc[b]:
                self._violate("I3", "double-alloc", f"block {b} of pool {pool} allocated twice", page=first + b // bpp)
                continue
            p = first + b // bpp
            if not mapped[p]:
                self._violate("I2", "alloc-on-unmapped", f"block {b} of pool {pool} handed out on an unmapped page", page=p)
            alloc[b] = 1
            bepoch[b] = epoch[p]
            aix[b] = i
            n = page_alloc[p]
            page_alloc[p] = n + 1
            if not n:
                self._unmappable.discard(p)

    def _block_free(self, ev: BlockFree) -> None:
        pool = ev.pool
        if not self._blocks_ok(pool, ev.blocks, "BlockFree"):
            return
        alloc, fix = self._alloc[pool], self._bfree_ix[pool]
        first, bpp = self._first[pool], self._bpp[pool]
        page_alloc, grace, i = self._page_alloc, self._grace, self.index
        for b in ev.blocks:
            p = first + b // bpp
            if not alloc[b]:
                self._violate("I3", "double-free", f"block {b} of pool {pool} freed while not allocated", page=p)
                continue
            alloc[b] = 0
            fix[b] = i
            self._pfree_ix[p] = i
            n = page_alloc[p] - 1
            page_alloc[p] = n
            if not n:
                if p not in grace:
                    self._grace_due.setdefault(self.build, []).append(p)
                    self._pin(p)
                grace[p] = i
                self._refresh(p)

    def _job_built(self, ev: JobBuilt) -> None:
        job = ev.job
        if job in self._jobs:
            self._violate("I3", "duplicate-job", f"job {job} built again while outstanding", job=job)
            return
        store = ev.kind == JobKind.STORE
        pages: dict[int, None] = {}
        lost: list[tuple[int, int, int]] = []
        mapped, epoch = self._mapped, self._epoch
        for pool, ids in enumerate(ev.blocks):
            if not ids:
                continue
            if not self._blocks_ok(pool, ids, f"job {job}"):
                return
            first, bpp, bepoch, aix = self._first[pool], self._bpp[pool], self._bepoch[pool], self._balloc_ix[pool]
            for b in ids:
                p = first + b // bpp
                pages[p] = None
                if store:
                    if aix[b] < 0:
                        if not self.lossy:
                            self._violate("I3", "job-on-unwritten-block", f"store job {job} reads block {b} of pool {pool}, never allocated", job=job, page=p)
                    elif bepoch[b] != epoch[p]:
                        lost.append((pool, b, p))
                elif not mapped[p]:
                    lost.append((pool, b, p))
        st = JobState(kind=int(ev.kind), req=ev.req, pages=tuple(pages), workers=ev.workers, build=self.build, index=self.index)
        self._jobs[job] = st
        self._req_jobs.setdefault(ev.req, set()).add(job)
        page_jobs = self._page_jobs
        for p in pages:
            s = page_jobs.get(p)
            if s is None:
                page_jobs[p] = {job}
            else:
                s.add(job)
            self._pin(p)
        self.counts["jobs"] = self.counts.get("jobs", 0) + 1
        if lost:
            self._lost_data(ev, store, lost)

    def _lost_data(self, ev: JobBuilt, store: bool, lost: list[tuple[int, int, int]]) -> None:
        pool, b, p = lost[0]
        req = self.request_name(ev.req)
        if store:
            msg = (f"store job {ev.job} copies block {b} of pool {pool} after its page {p} was unmapped "
                   f"(the copy reads zeros or another tenant's bytes)")
            chain = (
                ChainLink(step="alloc", index=self._balloc_ix[pool][b], build=-1, what=f"block {b} written (allocated)"),
                ChainLink(step="free", index=self._bfree_ix[pool][b], build=-1, what=f"block {b} freed"),
                ChainLink(step="unmap", index=self._unmap_ix[p], build=-1, what=f"page {p} unmapped"),
                ChainLink(step="late copy", index=self.index, build=self.build, what=f"store job {ev.job} built over block {b}"),
            )
        else:
            msg = f"load job {ev.job} writes block {b} of pool {pool} into unmapped page {p}"
            chain = (ChainLink(step="late copy", index=self.index, build=self.build, what=f"load job {ev.job} built"),)
        extra = f" (+{len(lost) - 1} more block(s))" if len(lost) > 1 else ""
        self._violate("I1", "copy-of-lost-block", msg + extra, page=p, job=ev.job, request=req, chain=_strip(self, chain))

    def _job_reported(self, ev: JobReported) -> None:
        st = self._jobs.get(ev.job)
        if st is None:
            if not self.lossy:
                self._violate("I3", "report-unknown-job", f"job {ev.job} reported but not outstanding (never built, or already fully reported)", job=ev.job)
            return
        st.reported += ev.count
        if st.reported > st.workers:
            self._violate("I3", "over-report", f"job {ev.job} reported {st.reported} times for {st.workers} worker(s)", job=ev.job, request=self.request_name(st.req))
        if st.reported < st.workers:
            return
        del self._jobs[ev.job]
        page_jobs = self._page_jobs
        for p in st.pages:
            s = page_jobs[p]
            s.discard(ev.job)
            if not s:
                del page_jobs[p]
            self._unpin(p)
        jobs = self._req_jobs.get(st.req)
        if jobs is not None:
            jobs.discard(ev.job)
            if not jobs:
                del self._req_jobs[st.req]
                self._forget_if_done(st.req)
        for vi in self._job_violation.pop(ev.job, ()):
            v = self.violations[vi]
            link = ChainLink(step="late copy", index=self.index, build=self.build, what=f"job {ev.job} completed its copy")
            self.violations[vi] = msgspec.structs.replace(v, chain=v.chain + (link,))

    def _window_hold(self, ev: WindowHold) -> None:
        if not self._blocks_ok(ev.pool, ev.blocks, "WindowHold"):
            return
        first, bpp, req = self._first[ev.pool], self._bpp[ev.pool], ev.req
        mine = self._req_holds.setdefault(req, set())
        for b in ev.blocks:
            p = first + b // bpp
            if p in mine:
                continue
            mine.add(p)
            self._holds.setdefault(p, {})[req] = self.build
            self._pin(p)

    def _release_holds(self, req: int) -> None:
        for p in self._req_holds.pop(req, ()):
            h = self._holds[p]
            del h[req]
            if not h:
                del self._holds[p]
            self._unpin(p)

    def _window_release(self, ev: WindowRelease) -> None:
        self._release_holds(ev.req)
        self._preempted.pop(ev.req, None)

    def _request_added(self, ev: RequestAdded) -> None:
        self._names[ev.req] = ev.name

    def _request_finished(self, ev: RequestFinished) -> None:
        req = ev.req
        self._release_holds(req)
        self._preempted.pop(req, None)
        if req in self._req_jobs:
            self._finished[req] = self.build
            self._finish_due.setdefault(self.build + self.liveness_builds, []).append(req)
        else:
            self._names.pop(req, None)

    def _forget_if_done(self, req: int) -> None:
        if req in self._finished:
            del self._finished[req]
            self._names.pop(req, None)

    def _request_preempted(self, ev: RequestPreempted) -> None:
        self._preempted[ev.req] = self.build
        self._hold_reported.discard(ev.req)

    def _prefix_cache_reset(self, ev: PrefixCacheReset) -> None:
        self.counts["prefix_cache_resets"] = self.counts.get("prefix_cache_resets", 0) + 1

    def _memory_limit(self, ev: MemoryLimit) -> None:
        self.limit = ev.pages

    # decisions

    def _page_mapped(self, ev: PageMapped) -> None:
        p = ev.page
        if p >= self.num_pages:
            self._violate("I3", "page-out-of-range", f"page {p} mapped; there are {self.num_pages}")
            return
        if self._mapped[p]:
            self._violate("I3", "double-map", f"page {p} mapped while mapped", page=p)
            return
        self._mapped[p] = 1
        self.mapped_pages += 1
        self.counts["maps"] = self.counts.get("maps", 0) + 1
        self._refresh(p)

    def _page_unmapped(self, ev: PageUnmapped) -> None:
        p = ev.page
        if p >= self.num_pages:
            self._violate("I3", "page-out-of-range", f"page {p} unmapped; there are {self.num_pages}")
            return
        if not self._mapped[p]:
            self._violate("I3", "double-unmap", f"page {p} unmapped while unmapped", page=p)
            return
        if self._page_alloc[p]:
            self._violate("I2", "unmap-with-blocks", f"page {p} unmapped with {self._page_alloc[p]} block(s) allocated", page=p)
        for job in sorted(self._page_jobs.get(p, ())):
            st = self._jobs[job]
            kind = "store" if st.kind == JobKind.STORE else "load"
            chain = (
                ChainLink(step="pin", index=st.index, build=st.build, what=f"{kind} job {job} built over page {p}"),
                ChainLink(step="free", index=self._pfree_ix[p], build=-1, what=f"last block on page {p} freed"),
                ChainLink(step="unmap", index=self.index, build=self.build, what=f"page {p} unmapped"),
            )
            self._job_violation.setdefault(job, []).append(len(self.violations))
            self._violate(
                "I1", "unmap-under-job",
                f"page {p} unmapped while {kind} job {job} still waits on {st.workers - st.reported} worker(s)",
                page=p, job=job, request=self.request_name(st.req), chain=_strip(self, chain),
            )
        self._mapped[p] = 0
        self._epoch[p] += 1
        self._unmap_ix[p] = self.index
        self.mapped_pages -= 1
        self.counts["unmaps"] = self.counts.get("unmaps", 0) + 1
        self._unmappable.discard(p)

    def _gap(self, ev: Gap) -> None:
        self.lossy = True
        self.dropped_events += ev.dropped

    # --- I4 -----------------------------------------------------------------------------------

    def _check_finished(self, req: int, n: int) -> None:
        jobs = self._req_jobs.get(req)
        if req not in self._finished or not jobs:
            return
        job = min(jobs)
        st = self._jobs[job]
        self._violate(
            "I4", "pin-outlives-request",
            f"job {job} of request {self.request_name(req)}, finished in build {self._finished[req]}, "
            f"still pins {len(st.pages)} page(s) {n - self._finished[req]} builds later "
            f"(waiting on {st.workers - st.reported} worker(s))",
            job=job, request=self.request_name(req), page=st.pages[0] if st.pages else None,
        )

    def _check_shrink(self, n: int) -> None:
        k = self.liveness_builds
        if self._unmappable:
            if self._stall_since is None:
                self._stall_since = n
            elif n - self._stall_since > k and not self._stall_reported:
                self._stall_reported = True
                p = min(self._unmappable)
                self._violate(
                    "I4", "shrink-stalled",
                    f"{self.mapped_pages} pages mapped over a limit of {self.limit} for {n - self._stall_since} "
                    f"builds while {len(self._unmappable)} page(s) could be unmapped",
                    page=p,
                )
        else:
            self._stall_since = None
        for req, since in self._preempted.items():
            held = self._req_holds.get(req)
            if held and n - since > k and req not in self._hold_reported:
                self._hold_reported.add(req)
                self._violate(
                    "I4", "holds-block-shrink",
                    f"window holds of request {self.request_name(req)}, preempted in build {since}, keep "
                    f"{len(held)} page(s) mapped over the limit of {self.limit} for {n - since} builds",
                    request=self.request_name(req), page=min(held),
                )

    # --- snapshot and restore -----------------------------------------------------------------

    def snapshot(self) -> LedgerSnapshot:
        from .state import take_snapshot

        return take_snapshot(self)

    @classmethod
    def restore(cls, snap: LedgerSnapshot) -> Ledger:
        from .state import restore_snapshot

        ledger = cls(snap.header, snap.policy, liveness_builds=snap.liveness_builds)
        restore_snapshot(ledger, snap)
        return ledger


def _strip(ledger: Ledger, chain: tuple[ChainLink, ...]) -> tuple[ChainLink, ...]:
    """Fill in builds and drop links whose event is unknown (index -1: before the trace began)."""
    return tuple(
        c if c.build >= 0 else msgspec.structs.replace(c, build=ledger.build_of(c.index))
        for c in chain
        if c.index >= 0
    )
