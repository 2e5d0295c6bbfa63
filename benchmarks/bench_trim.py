"""A shrink that lets many pages go at once: ``PageAllocator._trim`` per page, as the count grows.

The allocator gives back its highest let-go page first. Taking ``max()`` of the set of let-go
pages for each page makes a pass over N pages cost O(N^2); one heap per pass makes it
O(N log N), so the time per page should stay about flat as N grows. The backend here maps and
unmaps nothing (a stand-in that only counts), so what is timed is kvcached's own bookkeeping
and the ledger's ``PageUnmapped`` events, not the memory calls. Median of ``--runs``.

    python benchmarks/bench_trim.py [--runs 5] [--pages 1000 4000 16000]
"""

from __future__ import annotations

import argparse
import statistics
import time


class NullPages:
    """A page mapper that maps nothing: the allocator's own cost alone."""

    def __init__(self, num_pages: int) -> None:
        self._n = num_pages
        self.unmaps = 0

    @property
    def num_pages(self) -> int:
        return self._n

    def map_page(self, index: int) -> None:
        pass

    def unmap_page(self, index: int) -> None:
        self.unmaps += 1


def one(pages: int) -> float:
    """Seconds for one pass that unmaps ``pages`` pages let go together (limit lowered to 0)."""
    from kvcached.ledger.events import BlockAlloc, BlockFree, BuildBoundary, Header, Policy, PoolGeometry
    from kvcached.ledger.ledger import Ledger
    from kvcached.ledger.recorder import Recorder
    from kvcached.page_allocator import PageAllocator

    header = Header(page_bytes=4096, pools=(PoolGeometry(block_bytes=4096, num_blocks=pages),), policy=Policy.LEDGER)
    recorder = Recorder(Ledger(header), None)
    backend = NullPages(pages)
    alloc = PageAllocator(backend, recorder, min_reserved=0, max_reserved=pages)
    got = [alloc.alloc_page() for _ in range(pages)]
    recorder.emit(BlockAlloc(0, tuple(got)))
    recorder.emit(BlockFree(0, tuple(got)))
    alloc.release_pages(got)  # reserved now, kept (max_reserved): none goes yet
    recorder.emit(BuildBoundary(0))
    recorder.emit(BuildBoundary(1))
    alloc.drain_releasable()  # every page let go by the ledger, still within max_reserved
    t0 = time.perf_counter()
    alloc.set_limit(0)  # ... and now all go in one pass
    seconds = time.perf_counter() - t0
    assert backend.unmaps == pages and alloc.mapped == 0, (backend.unmaps, alloc.mapped)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--pages", type=int, nargs="+", default=[1000, 4000, 16000])
    a = ap.parse_args()
    from kvcached.ledger.compiled import is_compiled

    print(f"page allocator: {'compiled' if is_compiled('kvcached.page_allocator') else 'pure Python'}")
    for n in a.pages:
        s = statistics.median(one(n) for _ in range(a.runs))
        print(f"{n:>7} pages let go at once: {s * 1e3:9.2f} ms a pass, {s / n * 1e6:6.2f} us a page")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
