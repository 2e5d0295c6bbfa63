"""How long pins hold emptied pages: from the free that emptied a pinned page to its release.

A page whose last block was freed while a pin keeps it (an offloading job that still reads its
blocks, a grace, a window hold) stays mapped: memory that a neighbour on the budget cannot have
and that a lowered limit waits for. The ledger says when such a page may go, not how long the
wait was. ``HoldClock`` times each hold, from ``PageAllocator.release_pages`` to the drain that
learns the ledger let the page go (``PageAllocator._drain``) or to the page being handed out
again, and buckets the lengths as vLLM 0.34 buckets its CPU tier's deferred releases
(``vllm:kv_offload_tiering_deferred_release_hold_seconds``, ``TieringOffloadingSpec.get_metrics``),
observed at the end, so that both read on one dashboard. ``vllm:kvcached_page_hold_seconds``
exports it; ``vllm:kvcached_pages{state="pinned"}`` counts the pages held now.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable
from typing import Final

from .service.messages import Histogram

# Upper bounds in seconds (Prometheus' ``le``), vLLM 0.34's for its deferred releases; a last
# bucket holds the rest (+Inf).
BOUNDS: Final = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class HoldClock:
    """The start of each hold still open (by the allocator's page), and the ended ones, bucketed."""

    __slots__ = ("_clock", "_counts", "_since", "_sum")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: dict[int, float] = {}
        self._counts = [0] * (len(BOUNDS) + 1)
        self._sum = 0.0

    def __len__(self) -> int:
        """Holds open now."""
        return len(self._since)

    def begin(self, page: int) -> None:
        self._since[page] = self._clock()

    def end(self, pages: Iterable[int]) -> None:
        """The holds of ``pages`` end now; a page with no open hold is passed over."""
        now: float | None = None
        for page in pages:
            start = self._since.pop(page, None)
            if start is None:
                continue
            if now is None:
                now = self._clock()
            held = max(0.0, now - start)
            self._counts[bisect.bisect_left(BOUNDS, held)] += 1
            self._sum += held

    def snapshot(self) -> Histogram:
        return Histogram(bounds=BOUNDS, counts=tuple(self._counts), sum=self._sum)
