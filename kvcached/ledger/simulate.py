"""Re-derive an allocator's decisions from a trace's inputs under a chosen policy.

Replay can check a trace with the map/unmap decisions it recorded, or ask "what would have
happened under the other policy?". The second needs decisions made afresh: this module plays
the most eager allocator there is (no reserved pages, as ``KVCACHED_MAX_RESERVED_PAGES=0`` in
kvcached PR #598's reproduction), which maps a page right before a block on it is handed out and unmaps
every page the moment the ledger lets it. It is the worst case for the freed-block copy, so a
policy that is clean here is clean for any allocator that asks the same ledger.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .events import DECISIONS, BlockAlloc, Event, PageMapped, PageUnmapped
from .ledger import Ledger


def derive(ledger: Ledger, inputs: Iterable[Event]) -> Iterator[Event]:
    """Apply ``inputs`` to ``ledger`` with fresh decisions; yield every event applied, in order.

    Recorded decisions in ``inputs`` are dropped: the point is to make them again.
    """
    apply, fresh = ledger.apply, ledger.take_fresh_releasable
    for ev in inputs:
        if type(ev) in DECISIONS:
            continue
        if type(ev) is BlockAlloc:
            for p in _unmapped_pages(ledger, ev):
                m = PageMapped(page=p)
                apply(m)
                yield m
        apply(ev)
        yield ev
        for p in fresh():
            u = PageUnmapped(page=p)
            apply(u)
            yield u


def _unmapped_pages(ledger: Ledger, ev: BlockAlloc) -> list[int]:
    pools = ledger.header.pools
    if ev.pool >= len(pools):
        return []  # the ledger reports the unknown pool
    nb = pools[ev.pool].num_blocks
    pages = dict.fromkeys(ledger.page_of(ev.pool, b) for b in ev.blocks if b < nb)
    return [p for p in pages if not ledger.is_mapped(p)]


def replay(ledger: Ledger, inputs: Iterable[Event]) -> Ledger:
    """Run ``derive`` to the end and return the ledger, for callers that need only the verdict."""
    for _ in derive(ledger, inputs):
        pass
    return ledger
