"""The pin ledger: the one place where events become the set of pages that may be unmapped.

The allocator (live) and kvreplay (offline) both feed events to ``Ledger.apply`` and both ask
it the same questions, so a bug reproduced by replay is a bug of the code that serves. The
ledger is synchronous, pure (it performs no I/O and no unmapping) and incremental: an event
touches only the pages it names, so it can sit on vLLM's scheduler thread.

A page is *releasable* (it may be unmapped now, its memory given back) under ``legacy`` when it
is mapped and holds no allocated block, and under ``ledger`` when, in addition, nothing pins it.
(Earlier versions of this project and its design brief said "unmappable"; we avoid the word,
which most readers take to mean "cannot be mapped".) Pins are of three kinds:

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
from array import array
from collections.abc import Callable, Iterable, Set
from typing import Any

from ..errors import ConfigError
from . import checks
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
from .findings import InvariantId, PageStatus, PinReason, Violation
from .state import JobState, LedgerSnapshot

DEFAULT_LIVENESS_BUILDS = 16


class Ledger:
    """Derives the releasable pages from events and checks invariants I1-I4 on each."""

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
                raise ConfigError(
                    f"a block of {pool.block_bytes} bytes does not fit a {header.page_bytes}-byte page: "
                    "raise KVCACHED_PAGE_SIZE_MB or lower the block size"
                )
            self._bpp.append(bpp)
            self._first.append(pages)
            pages += -(-pool.num_blocks // bpp)
        self.num_pages = pages
        nb = [p.num_blocks for p in header.pools]
        # Per block: its page, allocated flag, page epoch when written (-1: never), and event
        # indices for witnesses.
        self._npools = len(nb)
        self._bpage = [
            [first + b // bpp for b in range(n)] for first, bpp, n in zip(self._first, self._bpp, nb, strict=True)
        ]
        self._alloc = [bytearray(n) for n in nb]
        self._bepoch = [[-1] * n for n in nb]
        self._balloc_ix = [[-1] * n for n in nb]
        self._bfree_ix = [[-1] * n for n in nb]
        # Per page.
        self._page_alloc = [0] * pages
        self._mapped = bytearray(pages)
        self._epoch = [0] * pages  # number of unmaps so far: a block written in another epoch is lost
        self._unmap_ix = [-1] * pages
        self._pfree_ix = [-1] * pages
        self._pins = [0] * pages
        # Jobs built over each page since its job pins were last zero, oldest first. A report does
        # not touch this (it only counts _jobpins down), so entries of reported jobs linger until
        # the page's next job starts a fresh list; readers filter with jobs_on(page).
        self._page_jobs: dict[int, list[int]] = {}
        self._jobpins = [0] * pages
        self._grace: dict[int, int] = {}  # page -> index of the free that emptied it
        self._grace_due: dict[int, list[int]] = {}  # build -> pages whose grace ends there
        self._holds: dict[int, dict[int, int]] = {}  # page -> {req: since build}
        self._req_holds: dict[int, set[int]] = {}
        self._jobs: dict[int, JobState] = {}
        self._req_jobs: dict[int, int] = {}  # request -> its outstanding jobs (a count)
        self._names: dict[int, str] = {}
        self._finished: dict[int, int] = {}  # req -> build of its last build, while jobs remain
        self._finish_due: dict[int, list[int]] = {}
        self._preempted: dict[int, int] = {}
        self._releasable: set[int] = set()
        self._fresh: list[int] = []
        self.index = 0
        self.build = 0  # the build being assembled: jobs seen now belong to it
        # Event index of each BuildBoundary and the build it closed, so that a witness can say
        # in which build an old event happened: 16 bytes per build in two int64 arrays (a list
        # would cost ~90 bytes a build and make a 10-million-event replay grow visibly).
        self._boundary_ix = array("q")
        self._boundary_build = array("q")
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
        self.builds = self.jobs_built = self.maps = self.unmaps = self.prefix_cache_resets = 0
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
    def releasable(self) -> Set[int]:
        """Pages that may be unmapped now under the policy (a live view: do not keep it)."""
        return self._releasable

    def is_releasable(self, page: int) -> bool:
        return page in self._releasable

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

    def take_fresh_releasable(self) -> list[int]:
        """Pages that became releasable since the last call and still are (for an allocator)."""
        fresh, self._fresh = self._fresh, []
        unm = self._releasable
        return [p for p in dict.fromkeys(fresh) if p in unm]

    def build_of(self, index: int) -> int:
        """The build an event index belonged to (-1 for an index before the trace)."""
        if index < 0:
            return -1
        k = bisect.bisect_left(self._boundary_ix, index)
        return self._boundary_build[k] if k < len(self._boundary_ix) else self.build

    def counters(self) -> dict[str, int]:
        """Totals for summaries: events, builds, jobs, maps, unmaps, peaks."""
        return {
            "events": self.index,
            "builds": self.builds,
            "jobs": self.jobs_built,
            "outstanding_jobs": len(self._jobs),
            "maps": self.maps,
            "unmaps": self.unmaps,
            "mapped_pages": self.mapped_pages,
            "pinned_pages": self.pinned_pages,
            "peak_pinned_pages": self.peak_pinned_pages,
            "prefix_cache_resets": self.prefix_cache_resets,
            "dropped_events": self.dropped_events,
        }

    def pending_grace_pages(self) -> int:
        """Pages held only until a coming build: the engine must keep building to drain them."""
        return len(self._grace)

    def outstanding_jobs(self) -> int:
        return len(self._jobs)

    def request_name(self, req: int) -> str:
        return self._names.get(req, f"r{req}")

    def jobs_on(self, page: int) -> list[int]:
        """Outstanding jobs pinning ``page``, by id, in O(jobs built on it since it was last free)."""
        if not self._jobpins[page]:
            return []
        jobs = self._jobs
        return sorted(j for j in self._page_jobs[page] if j in jobs and page in jobs[j][2])

    def why(self, page: int) -> PageStatus:
        """Every reason ``page`` is kept, in O(pins on the page)."""
        pins: list[PinReason] = []
        for job in self.jobs_on(page):
            kind, req, _, workers, reported, build, _ = self._jobs[job]
            pins.append(
                PinReason(
                    kind="job",
                    since_build=build,
                    job=job,
                    job_kind="store" if kind == JobKind.STORE else "load",
                    request=self.request_name(req),
                    waiting_workers=workers - reported,
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
            releasable=page in self._releasable,
            policy=self.policy.value,
            pins=tuple(pins),
        )

    def pinned(self) -> Iterable[int]:
        """Pages with at least one pin, in page order (O(pages): for views, not hot paths)."""
        return (p for p, n in enumerate(self._pins) if n)

    # --- applying events ----------------------------------------------------------------------
    # The handlers below are the scheduler's hot path (budget: about 1 us per free or report on
    # a 2-core machine), so they bind locals, inline the pin bookkeeping and use C-level map()
    # over block ids; the rare paths (violations, I4) live in ``checks``.

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
        self.index += 1

    def apply_all(self, events: Iterable[Event]) -> None:
        for event in events:
            self.apply(event)

    def _refresh(self, p: int) -> None:
        if self._mapped[p] and not self._page_alloc[p] and (self._legacy or not self._pins[p]):
            if p not in self._releasable:
                self._releasable.add(p)
                self._fresh.append(p)
        else:
            self._releasable.discard(p)

    def _pin(self, p: int) -> None:
        n = self._pins[p]
        self._pins[p] = n + 1
        if not n:
            self.pinned_pages += 1
            if self.pinned_pages > self.peak_pinned_pages:
                self.peak_pinned_pages = self.pinned_pages
            if not self._legacy:
                self._releasable.discard(p)

    def _unpin(self, p: int) -> None:
        n = self._pins[p] - 1
        self._pins[p] = n
        if not n:
            self.pinned_pages -= 1
            if not self._legacy and self._mapped[p] and not self._page_alloc[p] and p not in self._releasable:
                self._releasable.add(p)
                self._fresh.append(p)

    def _violate(self, invariant: InvariantId, code: str, message: str, **kw: Any) -> None:
        self.violations.append(
            Violation(invariant=invariant, code=code, index=self.index, build=self.build, message=message, **kw)
        )

    # inputs

    def _build_boundary(self, ev: BuildBoundary) -> None:
        n = ev.build
        if n != self.build and not self.lossy:
            self._violate("I3", "build-out-of-order", f"build {n} closed while build {self.build} was open")
        due = self._grace_due
        keys: Iterable[int] = range(self.build, n + 1) if 0 <= n - self.build <= 64 else [k for k in due if k <= n]
        grace = self._grace
        for k in keys:
            pages = due.pop(k, None)
            if pages:
                for p in pages:
                    if grace.pop(p, None) is not None:
                        self._unpin(p)
            reqs = self._finish_due.pop(k, None)
            if reqs:
                for req in reqs:
                    checks.finished_request(self, req, n)
        self._boundary_ix.append(self.index)
        self._boundary_build.append(n)
        self.build = n + 1
        self.builds += 1
        if self.limit is not None and self.mapped_pages > self.limit:
            checks.shrink(self, n)
        elif self._stall_since is not None or self._stall_reported:
            self._stall_since = None
            self._stall_reported = False

    def _block_alloc(self, ev: BlockAlloc) -> None:
        pool = ev.pool
        if pool >= self._npools:
            checks.bad_pool(self, pool, "BlockAlloc")
            return
        alloc, bpage, bepoch, aix = self._alloc[pool], self._bpage[pool], self._bepoch[pool], self._balloc_ix[pool]
        page_alloc, mapped, epoch, i, nb = self._page_alloc, self._mapped, self._epoch, self.index, len(alloc)
        blocks: tuple[int, ...] = ev.blocks  # typed for mypyc: native ints in the loop
        for b in blocks:
            if b >= nb:
                checks.bad_block(self, pool, b, "BlockAlloc")
                continue
            p = bpage[b]
            if alloc[b]:
                self._violate("I3", "double-alloc", f"block {b} of pool {pool} allocated twice", page=p)
                continue
            if not mapped[p]:
                self._violate("I2", "alloc-on-unmapped", f"block {b} of pool {pool} given on an unmapped page", page=p)
            alloc[b] = 1
            bepoch[b] = epoch[p]
            aix[b] = i
            n = page_alloc[p]
            page_alloc[p] = n + 1
            if not n:
                self._releasable.discard(p)

    def _block_free(self, ev: BlockFree) -> None:
        pool = ev.pool
        if pool >= self._npools:
            checks.bad_pool(self, pool, "BlockFree")
            return
        alloc, bpage, fix, pfix = self._alloc[pool], self._bpage[pool], self._bfree_ix[pool], self._pfree_ix
        page_alloc, grace, pins, i, nb = self._page_alloc, self._grace, self._pins, self.index, len(alloc)
        blocks: tuple[int, ...] = ev.blocks  # typed for mypyc: native ints in the loop
        for b in blocks:
            if b >= nb:
                checks.bad_block(self, pool, b, "BlockFree")
                continue
            p = bpage[b]
            if not alloc[b]:
                self._violate("I3", "double-free", f"block {b} of pool {pool} freed while not allocated", page=p)
                continue
            alloc[b] = 0
            fix[b] = i
            pfix[p] = i
            n = page_alloc[p] - 1
            page_alloc[p] = n
            if n:
                continue
            # The page is empty: grace until the open build is built (its jobs may still read it).
            if p not in grace:
                due = self._grace_due.get(self.build)
                if due is None:
                    self._grace_due[self.build] = [p]
                else:
                    due.append(p)
                k = pins[p]
                pins[p] = k + 1
                if not k:
                    self.pinned_pages += 1
                    if self.pinned_pages > self.peak_pinned_pages:
                        self.peak_pinned_pages = self.pinned_pages
            grace[p] = i
            if self._legacy and self._mapped[p] and p not in self._releasable:
                self._releasable.add(p)
                self._fresh.append(p)

    def _job_built(self, ev: JobBuilt) -> None:
        job = ev.job
        if job in self._jobs:
            self._violate("I3", "duplicate-job", f"job {job} built again while outstanding", job=job)
            return
        store = ev.kind == 0  # JobKind.STORE
        pages: list[int] = []
        epoch, mapped = self._epoch, self._mapped
        lost = False
        last = -1
        groups: tuple[tuple[int, ...], ...] = ev.blocks
        for pool in range(len(groups)):
            ids: tuple[int, ...] = groups[pool]
            if not ids:
                continue
            if pool >= self._npools:
                checks.bad_pool(self, pool, f"job {job}")
                return
            bpage, bepoch = self._bpage[pool], self._bepoch[pool]
            try:
                # A store reads intact data only if the page was not unmapped since the block
                # was written (epoch -1: never written); a load needs its page mapped. Blocks
                # of a job come in runs, so comparing with the last page dedupes most of them.
                if store:
                    for b in ids:
                        p = bpage[b]
                        if p != last:
                            pages.append(p)
                            last = p
                        if bepoch[b] != epoch[p]:
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
                checks.bad_block(self, pool, max(ids), f"job {job}")
                return
        if len(pages) > 1 and not _increasing(pages):  # runs of blocks give increasing pages
            pages = list(dict.fromkeys(pages))
        if lost:
            checks.lost_blocks(self, ev)
        # [kind, req, pages, workers, reported, build, index]: a list, because building a
        # slotted object costs a third of this handler's budget.
        req = ev.req
        self._jobs[job] = [ev.kind, req, tuple(pages), ev.workers, 0, self.build, self.index]
        req_jobs = self._req_jobs
        req_jobs[req] = req_jobs.get(req, 0) + 1
        page_jobs, jobpins, pins = self._page_jobs, self._jobpins, self._pins
        legacy, unm = self._legacy, self._releasable
        for p in pages:
            k = jobpins[p]
            jobpins[p] = k + 1
            if not k:
                page_jobs[p] = [job]
            else:
                lst = page_jobs[p]
                lst.append(job)
                if len(lst) > 2 * k + 8:  # a page that never comes free: drop reported jobs, amortised O(1)
                    page_jobs[p] = [j for j in lst if j in self._jobs]
            k = pins[p]
            pins[p] = k + 1
            if not k:
                self.pinned_pages += 1
                if self.pinned_pages > self.peak_pinned_pages:
                    self.peak_pinned_pages = self.pinned_pages
                if not legacy:
                    unm.discard(p)
        self.jobs_built += 1

    def _job_reported(self, ev: JobReported) -> None:
        # Local annotations are for mypyc: typed ints and tuples compile to native operations.
        job: int = ev.job
        st = self._jobs.get(job)
        if st is None:
            if not self.lossy:
                self._violate(
                    "I3", "report-unknown-job",
                    f"job {job} reported but not outstanding (never built, or already fully reported)", job=job,
                )
            return
        count: int = ev.count
        reported: int = st[4] + count
        st[4] = reported
        workers: int = st[3]
        if reported < workers:
            return
        if reported > workers:
            self._violate(
                "I3", "over-report", f"job {job} reported {reported} times for {workers} worker(s)",
                job=job, request=self.request_name(st[1]),
            )
        del self._jobs[job]
        jobpins, pins = self._jobpins, self._pins
        pages: tuple[int, ...] = st[2]
        for p in pages:
            jobpins[p] -= 1
            n = pins[p] - 1
            pins[p] = n
            if not n:
                self.pinned_pages -= 1
                if not self._legacy and self._mapped[p] and not self._page_alloc[p]:
                    self._releasable.add(p)
                    self._fresh.append(p)
        req: int = st[1]
        left = self._req_jobs[req] - 1
        if left:
            self._req_jobs[req] = left
        else:
            del self._req_jobs[req]
            if req in self._finished:
                del self._finished[req]
                self._names.pop(req, None)
        if self._job_violation:
            checks.late_copy(self, job)

    def _window_hold(self, ev: WindowHold) -> None:
        if ev.pool >= self._npools:
            checks.bad_pool(self, ev.pool, "WindowHold")
            return
        bpage = self._bpage[ev.pool]
        pages = {bpage[b] for b in ev.blocks if b < len(bpage) or checks.bad_block(self, ev.pool, b, "WindowHold")}
        req = ev.req
        mine = self._req_holds.setdefault(req, set())
        for p in pages - mine:
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

    def _request_preempted(self, ev: RequestPreempted) -> None:
        self._preempted[ev.req] = self.build
        self._hold_reported.discard(ev.req)

    def _prefix_cache_reset(self, ev: PrefixCacheReset) -> None:
        self.prefix_cache_resets += 1

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
        self.maps += 1
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
            n = self._page_alloc[p]
            self._violate("I2", "unmap-with-blocks", f"page {p} unmapped with {n} block(s) allocated", page=p)
        if self._jobpins[p]:
            checks.unmap_under_jobs(self, p)
        self._mapped[p] = 0
        self._epoch[p] += 1
        self._unmap_ix[p] = self.index
        self.mapped_pages -= 1
        self.unmaps += 1
        self._releasable.discard(p)

    def _gap(self, ev: Gap) -> None:
        self.lossy = True
        self.dropped_events += ev.dropped

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


def _increasing(xs: list[int]) -> bool:
    prev = -1
    for x in xs:
        if x <= prev:
            return False
        prev = x
    return True
