"""Pages of one KV pool: which are mapped, which are kept in reserve, and when one may go.

A page is *free* (unmapped: its memory belongs to the GPU, for another model), *reserved*
(mapped but holding no block: ready to hand out without paying for a map) or *in use* (the KV
cache manager has blocks on it). The allocator maps pages as the manager asks, within a memory
limit and, when one is given, a shared budget (``kvcached.budget``). It unmaps a reserved page
only once the ledger has let it go (``_trim``), and learns which pages it may by draining the
ledger's queue (``_drain``).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Protocol

import msgspec

from .backends.base import PageStillMappedError
from .errors import BackendError, CapacityError, KvcachedError
from .holds import HoldClock
from .ledger.events import MemoryLimit, PageMapped, PageUnmapped
from .ledger.findings import plural
from .ledger.recorder import Recorder
from .settings import format_size as format_bytes

_NONE: frozenset[int] = frozenset()
# Seconds a count that the budget could not lease in full is reused: vLLM asks for the free
# blocks once per running request each step, and another engine's release is seen this late.
RETRY_SHORT_LEASE = 0.005
log = logging.getLogger("kvcached.page_allocator")


class OutOfPagesError(CapacityError):
    """No page can be mapped: every page is in use, or the memory limit is reached."""


class AllocatorState(msgspec.Struct, frozen=True, kw_only=True):
    """What the allocator holds, and, during a shrink, what the shrink waits for.

    Counts are logical pages; the ``*_bytes`` fields are the same counts times ``page_bytes``,
    what one logical page costs in every layer, region and replica (0 where unknown)."""

    limit: int
    mapped: int
    in_use: int
    reserved: int
    free: int
    shrink_pending: bool
    waiting_on: dict[str, int]  # reason -> pages; empty unless a shrink is pending
    reason: str
    page_bytes: int = 0
    limit_bytes: int = 0
    mapped_bytes: int = 0
    in_use_bytes: int = 0
    reserved_bytes: int = 0
    # Reserved pages the ledger does not let go yet (a pin keeps them); the rest of the reserve
    # may be unmapped at the next trim. With in_use, the two split ``mapped`` without overlap,
    # which is what a stacked dashboard panel needs.
    held: int = 0

    def describe(self) -> str:
        sized = bool(self.page_bytes)
        head = (
            f"{_sized(self.mapped, self.mapped_bytes, sized)} mapped ({self.in_use} in use, {self.reserved} reserved), "
            f"limit {_sized(self.limit, self.limit_bytes, sized)}"
        )
        return f"{head}; {self.reason}"


def _sized(pages: int, nbytes: int, with_bytes: bool) -> str:
    return f"{pages} = {format_bytes(nbytes)}" if with_bytes else str(pages)


class PageBudget(Protocol):
    """What the allocator needs of a shared budget (``kvcached.budget.Budget``).

    NOTE: a budget bounds mapping as the limit does, strictly: a page is mapped only with bytes
    the budget granted. They go back once the page's memory is gone (``release_unmapped``): at
    once where the backend holds the memory; where the unmap is a decision that workers carry
    out, when they have. No page is mapped beyond the budget as an overdraft."""

    name: str

    def acquire_up_to(self, nbytes: int, unit: int) -> int: ...
    def release(self, nbytes: int) -> None: ...
    # The bytes of pages this allocator just unmapped: given back once that memory is gone, which
    # is now where the backend holds it and later where the unmap is only a decision that other
    # processes carry out (the engine core's: ``step_channel.DeferredRelease``).
    def release_unmapped(self, nbytes: int) -> None: ...
    def ask(self, nbytes: int) -> None: ...
    def headroom(self) -> int | None: ...
    def room(self) -> int | None: ...


class PageMapper(Protocol):
    """What the allocator needs of a backend (a per-layer layout maps several slots per page)."""

    @property
    def num_pages(self) -> int: ...
    def map_page(self, index: int) -> None: ...
    def unmap_page(self, index: int) -> None: ...


class PageAllocator:
    """Maps, reserves and unmaps the pages ``base .. base + num_pages`` of one pool."""

    def __init__(
        self,
        backend: PageMapper,
        recorder: Recorder,
        *,
        base: int = 0,
        min_reserved: int = 0,
        max_reserved: int = 0,
        limit: int | None = None,
        page_cost: int = 0,
        budget: PageBudget | None = None,
        ask_pages: int = 0,
    ) -> None:
        if min_reserved > max_reserved:
            raise KvcachedError(
                f"KVCACHED_MIN_RESERVED_PAGES={min_reserved} exceeds KVCACHED_MAX_RESERVED_PAGES={max_reserved}"
            )
        self.backend = backend
        self.recorder = recorder
        self.ledger = recorder.ledger
        self.base = base  # ledger page id of local page 0
        self.num_pages = backend.num_pages
        self.min_reserved = min_reserved
        self.max_reserved = max_reserved
        self.limit = self.num_pages if limit is None else limit
        # ``limit`` is the lower of the two: the operator's (``set_limit``) and the cap while a
        # joining engine waits for the budget's bytes (``yield_to``; None: none).
        self._set_limit = self.limit
        self._yield_cap: int | None = None
        if budget is not None and page_cost <= 0:
            raise KvcachedError("a page allocator under a budget needs the bytes a page costs (page_cost)")
        self.page_cost = page_cost
        self.budget = budget
        # Pages of budget bytes held but not mapped: what the last count promised beyond the
        # mapped pages (``_budget_pages``). Invariant: the budget's share of this allocator is
        # (mapped + _leased) * page_cost.
        self._leased = 0
        self._lease_short = False  # the last count wanted more than the budget or the yield cap let it have
        # Pages this engine asks the others on its budget for while it is short (``_ask``; 0:
        # it never asks), and whether a count was made since the last drain.
        self.ask_pages = ask_pages
        self._counted = False
        # The three states of a page (module docstring). Invariant: _free, _reserved and _in_use
        # partition range(num_pages), and _free holds no page twice; the backend has exactly the
        # pages of _reserved | _in_use mapped.
        self._free = list(range(self.num_pages))  # heap: low pages first, so the range stays dense
        self._reserved: set[int] = set()
        self._in_use: set[int] = set()
        # Reserved pages the ledger lets go: the only pages _trim may unmap.
        # Invariant: _goable <= _reserved (a page handed out or unmapped leaves it).
        self._goable: set[int] = set()
        # Goable pages whose unmap failed with the page still mapped (each logged once), and
        # whether the last trim left any of them to try again.
        self._unmap_failed: set[int] = set()
        self._unmap_retry = False
        # Bumped by every change to what ``pages_available``/``hands_out`` answer (a short
        # lease aside, see ``count_key``): by each public call that moves pages, and by ``_drain``, the move
        # ``drain_releasable`` makes before it trims. The manager caches its block count behind
        # it, because vLLM's scheduler asks for the free count once per running request each step
        # (``KVCacheManager.allocate_slots`` -> ``BlockPool.get_num_free_blocks``), ~290 times at
        # 256 requests.
        self.changes = 0
        self.ops = 0  # pages mapped and unmapped so far (``kvcached.engine.steps``)
        self.holds = HoldClock()  # how long pins keep emptied pages (``kvcached.holds``)

    # --- counts -------------------------------------------------------------------------------

    @property
    def mapped(self) -> int:
        return len(self._reserved) + len(self._in_use)

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    @property
    def shrinking(self) -> bool:
        return self.mapped > self.limit

    @property
    def in_use_over_limit(self) -> int:
        """Pages in use beyond the limit: what only frees of their blocks can give back (0 when
        the limit is met). An engine whose cache holds blocks it would free only on demand
        (SGLang's tree) evicts for them."""
        return max(0, len(self._in_use) - self.limit)

    def pages_available(self, *, lease: bool = True) -> int:
        """Pages that ``alloc_page`` can hand out now without exceeding the limit. ``lease=False``:
        counted for a report, with no map to follow, so the budget's room is read, not leased."""
        if self.shrinking:
            # No new page is mapped, and pages the ledger lets go are kept for the shrink; but a
            # reserved page that pins keep mapped anyway stays in service. Refusing it could
            # deadlock: the pins may belong to a request that only lets go once it runs again
            # (review comment P2 on kvcached PR #598: window holds of a preempted request).
            if lease:
                self._counted = True
                self._lease_short = self._capped()
            return len(self._reserved) - len(self._goable)
        return len(self._reserved) + min(len(self._free), self.limit - self.mapped, self._growth(lease))

    def _capped(self) -> bool:
        """Whether the yield cap, not the operator's limit, stops this allocator's growth now."""
        return self.limit < self._set_limit and self.mapped >= self.limit and bool(self._free)

    def _growth(self, lease: bool) -> int:
        """Pages beyond the mapped ones the budget lets maps use: leased for a count a map
        follows, read for a report (``pages_available``'s ``lease``)."""
        return self._budget_pages() if lease else self._budget_room()

    def _budget_room(self) -> int:
        """Pages beyond the mapped ones the budget would let this allocator map, read and not
        taken: what is leased already and the budget's room (every page without a budget)."""
        room = None if self.budget is None else self.budget.room()
        return self.num_pages if room is None else self._leased + room // self.page_cost

    def _budget_pages(self) -> int:
        """Pages beyond the mapped ones that maps may use now: leased as the count is made (every
        page without a budget).

        NOTE: the count and the map are two moments (vLLM's ``KVCacheManager.allocate_slots``
        compares its blocks with ``get_num_free_blocks`` and then allocates), and another engine
        may take the budget's bytes between them. So the pages a count promises beyond those
        mapped are *leased*: their bytes are taken from the budget when the count is made, spent
        by the maps, and what is left goes back at the next drain (the end of the scheduler
        call, ``_return_lease``). What the budget cannot grant is not counted, so vLLM sees fewer
        free blocks rather than a failed allocation, and the budget is never exceeded.

        NOTE: the cost is one grant and one release per scheduler call that counts with room to
        grow (about 11 us each on tmpfs). Engines whose scheduler calls overlap see each other's
        leases as used for that long."""
        budget = self.budget
        if budget is None:
            return self.num_pages
        self._counted = True
        want = min(len(self._free), self.limit - self.mapped)
        if self._leased < want:
            cost = self.page_cost
            self._leased += budget.acquire_up_to((want - self._leased) * cost, cost) // cost
        self._lease_short = self._leased < want or self._capped()
        return self._leased

    @property
    def lease_short(self) -> bool:
        """Whether the last count wanted more pages than the budget could lease: then a count is
        valid for ``count_key``'s time as well as its change count."""
        return self._lease_short

    def count_key(self) -> object:
        """What a cached count of ``pages_available`` is valid for: the change count, and, while
        the budget could not lease all that was wanted, the time (another engine may give bytes
        back; asked again at most every ``RETRY_SHORT_LEASE`` seconds)."""
        if not self._lease_short:
            return self.changes
        return (self.changes, int(time.monotonic() / RETRY_SHORT_LEASE))

    def _return_lease(self) -> None:
        """Give back the leased bytes no map spent (at a drain: the scheduler call has ended)."""
        if self._leased and self.budget is not None:
            n, self._leased = self._leased, 0
            self.changes += 1
            self.budget.release(n * self.page_cost)

    def hands_out(self, page: int, *, lease: bool = True) -> bool:
        """Whether ``page`` is one of the ``pages_available()`` pages that ``alloc_page`` would
        hand out now. The manager asks for the pool's last page, which holds fewer blocks when
        the block count is not a multiple of blocks per page: counting it as a full page made
        vLLM's scheduler ask for blocks that do not exist."""
        if self.shrinking:
            return page in self._reserved and page not in self._goable
        if page in self._reserved:
            return True
        # A free page (neither reserved nor in use) is mapped lowest first: the highest one is
        # among those available only when every free page is.
        n = len(self._free)
        return page not in self._in_use and self.limit - self.mapped >= n and self._growth(lease) >= n

    # --- handing pages out and taking them back -----------------------------------------------

    def alloc_page(self) -> int:
        """A mapped page for new blocks: a reserved one if any, else a freshly mapped one."""
        self.changes += 1
        if self.shrinking:
            pinned = self._reserved - self._goable
            if not pinned:
                raise OutOfPagesError(
                    f"a shrink to {self.limit} pages is pending ({self.mapped} mapped): no page can be handed out"
                )
            page = min(pinned)
            self._reserved.discard(page)
        elif self._reserved:
            page = min(self._reserved)
            self._reserved.discard(page)
            self._goable.discard(page)
        else:
            page = self._map_new()
        if self.holds:
            self.holds.end((page,))
        self._in_use.add(page)
        self._top_up()
        return page

    def take_page(self, page: int) -> None:
        """Put ``page`` itself in use, as ``alloc_page`` would put the page it picks: vLLM took a
        free block of it out of its queue (``BlockPool.touch``, ``KVCacheManager.take``)."""
        self.changes += 1
        if page in self._in_use:
            raise KvcachedError(f"page {page} is already in use")
        if page in self._reserved:
            if self.shrinking and page in self._goable:
                raise OutOfPagesError(
                    f"a shrink to {self.limit} pages is pending ({self.mapped} mapped): page {page} is going"
                )
            self._reserved.discard(page)
            self._goable.discard(page)
            if self.holds:
                self.holds.end((page,))
        elif self.shrinking:
            raise OutOfPagesError(
                f"a shrink to {self.limit} pages is pending ({self.mapped} mapped): page {page} cannot be mapped"
            )
        else:
            self._map_new(page)
        self._in_use.add(page)
        self._top_up()

    def release_pages(self, pages: Sequence[int]) -> None:
        """The manager's last blocks on ``pages`` were freed (its ``BlockFree`` is recorded): keep
        each in reserve until it may go, and give back what the limits ask, page by page."""
        # Drained before the pages join the reserve: the free that emptied them may be what
        # made them releasable (no pins, or the legacy policy), and it is in this drain.
        self.changes += 1
        fresh = self._drain()
        for page in pages:
            self._in_use.remove(page)
            self._reserved.add(page)
            if page in fresh:
                self._goable.add(page)
            else:
                self.holds.begin(page)  # a pin keeps it (the ledger did not let it go with the free)
            self._trim()

    def _map_new(self, page: int | None = None) -> int:
        """Map the lowest free page, or ``page`` (a free one), with leased budget bytes if any
        are left, else with bytes granted now (``OutOfPagesError`` if the budget has none: never
        for a page a count promised, which is leased)."""
        if not self._free or self.mapped >= self.limit:
            raise OutOfPagesError(
                f"no page to map: {self.mapped} of {self.num_pages} mapped, limit {self.limit} "
                "(raise the limit or KVCACHED_MAX_CACHED_TOKENS, or free blocks)"
            )
        budget = self.budget
        if budget is not None:
            if self._leased:
                self._leased -= 1
            elif not budget.acquire_up_to(self.page_cost, self.page_cost):
                raise OutOfPagesError(f"budget {budget.name} cannot grant a page of {format_bytes(self.page_cost)}")
        if page is None:
            page = heapq.heappop(self._free)
        else:  # rare (take_page): O(pages) is fine
            self._free.remove(page)
            heapq.heapify(self._free)
        try:
            self.backend.map_page(page)
        except BackendError:
            heapq.heappush(self._free, page)  # the backend rolled its side back; so do we
            if budget is not None:
                self._leased += 1  # still held, given back at the next drain
            raise
        self.ops += 1
        self.recorder.emit(PageMapped(self.base + page))
        return page

    def _top_up(self) -> None:
        """Keep ``min_reserved`` pages mapped ahead of demand, within the limit.

        Whether a page mapped here may go again is the ledger's to say, at the next drain."""
        while len(self._reserved) < self.min_reserved and self._free and self.mapped < self.limit:
            try:
                page = self._map_new()
            except (BackendError, OutOfPagesError):
                return  # a reserve is an optimisation; the next alloc will report the failure
            self._reserved.add(page)

    # --- giving memory back -------------------------------------------------------------------

    def drain_releasable(self) -> None:
        """Learn from the ledger which reserved pages may go now, and give back what the limits
        ask. Call it after recording events that the allocator did not make (the engine does, at
        the end of each scheduler call): the ledger queues the pages events let go until then."""
        fresh = self._drain()
        if fresh or self._unmap_retry:
            self._trim()
        if self._counted:
            self._ask()
        self._return_lease()

    def _ask(self) -> None:
        """Ask the other engines on the budget for ``ask_pages`` while this one is short, at the
        end of a scheduler call that counted; stop asking once a count is not.

        NOTE: short means the call's count wanted pages that the budget (or the cap this engine
        yields under) would not let it have, and the engine cannot keep its reserve: its empty
        pages and the leased pages it did not spend are fewer than ``min_reserved`` (than one
        page without a reserve). An engine that merely counts on a full budget while its
        reserve stands does not ask, so the pages a neighbour gave back sit free rather than
        draining the neighbour to its floor. An engine whose count was cached rather than made
        asks nothing new; its ask lapses after ``kvcached.budget.ASK_TTL`` once it stops
        counting (idle)."""
        self._counted = False
        budget = self.budget
        if budget is None or not self.ask_pages:
            return
        short = self._lease_short and len(self._reserved) + self._leased < max(1, self.min_reserved)
        budget.ask(self.ask_pages * self.page_cost if short else 0)

    def _drain(self) -> AbstractSet[int]:
        """Take the ledger's queue; note the reserved pages in it, return all of this range's.

        NOTE: this is the one way the allocator learns which pages the ledger lets go: it drains
        the ledger's queue of pages that became releasable (``Ledger.take_fresh_releasable``), as
        vLLM's scheduler drains its block pool's KV event queue (``BlockPool.take_events``)
        instead of being called back. It drains where its view and the ledger's agree, so that
        a releasable page is a reserved one. That is at the end of each scheduler call, after
        the events recorded outside it (the engine's wrapper of the call calls
        ``drain_releasable``), when the manager's free has emptied pages, and when the limit
        changes. It is never called from inside ``Recorder.emit``, so its own events
        (``PageUnmapped``) are never emitted from inside another.

        A releasable page that is not reserved is one the manager has just emptied (see
        ``release_pages``) or one handed out whose ``BlockAlloc`` is not recorded yet; the
        latter comes back through the queue when its blocks are next freed."""
        ledger = self.ledger
        if not ledger.has_fresh_releasable:  # the common case, after nearly every event
            return _NONE
        base, n = self.base, self.num_pages
        fresh = {gp - base for gp in ledger.take_fresh_releasable() if 0 <= gp - base < n}
        let_go = fresh & self._reserved
        self._goable |= let_go
        if self.holds:
            self.holds.end(let_go)
        self.changes += 1
        return fresh

    def _trim(self) -> None:
        """Unmap the reserved pages the ledger has let go, top of the range first, while the limits
        ask for memory back.

        NOTE: mapping is cheap to decide and expensive to do; unmapping is the reverse: it is
        only safe when the ledger says so. So the allocator never unmaps on its own judgement.
        It unmaps a reserved page only when the ledger has let it go and it has a reason to give
        memory back: more reserved pages than ``KVCACHED_MAX_RESERVED_PAGES``, or more mapped
        pages than the memory limit."""
        kept: list[int] = []
        gone = 0
        # The top of the range goes first. One heap for the pass: taking max() of the set for each
        # page would make a shrink that lets many pages go at once quadratic.
        order = [-p for p in self._goable]
        heapq.heapify(order)
        try:
            while order and (len(self._reserved) > self.max_reserved or self.mapped > self.limit):
                page = -heapq.heappop(order)
                self._goable.discard(page)
                try:
                    self.backend.unmap_page(page)
                except PageStillMappedError as e:
                    # Nothing was returned: the page is still mapped, reserved and let go. It is goable
                    # again after this pass, and the next drain tries again even if no page has
                    # become releasable since.
                    if page not in self._unmap_failed:
                        log.warning("page %d stays mapped, to be unmapped again at the next drain: %s", page, e)
                    self._unmap_failed.add(page)
                    kept.append(page)
                    continue
                except BackendError as e:
                    # The memory was returned and only a step after it failed (``Backend.unmap_page``
                    # marks the slot unmapped first): the page is unmapped and must be counted so, or
                    # it would be handed out again with nothing behind it.
                    log.warning("page %d unmapped with an error: %s", page, e)
                self._unmap_failed.discard(page)
                self._reserved.discard(page)
                heapq.heappush(self._free, page)
                gone += 1
                self.ops += 1
                self.recorder.emit(PageUnmapped(self.base + page))
        finally:
            if gone and self.budget is not None:
                # One budget change for the pass (each is a locked rewrite of the budget's file),
                # made even if an unmap raised: the pages before it are unmapped.
                self.budget.release_unmapped(gone * self.page_cost)
        self._goable.update(kept)
        self._unmap_retry = bool(kept)

    def set_limit(self, pages: int) -> AllocatorState:
        """Lower or raise the limit; a lowered limit shrinks now as far as the ledger allows.

        NOTE: a limit lowered below what is mapped starts a *shrink*: no page is mapped,
        reserved pages go as soon as the ledger lets them, pages in use when their blocks are
        freed. Reserved pages that pins keep mapped stay in service meanwhile (refusing them can
        deadlock, see ``pages_available``). ``state()`` says what a pending shrink waits for.

        NOTE: a raised limit maps nothing: the reserve refills at the next ``alloc_page``, when
        the engine has work. Topping it up here made an idle engine whose limit was lifted take
        its reserve's pages back from a neighbour that needed them."""
        self._set_limit = max(0, min(pages, self.num_pages))
        return self._limit_changed(force=True)

    def yield_to(self, cap: int | None) -> bool:
        """Map at most ``cap`` pages while another engine waits for the budget's bytes (None: no
        such cap); the operator's limit still holds below it. Returns whether the limit changed.
        The pages over it go as a lowered limit's do: reserved ones as the ledger lets them,
        cached blocks as the engine evicts them (``in_use_over_limit``)."""
        cap = None if cap is None else max(0, min(cap, self.num_pages))
        if cap == self._yield_cap:
            return False
        self._yield_cap = cap
        before = self.limit
        self._limit_changed(force=False)
        return self.limit != before

    def _limit_changed(self, *, force: bool) -> AllocatorState:
        limit = self._set_limit if self._yield_cap is None else min(self._set_limit, self._yield_cap)
        if limit != self.limit or force:
            self.limit = limit
            self.changes += 1
            self.recorder.emit(MemoryLimit(limit))
            self._drain()  # reserve topped up since the last drain
            self._trim()
            self._return_lease()
        return self.state()

    def state(self) -> AllocatorState:
        """What the allocator holds, and what a pending shrink waits for, in pages and in bytes
        (``page_cost``: what one logical page costs in every layer, region and replica)."""
        waiting: Counter[str] = Counter()
        if self.shrinking:
            for page in self._reserved - self._goable:
                status = self.ledger.why(self.base + page)
                kinds = "+".join(sorted({p.kind for p in status.pins})) or "nothing (policy)"
                waiting["reserved, pinned by " + kinds] += 1
            if len(self._in_use) > self.limit:  # these must empty before they can go
                waiting["in use (blocks allocated)"] = len(self._in_use) - self.limit
            over = self.mapped - self.limit
            detail = ", ".join(f"{n} {why}" for why, n in sorted(waiting.items()))
            reason = f"shrink pending: {plural(over, 'page')} over the limit; waiting on {detail}"
        else:
            reason = "within the limit"
            budget = self.budget
            if budget is not None and self.mapped < self.limit and self._free:
                room = budget.headroom()
                if room is not None and room < self.page_cost:
                    reason += f"; budget {budget.name} full ({format_bytes(room)} left)"
        if self.limit < self._set_limit:
            reason += f"; limit lowered from {self._set_limit} while another engine waits for the budget's bytes"
        cost = self.page_cost
        return AllocatorState(
            limit=self.limit,
            mapped=self.mapped,
            in_use=len(self._in_use),
            reserved=len(self._reserved),
            free=len(self._free),
            shrink_pending=self.shrinking,
            waiting_on=dict(waiting),
            reason=reason,
            page_bytes=cost,
            limit_bytes=self.limit * cost,
            mapped_bytes=self.mapped * cost,
            in_use_bytes=len(self._in_use) * cost,
            reserved_bytes=len(self._reserved) * cost,
            held=len(self._reserved) - len(self._goable),  # _goable <= _reserved
        )
