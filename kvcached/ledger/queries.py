"""What one asks a ledger: the questions, read-only, over its tables (the rules are in ``ledger``).

``Ledger`` answers the allocator (which pages may go, and which became releasable since it last
asked), the live view and kvreplay (why a page is kept, the totals). Every answer is a read of
``LedgerTables``, so the questions live apart from the rules that change the tables: ``Ledger``
inherits them from ``LedgerQueries`` and adds ``apply`` (and ``ledger.py`` stays short enough to
read). The one question that changes something is ``take_fresh_releasable``, which hands over
the pages it names. The state itself is ``tables``; the read-only properties below keep the
ledger's public names (``index``, ``violations``, ...) as they were when they were the ledger's
own attributes. Compiled by mypyc with ``ledger.py``: a compiled class's base must be compiled.
"""

from __future__ import annotations

from collections.abc import Iterable, Set

from .events import Header, JobKind, Policy
from .findings import PageStatus, PinReason, Violation
from .tables import LedgerTables


class LedgerQueries:
    """The ledger's questions; ``Ledger`` sets ``tables`` and keeps it current."""

    tables: LedgerTables

    # --- the state, read-only (it lives in ``tables``; these names are the ledger's public API) ---

    @property
    def header(self) -> Header:
        return self.tables.header

    @property
    def policy(self) -> Policy:
        return self.tables.policy

    @property
    def liveness_builds(self) -> int:
        return self.tables.liveness_builds

    @property
    def num_pages(self) -> int:
        return self.tables.num_pages

    @property
    def index(self) -> int:
        """Events applied so far."""
        return self.tables.index

    @property
    def build(self) -> int:
        """The build being assembled: jobs seen now belong to it."""
        return self.tables.build

    @property
    def settled(self) -> bool:
        """Whether a build boundary would move nothing: no outstanding job, no page in its grace
        or held by a window, no deadline running (I4: a finished request's jobs, pages over the
        limit). An engine whose loop steps while idle (SGLang's) records no boundary then."""
        t = self.tables
        return not (t.jobs or t.grace or t.holds or t.finish_due or t.over_limit_since is not None)

    @property
    def limit(self) -> int | None:
        return self.tables.limit

    @property
    def lossy(self) -> bool:
        return self.tables.lossy

    @property
    def dropped_events(self) -> int:
        return self.tables.dropped_events

    @property
    def violations(self) -> list[Violation]:
        """Every violation so far, in order (a live view: do not change it)."""
        return self.tables.violations

    @property
    def mapped_pages(self) -> int:
        return self.tables.mapped_pages

    @property
    def pinned_pages(self) -> int:
        return self.tables.pinned_pages

    @property
    def peak_pinned_pages(self) -> int:
        return self.tables.peak_pinned_pages

    @property
    def builds(self) -> int:
        return self.tables.builds

    @property
    def jobs_built(self) -> int:
        return self.tables.jobs_built

    @property
    def maps(self) -> int:
        return self.tables.maps

    @property
    def unmaps(self) -> int:
        return self.tables.unmaps

    @property
    def jobs_failed(self) -> int:
        return self.tables.jobs_failed

    @property
    def prefix_cache_resets(self) -> int:
        return self.tables.prefix_cache_resets

    # --- the questions ----------------------------------------------------------------------

    @property
    def releasable(self) -> Set[int]:
        """Pages that may be unmapped now under the policy (a live view: do not keep it)."""
        return self.tables.releasable

    def is_releasable(self, page: int) -> bool:
        return page in self.tables.releasable

    def is_mapped(self, page: int) -> bool:
        return bool(self.tables.mapped[page])

    def is_pinned(self, page: int) -> bool:
        return self.tables.pins[page] > 0

    def allocated_blocks(self, page: int) -> int:
        return self.tables.page_alloc[page]

    def page_of(self, pool: int, block: int) -> int:
        t = self.tables
        return t.first[pool] + block // t.bpp[pool]

    def pool_pages(self, pool: int) -> range:
        """The global page ids of ``pool``'s blocks."""
        t = self.tables
        nb = t.header.pools[pool].num_blocks
        return range(t.first[pool], t.first[pool] + -(-nb // t.bpp[pool]))

    @property
    def has_fresh_releasable(self) -> bool:
        """Whether ``take_fresh_releasable`` may have pages to give (cheap: for every event)."""
        return bool(self.tables.fresh)

    def take_fresh_releasable(self) -> list[int]:
        """Pages that became releasable since the last call and still are (for an allocator)."""
        t = self.tables
        out = t.fresh_releasable()
        t.fresh = []
        return out

    def build_of(self, index: int) -> int:
        """The build an event index belonged to (-1 for an index before the trace)."""
        return self.tables.build_of(index)

    def counters(self) -> dict[str, int]:
        """Totals for summaries: events, builds, jobs, maps, unmaps, peaks."""
        t = self.tables
        return {
            "events": t.index,
            "builds": t.builds,
            "jobs": t.jobs_built,
            "failed_jobs": t.jobs_failed,
            "outstanding_jobs": len(t.jobs),
            "maps": t.maps,
            "unmaps": t.unmaps,
            "mapped_pages": t.mapped_pages,
            "pinned_pages": t.pinned_pages,
            "peak_pinned_pages": t.peak_pinned_pages,
            "prefix_cache_resets": t.prefix_cache_resets,
            "dropped_events": t.dropped_events,
        }

    def pending_grace_pages(self) -> int:
        """Pages held only until a coming build: the engine must keep building to drain them."""
        return len(self.tables.grace)

    def outstanding_jobs(self) -> int:
        return len(self.tables.jobs)

    def request_name(self, req: int) -> str:
        return self.tables.request_name(req)

    def jobs_on(self, page: int) -> list[int]:
        """Outstanding jobs pinning ``page``, by id, in O(outstanding jobs)."""
        return self.tables.jobs_on(page)

    def why(self, page: int) -> PageStatus:
        """Every reason ``page`` is kept, in O(outstanding jobs + pins on the page)."""
        t = self.tables
        pins: list[PinReason] = []
        for job in t.jobs_on(page):
            kind, req, _, workers, reported, build, _, _ = t.jobs[job]
            pins.append(
                PinReason(
                    kind="job",
                    since_build=build,
                    job=job,
                    job_kind="store" if kind == JobKind.STORE else "load",
                    request=t.request_name(req),
                    waiting_workers=workers - reported,
                )
            )
        if page in t.grace:
            pins.append(PinReason(kind="grace", since_build=t.build, until_build=t.build))
        for req, since in sorted(t.holds.get(page, {}).items()):
            pins.append(PinReason(kind="window", since_build=since, request=t.request_name(req)))
        return PageStatus(
            page=page,
            mapped=bool(t.mapped[page]),
            allocated_blocks=t.page_alloc[page],
            releasable=page in t.releasable,
            policy=t.policy.value,
            pins=tuple(pins),
        )

    def pinned(self) -> Iterable[int]:
        """Pages with at least one pin, in page order (O(pages): for views, not hot paths)."""
        return (p for p, n in enumerate(self.tables.pins) if n)
