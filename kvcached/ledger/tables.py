"""The ledger's state, declared once: every table and counter that ``Ledger.apply`` keeps.

Besides the ledger's hot handlers, three readers need this state: the slow paths that build
witnesses and check liveness (``checks``), snapshot and restore (``state``), and the live view's
pin listing (``kvcached.service.live.pin_rows``). So the state is one object, a ``LedgerTables``
that the ledger holds as ``ledger.tables`` and the readers take instead of the ledger.
"""

from __future__ import annotations

import bisect
from array import array
from typing import Any

from ..errors import ConfigError
from .events import Header, Policy
from .findings import InvariantId, Violation

# An outstanding job: [kind, req, pages, workers, reported, build, index, count], where count
# is its request's entry of ``req_jobs``. A list, not an object, because it is made and dropped
# on the hot path (a slotted object would cost a third of JobBuilt's budget); ``reported`` is
# counted up in place. ``pages`` is the sorted list JobBuilt made (a tuple of it cost ~75
# instructions an event of compiled replay, by callgrind).
JobState = list[Any]


class LedgerTables:
    """The ledger's mutable state. ``Ledger`` changes it; readers read it and add violations.

    Comments say what a field holds; "(derived)" marks the fields that a snapshot leaves out
    and ``state.restore_snapshot`` rebuilds from the others.

    NOTE: the readers take these tables, not ``Ledger``'s private attributes, so that a field is
    spelled in one file and ``ledger``, ``checks`` and ``state`` do not know each other (an import
    cycle, if only through type-checking imports). The fields are public, typed and commented
    here; nothing here says how events change them (those rules stay in ``ledger.py``).

    NOTE: adding a field is its declaration and initial value here plus, if a restart must keep
    it, the field of the same name in ``state.LedgerSnapshot``. ``state`` copies every snapshot
    field to and from the table of that name and rebuilds the rest, and tests/test_ledger.py
    checks that each field here is kept, fixed or rebuilt.

    NOTE: besides data the class has the few reads that the ledger, the checks and the live view
    share (``build_of``, ``request_name``, ``jobs_on``) and the one write the checks make
    (``violate``). It is compiled by mypyc together with ``ledger.py`` (setup.py): a native class,
    so ``t.jobs`` in a compiled handler is a load at a fixed offset, as an attribute of the ledger
    itself would be.
    """

    # --- configuration and geometry: fixed by the constructor ---
    header: Header
    policy: Policy
    legacy: bool  # policy is legacy: pins do not keep a page
    liveness_builds: int  # I4: builds a finished request's jobs, or a stalled shrink, may take
    num_pages: int
    npools: int
    bpp: list[int]  # per pool: blocks per page
    first: list[int]  # per pool: the global id of its first page
    bpage: list[list[int]]  # per pool, per block: its global page

    # --- per pool, per block ---
    # Flags are lists of 0 and 1, not bytearrays: mypyc indexes a list natively and a bytearray
    # through the generic protocol, boxing the index (a fifth of BlockAlloc's cost, by callgrind).
    alloc: list[list[int]]  # 1 while allocated
    bepoch: list[list[int]]  # its page's epoch when it was last allocated (written); -1: never
    balloc_ix: list[list[int]]  # event index of its last alloc (-1: none), for witnesses
    bfree_ix: list[list[int]]  # event index of its last free (-1: none), for witnesses

    # --- per page ---
    page_alloc: list[int]  # blocks allocated on it
    mapped: list[int]  # 1 while mapped
    epoch: list[int]  # unmaps so far: a block written in another epoch is lost
    unmap_ix: list[int]  # event index of its last unmap (-1: none)
    pfree_ix: list[int]  # event index of the last free of one of its blocks (-1: none)
    pins: list[int]  # job pins + grace + window holds on it (derived)
    # Outstanding jobs over it (derived). Which jobs those are is not indexed: ``jobs_on`` finds
    # them in ``jobs``, for the slow paths that ask (why, a violation's witness, kvctl pins). A
    # page -> jobs index cost a dict update and a list per job page on the hot path.
    jobpins: list[int]

    # --- grace and window holds ---
    grace: dict[int, int]  # page -> event index of the free that emptied it
    grace_due: dict[int, list[int]]  # build -> pages whose grace ends when it is built (derived)
    holds: dict[int, dict[int, int]]  # page -> {request: build since which it holds the page}
    req_holds: dict[int, set[int]]  # request -> the pages it holds (derived)

    # --- jobs and requests ---
    jobs: dict[int, JobState]  # outstanding jobs by id (a snapshot keeps them as JobRecords)
    # request -> [its outstanding jobs], a count in a one-item list that its jobs share (the
    # last item of a JobState), so that a report counts it down without looking the request up.
    # The entry lives from the request's first job until it has finished and has no job left;
    # a request that has not finished keeps it at zero. (derived: restore makes the non-zero ones)
    req_jobs: dict[int, list[int]]
    names: dict[int, str]  # request -> its name, while the request or its jobs live
    finished: dict[int, int]  # request -> the build of its last build, while its jobs remain
    finish_due: dict[int, list[int]]  # build -> finished requests whose jobs must be reported by then
    preempted: dict[int, int]  # request -> the build it was preempted in, until it finishes or releases

    # --- block ownership (I5), from RequestBlocks; unchecked until the first one ---
    owners_known: bool  # a RequestBlocks was seen: the producer says which request holds which block
    # request -> {block key: event index since which it holds (or held) the block}; a block key
    # is ``pool << 32 | block``. Dropped one build after the request's last build.
    owned: dict[int, dict[int, int]]
    written: dict[int, int]  # block key -> event index of its last fresh allocation
    # block key -> the request given it then. Two tables of ints, not an [index, request] list
    # per block (as a snapshot keeps them): a list is an object the garbage collector tracks,
    # and a fresh block made one, every scheduler step. (derived: restore splits the snapshot's)
    written_by: dict[int, int]
    owned_due: dict[int, list[int]]  # build -> finished requests whose ownership is forgotten then

    # --- the event stream ---
    index: int  # events applied: the index of the next one
    build: int  # the build being assembled: jobs seen now belong to it
    # Event index of each BuildBoundary and the build it closed, so that a witness can say in
    # which build an old event happened: 16 bytes per build in two int64 arrays (a list would
    # cost ~90 bytes a build and make a 10-million-event replay grow visibly).
    boundary_ix: array[int]
    boundary_build: array[int]
    lossy: bool  # a Gap was seen: events are missing, so some I3 checks are off
    dropped_events: int  # events the Gaps say were lost

    # --- memory limit and liveness (I4) ---
    limit: int | None  # pages the engine may keep mapped (MemoryLimit); None: no limit
    stall_since: int | None  # build since which a shrink over the limit has been possible
    over_limit_since: int | None  # build since which the mapped pages have been over the limit
    stall_reported: bool  # that stall has been reported (once per stall)
    hold_reported: set[int]  # preempted requests whose holds over the limit have been reported

    # --- findings ---
    violations: list[Violation]  # every violation, in order
    job_violation: dict[int, list[int]]  # job -> its unmap-under-job violations (indices), for late_copy

    # --- counters ---
    mapped_pages: int  # (derived)
    pinned_pages: int  # pages with a pin (derived)
    peak_pinned_pages: int
    builds: int
    jobs_built: int
    jobs_failed: int  # JobFailed events: copies a worker reported failed
    maps: int
    unmaps: int
    prefix_cache_resets: int

    # --- the output ---
    releasable: set[int]  # pages that may be unmapped now under the policy (derived)
    fresh: list[int]  # pages made releasable since the allocator last asked, maybe repeated (derived)

    def __init__(self, header: Header, policy: Policy, liveness_builds: int) -> None:
        self.header = header
        self.policy = policy
        self.legacy = policy is Policy.LEGACY
        self.liveness_builds = liveness_builds
        self.bpp, self.first = [], []
        pages = 0
        for pool in header.pools:
            bpp = header.page_bytes // pool.block_bytes
            if bpp < 1:
                raise ConfigError(
                    f"a block of {pool.block_bytes} bytes does not fit a {header.page_bytes}-byte page: the "
                    f"header's page_bytes (KVCACHED_PAGE_SIZE_MB when served) must be at least {pool.block_bytes}"
                )
            self.bpp.append(bpp)
            self.first.append(pages)
            pages += -(-pool.num_blocks // bpp)
        self.num_pages = pages
        nb = [p.num_blocks for p in header.pools]
        self.npools = len(nb)
        self.bpage = [
            [first + b // bpp for b in range(n)] for first, bpp, n in zip(self.first, self.bpp, nb, strict=True)
        ]
        self.alloc = [[0] * n for n in nb]
        self.bepoch = [[-1] * n for n in nb]
        self.balloc_ix = [[-1] * n for n in nb]
        self.bfree_ix = [[-1] * n for n in nb]
        self.page_alloc = [0] * pages
        self.mapped = [0] * pages
        self.epoch = [0] * pages
        self.unmap_ix = [-1] * pages
        self.pfree_ix = [-1] * pages
        self.pins = [0] * pages
        self.jobpins = [0] * pages
        self.grace, self.grace_due, self.holds, self.req_holds = {}, {}, {}, {}
        self.jobs, self.req_jobs, self.names = {}, {}, {}
        self.finished, self.finish_due, self.preempted = {}, {}, {}
        self.owners_known, self.owned, self.written, self.written_by, self.owned_due = False, {}, {}, {}, {}
        self.index = self.build = 0
        self.boundary_ix, self.boundary_build = array("q"), array("q")
        self.lossy, self.dropped_events = False, 0
        self.limit = self.stall_since = self.over_limit_since = None
        self.stall_reported, self.hold_reported = False, set()
        self.violations, self.job_violation = [], {}
        self.mapped_pages = self.pinned_pages = self.peak_pinned_pages = 0
        self.builds = self.jobs_built = self.jobs_failed = self.maps = self.unmaps = self.prefix_cache_resets = 0
        self.releasable, self.fresh = set(), []

    def violate(self, invariant: InvariantId, code: str, message: str, **kw: Any) -> None:
        """Record a violation at the current event (the ledger keeps going: replay sees them all)."""
        self.violations.append(
            Violation(invariant=invariant, code=code, index=self.index, build=self.build, message=message, **kw)
        )

    def build_of(self, index: int) -> int:
        """The build an event index belonged to (-1 for an index before the trace)."""
        if index < 0:
            return -1
        k = bisect.bisect_left(self.boundary_ix, index)
        return self.boundary_build[k] if k < len(self.boundary_ix) else self.build

    def request_name(self, req: int) -> str:
        return self.names.get(req, f"r{req}")

    def fresh_releasable(self) -> list[int]:
        """The pages of ``fresh`` that are still releasable, each once, in the order they became so."""
        unm = self.releasable
        return [p for p in dict.fromkeys(self.fresh) if p in unm]

    def jobs_on(self, page: int) -> list[int]:
        """Outstanding jobs pinning ``page``, by id, in O(outstanding jobs) (O(1) when none pins it)."""
        if not self.jobpins[page]:
            return []
        return sorted(j for j, st in self.jobs.items() if page in st[2])
