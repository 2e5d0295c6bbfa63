"""KV blocks on elastic pages: block <-> page geometry, allocation, and views of the bytes.

One manager serves one block pool (one vLLM KV cache group). Blocks never straddle pages: a
page holds ``page_bytes // block_bytes`` blocks and the tail is unused, because a block split
over two pages could lose half its bytes to an unmap. New blocks come from partly used pages
first, so that pages empty out and can be given back; every alloc and free is a ledger event,
and the page allocator unmaps only what the ledger lets go.

Both layouts of upstream kvcached are supported. *Contiguous*: one range, a page holds whole
blocks of every layer (a compound page, ``block_bytes`` covers all layers). *Per-layer*: one
region per layer, and logical page ``p`` is mapped in every region at once (``block_bytes`` is
one layer's share). Either way the ledger sees one logical page per index.
"""

from __future__ import annotations

import enum
import heapq
import mmap
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from .backends.base import Backend
from .errors import BackendError, CapacityError, ConfigError, ConsistencyError
from .ledger.events import BlockAlloc, BlockFree, Header, Policy, PoolGeometry
from .ledger.ledger import Ledger
from .ledger.recorder import Recorder
from .page_allocator import AllocatorState, OutOfPagesError, PageAllocator, PageBudget, PageMapper
from .page_size import CUDA_GRANULARITY, mib
from .page_slots import RegionSlots

if TYPE_CHECKING:
    import torch


class Layout(enum.Enum):
    CONTIGUOUS = "contiguous"
    PER_LAYER = "per-layer"


class Placement(enum.Enum):
    """Where ``alloc`` puts a run of blocks (what one request asks for at once). A request's
    blocks are freed together and a page goes back once all of its blocks are, so the fewer
    requests share a page, the sooner it empties. ``benchmarks/bench_pages.py`` compares the
    rules on vLLM's scheduler (decode-shaped traffic, a limit lowered mid-load)."""

    # As many whole pages of its own as the run fills, on empty pages (reserved or mapped now)
    # unless a shrink is pending; the rest as BEST_FIT. A page that holds one request's blocks
    # empties when that request ends, where a run spread over holes ties each page to the
    # lifetimes of every request already on it. The smallest footprint measured. Default.
    WHOLE_PAGES = "whole-pages"
    # Upstream kvcached's ``KVCacheManager._pick_avail_page`` (its PR #390): the partly used page
    # with the fewest free blocks that still holds the whole run, else the one with the most;
    # the lowest page among equals (upstream: its dict's order). For one block, FULLEST.
    BEST_FIT = "best-fit"
    # The fullest partly used page, the lowest among equals, whatever the run.
    FULLEST = "fullest"
    # The lowest partly used page: this project's old rule, kept for comparison.
    LOWEST = "lowest"


class OutOfBlocksError(CapacityError):
    """``alloc(n)`` asked for more blocks than ``available_size()``."""


class BlockStateError(ConsistencyError):
    """A block freed twice, or a block id outside the pool."""


class KVGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """How blocks sit on pages. ``block_bytes`` is per page-space (see the module docstring)."""

    num_blocks: int
    block_bytes: int
    page_bytes: int
    num_layers: int = 1
    layout: Layout = Layout.CONTIGUOUS

    def __post_init__(self) -> None:
        if self.block_bytes > self.page_bytes:
            # The least page that holds one block on each backend: whole OS pages on the host,
            # whole 2 MiB granules on CUDA (a hand-built geometry need not be a multiple of the block).
            host = -(-self.block_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
            cuda = -(-self.block_bytes // CUDA_GRANULARITY) * CUDA_GRANULARITY
            raise ConfigError(
                f"a KV block of {self.block_bytes} bytes does not fit a {self.page_bytes}-byte page; "
                f"set KVCACHED_PAGE_SIZE_MB to at least {mib(host)} on the host backend ({mib(cuda)} on CUDA)"
            )
        if self.num_blocks < 1 or self.block_bytes < 1 or self.num_layers < 1:
            raise ConfigError(f"invalid KV geometry: {self}")

    @property
    def blocks_per_page(self) -> int:
        return self.page_bytes // self.block_bytes

    @property
    def num_pages(self) -> int:
        return -(-self.num_blocks // self.blocks_per_page)

    @property
    def regions(self) -> int:
        return self.num_layers if self.layout is Layout.PER_LAYER else 1

    @property
    def backend_pages(self) -> int:
        return self.num_pages * self.regions

    def pool(self) -> PoolGeometry:
        return PoolGeometry(block_bytes=self.block_bytes, num_blocks=self.num_blocks)


class KVCacheManager:
    """Blocks of one pool on pages of one backend range, every step recorded in the ledger."""

    def __init__(
        self,
        geometry: KVGeometry,
        backend: Backend,
        recorder: Recorder,
        *,
        pool: int = 0,
        min_reserved: int = 0,
        max_reserved: int = 0,
        limit_pages: int | None = None,
        replicas: Sequence[Backend] = (),
        budget: PageBudget | None = None,
        ask_pages: int = 0,
        placement: Placement = Placement.WHOLE_PAGES,
    ) -> None:
        header = recorder.ledger.header
        described = pool < len(header.pools) and header.pools[pool] == geometry.pool()
        if not described or header.page_bytes != geometry.page_bytes:
            raise ConfigError(f"the ledger's header does not describe pool {pool} as {geometry.pool()}")
        for b in (backend, *replicas):
            if b.page_bytes != geometry.page_bytes:
                want = geometry.page_bytes
                raise ConfigError(f"backend pages are {b.page_bytes} bytes, the KV geometry wants {want}")
            if b.num_pages == 0:
                b.reserve(geometry.backend_pages)
            elif b.num_pages < geometry.backend_pages:
                raise ConfigError(f"backend range has {b.num_pages} pages; {geometry.backend_pages} needed")
        self.geometry = geometry
        self.backend = backend
        self.replicas = tuple(replicas)
        self.recorder = recorder
        self.pool = pool
        self._bpp = geometry.blocks_per_page
        self._last_page = geometry.num_pages - 1
        self._short = self._bpp * geometry.num_pages - geometry.num_blocks  # blocks the last page lacks
        simple = geometry.regions == 1 and not replicas
        mapper: PageMapper = (
            backend if simple else RegionSlots((backend, *replicas), geometry.num_pages, geometry.regions)
        )
        self.allocator = PageAllocator(
            mapper,
            recorder,
            base=recorder.ledger.pool_pages(pool).start,
            min_reserved=min_reserved,
            max_reserved=max_reserved,
            limit=limit_pages,
            page_cost=geometry.page_bytes * geometry.regions * (1 + len(self.replicas)),
            budget=budget,
            ask_pages=ask_pages,
        )
        # Invariant: num_allocated == sum(_allocated) == sum(_used), and _used[p] counts the
        # blocks of page p with _allocated set.
        # A list, not a bytearray: mypyc reads and sets its items natively (a bytearray's are
        # generic calls with a boxed index, ~270 instructions a read on the step's hot path).
        # 8 bytes a block, beside the Python object of ~100 bytes vLLM keeps for each.
        self._allocated: list[int] = [0] * geometry.num_blocks
        self._used = [0] * geometry.num_pages  # allocated blocks per page
        # Invariant: the keys are the allocator's pages in use that have free blocks (a full page
        # has no entry, nor a page not in use); a page in use has as blocks its allocated ones
        # and its _free_in list, disjoint, and a page not in use has no block allocated.
        self._free_in: dict[int, list[int]] = {}  # in-use page -> its free blocks
        # In-use pages with free blocks, lowest first (stale entries are skipped), for
        # ``Placement.LOWEST``: filling low pages first keeps the high ones empty.
        # Invariant: every page with a non-empty _free_in list is in _partial.
        self._partial: list[int] = []
        # Invariant: _partial_free == sum(len(free) for free in _free_in.values()).
        self._partial_free = 0
        # What ``alloc`` takes from first (``Placement``); may change at any time, as every rule
        # reads the same structures.
        self.placement = placement
        # The pages of _free_in by their count of free blocks, for the rules that pick by fill,
        # so that a pick is a bit trick and a heap peek, not a scan (upstream kvcached's PR #390
        # scans its partly used pages for each pick, noting that buckets by free count would
        # make it independent of the pool's size). _bucket[k]: a heap of pages (lowest first)
        # with stale entries, skipped when met and dropped by a rebuild once they outnumber the
        # live ones; _in_bucket[k]: how many pages have k free blocks; bit k of _nonempty: set
        # when that is not 0; _entries: the heaps' total length.
        # Invariant: every page p of _free_in is in _bucket[len(_free_in[p])], and _in_bucket[k]
        # == the number of pages of _free_in with k free blocks.
        self._bucket: list[list[int]] = [[] for _ in range(self._bpp + 1)]
        self._in_bucket = [0] * (self._bpp + 1)
        self._nonempty = 0
        self._entries = 0
        self.num_allocated = 0
        self._bytes: dict[int, torch.Tensor] = {}
        self._num_blocks = geometry.num_blocks
        # ``available_size``'s page part, valid while the allocator's ``count_key`` is the one
        # in the key.
        self._page_blocks = 0
        self._page_blocks_key: object = None
        self._counted_at = -1  # the allocator's change count when the key was last compared

    @classmethod
    def standalone(
        cls,
        geometry: KVGeometry,
        backend: Backend,
        *,
        policy: Policy | str = Policy.LEDGER,
        workers: int = 1,
        journal_path: str | None = None,
        **kw: int | None,
    ) -> KVCacheManager:
        """A manager with a ledger of its own (one pool), for tests, tools and single-pool use."""
        header = Header(
            page_bytes=geometry.page_bytes, pools=(geometry.pool(),), workers=workers, policy=Policy(policy)
        )
        recorder = Recorder(Ledger(header), None)
        if journal_path is not None:
            recorder = Recorder.for_header(header, journal_path=journal_path)
        return cls(geometry, backend, recorder, **kw)  # type: ignore[arg-type]

    # --- geometry -----------------------------------------------------------------------------

    def page_of(self, block: int) -> int:
        return block // self._bpp

    @property
    def page_cost(self) -> int:
        """Bytes one logical page costs: a page in every layer's region of every replica."""
        return self.allocator.page_cost

    def allocated_on(self, page: int) -> int:
        """How many blocks of ``page`` are allocated (handed out or taken, not freed)."""
        return self._used[page]

    def _blocks_of(self, page: int) -> range:
        return range(page * self._bpp, min((page + 1) * self._bpp, self.geometry.num_blocks))

    # --- allocation ---------------------------------------------------------------------------

    def available_size(self) -> int:
        """Blocks that ``alloc`` can hand out now (fewer while a shrink is pending), exactly.

        vLLM's scheduler asks for as many blocks as the page-aware pool reports free, inside
        ``Scheduler.schedule()``, so an overcount is an engine crash, not a refusal."""
        alloc = self.allocator
        # Asked ~200 times a prefill-heavy step (vLLM's free count): two native reads when
        # nothing changed, where the key is a boxed object compared generically.
        if alloc.changes != self._counted_at or alloc.lease_short:
            if alloc.count_key() != self._page_blocks_key:
                self._page_blocks = self._count_page_blocks()
                self._page_blocks_key = alloc.count_key()  # as the count left it (a lease)
            self._counted_at = alloc.changes
        return min(self._partial_free + self._page_blocks, self._num_blocks - self.num_allocated)

    def available_unleased(self) -> int:
        """``available_size`` for a report that no ``alloc`` follows (SGLang's stats and idle
        checks, every turn of its event loop): the budget's room is read, not leased, so that
        counting leaves the room to the other engines (and costs no write)."""
        return min(self._partial_free + self._count_page_blocks(lease=False), self._num_blocks - self.num_allocated)

    def _count_page_blocks(self, *, lease: bool = True) -> int:
        """Blocks on the pages the allocator can hand out now: what ``available_size`` caches."""
        pages = self.allocator.pages_available(lease=lease)
        blocks = pages * self._bpp
        if pages and self._short and self.allocator.hands_out(self._last_page, lease=lease):
            blocks -= self._short  # the last page holds fewer blocks than the others
        return blocks

    def holds(self, block: int) -> bool:
        """Whether ``block`` is allocated (handed out, or taken with ``take``) and not freed."""
        return bool(self._allocated[block])

    def alloc(self, n: int) -> list[int]:
        """``n`` blocks, from partly used pages first (which ones: ``placement``); all or nothing."""
        if n <= 0:
            return []
        if n > self._partial_free:  # the common case, free blocks on pages in use, needs no page count
            avail = self.available_size()
            if n > avail:
                state = self.allocator.state().describe()
                raise OutOfBlocksError(f"asked for {n} KV blocks, {avail} available ({state})")
        out: list[int] = []
        fresh: list[int] = []
        free_in = self._free_in
        placement = self.placement
        try:
            if placement is Placement.WHOLE_PAGES and n >= self._bpp and not self.allocator.shrinking:
                # The pages available_size counts beyond the free blocks of pages in use.
                whole = min(n // self._bpp, (self.available_size() - self._partial_free) // self._bpp)
                for _ in range(whole):
                    self._whole_page(out, fresh)
            fit = placement is Placement.BEST_FIT or placement is Placement.WHOLE_PAGES
            while len(out) < n and free_in:
                want = n - len(out)
                if placement is not Placement.LOWEST:
                    page = self._by_fill(want if fit else 1)
                else:
                    page = self._partial[0]
                    if page not in free_in:
                        heapq.heappop(self._partial)
                        continue
                self._take(page, want, out)
            while len(out) < n:
                self._new_page(n - len(out), out, fresh)
        except (BackendError, OutOfPagesError):
            self._give_back(out, fresh)
            raise
        self.recorder.emit(BlockAlloc(self.pool, tuple(out)))
        return out

    def _new_page(self, want: int, out: list[int], fresh: list[int]) -> None:
        """Put a page in use (the allocator's pick) and take up to ``want`` blocks of it."""
        page = self.allocator.alloc_page()
        fresh.append(page)
        free = self._free_in[page] = list(reversed(self._blocks_of(page)))
        self._partial_free += len(free)
        self._push_partial(page)
        self._moved(page, 0, len(free))
        self._take(page, want, out)

    def _whole_page(self, out: list[int], fresh: list[int]) -> None:
        """Put a page in use (the allocator's pick) and take all of its blocks: what ``_new_page``
        does for a run at least a page long, without the page ever joining the partly used
        ones (no free list made to be emptied, no bucket moves; a third of its cost)."""
        page = self.allocator.alloc_page()
        fresh.append(page)
        blocks = self._blocks_of(page)
        k = len(blocks)
        self._allocated[blocks.start : blocks.stop] = [1] * k
        out.extend(blocks)
        self._used[page] = k
        self.num_allocated += k

    def _by_fill(self, want: int) -> int:
        """The partly used page with the fewest free blocks among those with ``want`` or more,
        else the one with the most; the lowest page among equals (``_free_in`` is not empty).
        With ``want`` 1: the fullest."""
        buckets = self._nonempty
        fit = buckets >> want
        k = want + (fit & -fit).bit_length() - 1 if fit else buckets.bit_length() - 1
        heap, free_in = self._bucket[k], self._free_in
        while True:
            page = heap[0]
            free = free_in.get(page)
            if free is not None and len(free) == k:
                return page
            heapq.heappop(heap)
            self._entries -= 1

    def _moved(self, page: int, old: int, new: int) -> None:
        """Page ``page`` went from ``old`` to ``new`` free blocks (0: not in _free_in), _free_in
        already says so: move it between buckets."""
        counts = self._in_bucket
        if old:
            counts[old] -= 1
            if not counts[old]:
                self._nonempty &= ~(1 << old)
        if new:
            if not counts[new]:
                self._nonempty |= 1 << new
            counts[new] += 1
            if self._entries > 2 * len(self._free_in) + 64:
                self._rebuild_buckets()
            else:
                heapq.heappush(self._bucket[new], page)
                self._entries += 1

    def _rebuild_buckets(self) -> None:
        """The bucket heaps with their stale entries dropped (amortised O(1) a move)."""
        buckets: list[list[int]] = [[] for _ in range(self._bpp + 1)]
        for page, free in self._free_in.items():
            buckets[len(free)].append(page)
        for heap in buckets:
            heapq.heapify(heap)
        self._bucket = buckets
        self._entries = len(self._free_in)

    def _push_partial(self, page: int) -> None:
        """Note in the lowest-first heap a page that joins _free_in. The heap is only popped by
        ``Placement.LOWEST``, so under the other rules its stale entries are dropped here, by a
        rebuild once they outnumber the live ones (amortised O(1) a push)."""
        partial = self._partial
        if len(partial) > 2 * len(self._free_in) + 64:
            partial[:] = self._free_in
            heapq.heapify(partial)
        heapq.heappush(partial, page)

    def _check_blocks(self, blocks: Sequence[int], *, taking: bool) -> None:
        """Refuse, before anything changes, an id outside the pool, a block in the wrong state
        (taken while allocated, freed while not) or one listed twice.

        Each block checked is marked 2 in ``_allocated``, which a second listing finds; the
        caller's next pass sets 0 or 1 (``_unmark`` on a failure before it). Cheaper than the
        ``set(blocks)`` it replaced, about a tenth of a free's cost."""
        allocated, nb = self._allocated, self._num_blocks
        want = 0 if taking else 1
        for i, b in enumerate(blocks):
            if not 0 <= b < nb:
                self._unmark(blocks[:i], taking=taking)
                raise BlockStateError(f"block {b} is outside pool {self.pool} ({nb} blocks)")
            state = allocated[b]
            if state != want:
                self._unmark(blocks[:i], taking=taking)
                if state == 2:
                    what = "take" if taking else "free"
                    raise BlockStateError(f"a block of pool {self.pool} appears twice in one {what}: {sorted(blocks)}")
                state_s = "taken but already allocated" if taking else "freed but not allocated"
                raise BlockStateError(f"block {b} of pool {self.pool} {state_s}")
            allocated[b] = 2

    def _unmark(self, blocks: Sequence[int], *, taking: bool) -> None:
        """Undo ``_check_blocks``'s marks on the blocks still marked: back to their state."""
        allocated = self._allocated
        before = 0 if taking else 1
        for b in blocks:
            if 0 <= b < self._num_blocks and allocated[b] == 2:
                allocated[b] = before

    def take(self, blocks: Sequence[int]) -> None:
        """Hold these blocks themselves, all or nothing, recorded as one ``BlockAlloc``.

        vLLM may take a free block it did not ask for (``BlockPool.touch`` of an uncached block,
        as vLLM's tests of its issue #33775 do); kvcached must then hold it as vLLM does. A page
        that holds no block yet is put in use (mapped if need be) within the memory limit, else
        ``OutOfBlocksError`` and nothing changes."""
        if not blocks:
            return
        self._check_blocks(blocks, taking=True)
        allocated = self._allocated
        out: list[int] = []
        fresh: list[int] = []
        try:
            for b in blocks:
                page = b // self._bpp
                free = self._free_in.get(page)
                if free is None:  # no block of this page is allocated: put the page itself in use
                    try:
                        self.allocator.take_page(page)
                    except OutOfPagesError as exc:
                        raise OutOfBlocksError(f"block {b} of pool {self.pool} (page {page}): {exc}") from exc
                    fresh.append(page)
                    free = self._free_in[page] = list(reversed(self._blocks_of(page)))
                    self._partial_free += len(free)
                    self._push_partial(page)
                    self._moved(page, 0, len(free))
                free.remove(b)
                allocated[b] = 1
                out.append(b)
                self._used[page] += 1
                self.num_allocated += 1
                self._partial_free -= 1
                if not free:
                    del self._free_in[page]
                self._moved(page, len(free) + 1, len(free))
        except (BackendError, OutOfBlocksError):
            self._unmark(blocks, taking=True)  # those not reached
            self._give_back(out, fresh)
            raise
        self.recorder.emit(BlockAlloc(self.pool, tuple(out)))

    def _take(self, page: int, want: int, out: list[int]) -> None:
        free = self._free_in[page]
        have = len(free)
        k = min(want, have)
        for _ in range(k):
            b = free.pop()
            self._allocated[b] = 1
            out.append(b)
        self._used[page] += k
        self.num_allocated += k
        self._partial_free -= k
        if not free:
            del self._free_in[page]
        self._moved(page, have, have - k)

    def _give_back(self, blocks: list[int], fresh: list[int]) -> None:
        """Undo a partial ``alloc``: nothing was recorded yet, so only local state moves."""
        for b in blocks:
            self._free_one(b)
        for page in fresh:
            free = self._free_in.pop(page, None)
            if free is not None:
                self._partial_free -= len(free)
                self._moved(page, len(free), 0)
        if fresh:
            self.allocator.release_pages(fresh)

    def _free_one(self, b: int) -> None:
        """Block ``b`` back on its page's free list (the counts of allocated blocks aside)."""
        page = b // self._bpp
        self._allocated[b] = 0
        self._used[page] -= 1
        self.num_allocated -= 1
        self._partial_free += 1
        free = self._free_in.get(page)
        if free is None:
            free = self._free_in[page] = [b]
            self._push_partial(page)
        else:
            free.append(b)
        self._moved(page, len(free) - 1, len(free))

    def free(self, blocks: list[int] | tuple[int, ...]) -> None:
        """Return blocks; pages left empty go back to the allocator (kept until the ledger agrees)."""
        if not blocks:
            return
        self._check_blocks(blocks, taking=False)
        try:
            self.recorder.emit(BlockFree(self.pool, tuple(blocks)))
        except BaseException:
            self._unmark(blocks, taking=False)
            raise
        emptied = []
        allocated, used, free_in, bpp = self._allocated, self._used, self._free_in, self._bpp
        # A request's blocks come in runs on one page: its bucket moves once a run, not a block.
        last, before = -1, 0
        free: list[int] = []
        for b in blocks:
            page = b // bpp
            allocated[b] = 0
            if page != last:
                if last >= 0:
                    self._moved(last, before, len(free))
                got = free_in.get(page)
                if got is None:
                    before = 0
                    free = free_in[page] = []
                    self._push_partial(page)
                else:
                    before = len(got)
                    free = got
                last = page
            free.append(b)
            used[page] -= 1
            if not used[page]:
                emptied.append(page)
        if last >= 0:
            self._moved(last, before, len(free))
        self.num_allocated -= len(blocks)
        self._partial_free += len(blocks)
        for page in emptied:
            free = self._free_in.pop(page)
            self._partial_free -= len(free)
            self._moved(page, len(free), 0)
        if emptied:
            self.allocator.release_pages(emptied)

    def drain_releasable(self) -> None:
        """After events recorded outside the manager (the engine drains at the end of each
        scheduler call): give back the pages they let go."""
        self.allocator.drain_releasable()

    # --- memory limit -------------------------------------------------------------------------

    def set_limit_pages(self, pages: int) -> AllocatorState:
        return self.allocator.set_limit(pages)

    def state(self) -> AllocatorState:
        return self.allocator.state()

    # --- the bytes ----------------------------------------------------------------------------

    def range_view(self, replica: int = 0) -> torch.Tensor:
        """The whole range of the primary backend (replica 0) or of a replica, as uint8."""
        t = self._bytes.get(replica)
        if t is None:
            t = self._bytes[replica] = (self.backend, *self.replicas)[replica].tensor()
        return t

    def block_view(self, block: int, layer: int = 0, replica: int = 0) -> torch.Tensor:
        """The bytes of ``block`` (of ``layer``, for the per-layer layout) as a uint8 tensor."""
        g = self.geometry
        page, slot = divmod(block, self._bpp)
        region = layer if g.layout is Layout.PER_LAYER else 0
        start = (region * g.num_pages + page) * g.page_bytes + slot * g.block_bytes
        return self.range_view(replica)[start : start + g.block_bytes]
