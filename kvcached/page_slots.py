"""Logical pages over several backends and regions, mapped and unmapped all or none.

The manager's page allocator thinks in logical pages; a per-layer layout (one region per layer)
or replicas (tensor-parallel ranks in one process, each with its own copy of the KV) put one
logical page in many backend slots. Moved out of ``kv_cache_manager`` (which is about blocks)
so that each stays one idea; it is not on the scheduler step's hot path (a page map is rare).
"""

from __future__ import annotations

from collections.abc import Sequence

from .backends.base import Backend, PageStillMappedError
from .errors import BackendError


class RegionSlots:
    """Logical page ``p`` = slot ``p`` of every layer's region of every backend (tensor-parallel
    ranks each hold their own copy of the KV and follow the same map/unmap decisions); all of
    them are mapped or none."""

    def __init__(self, backends: Sequence[Backend], num_pages: int, regions: int) -> None:
        self.backends = tuple(backends)
        self.num_pages = num_pages
        self._regions = regions

    def _slots(self, index: int) -> list[tuple[Backend, int]]:
        return [(b, r * self.num_pages + index) for b in self.backends for r in range(self._regions)]

    def map_page(self, index: int) -> None:
        done: list[tuple[Backend, int]] = []
        try:
            for backend, slot in self._slots(index):
                backend.map_page(slot)
                done.append((backend, slot))
        except BackendError:
            for backend, slot in done:
                backend.unmap_page(slot)
            raise

    def unmap_page(self, index: int) -> None:
        # All or none here too. A slot that fails having returned nothing (PageStillMappedError)
        # gets the slots unmapped before it mapped again, so that the page is whole and still
        # mapped, as the error tells the allocator (which tries again later); the page is empty,
        # so they lose nothing by coming back zeroed. Any other failure returned the slot's
        # memory (``Backend.unmap_page``): the rest are unmapped as well and the error raised.
        done: list[tuple[Backend, int]] = []
        gone: BackendError | None = None
        for backend, slot in self._slots(index):
            try:
                backend.unmap_page(slot)
            except PageStillMappedError as e:
                if gone is None:
                    for b, s in done:
                        b.map_page(s)  # a failure here is a plain BackendError: the page counts as gone
                    raise
                gone.add_note(f"slot {slot} of {backend.kind} stays mapped: {e}")
                continue
            except BackendError as e:
                gone = gone or e
            done.append((backend, slot))
        if gone is not None:
            raise gone
