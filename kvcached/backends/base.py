"""The one interface every memory backend of kvcached implements, and the bookkeeping they share.

A backend owns one virtual range of ``num_pages`` slots of ``page_bytes`` each and backs single
slots with physical memory on request. The allocator above it decides *when* a slot may lose its
memory (the ledger's job); the backend only has to make each step exact and observable. The
shared checks live here, in one place, so the host backend (used on CPU machines and in tests)
and the CUDA backend cannot drift apart in what they accept.
"""

from __future__ import annotations

import abc
import threading
from types import TracebackType
from typing import TYPE_CHECKING, Self

from kvcached.errors import BackendError

if TYPE_CHECKING:
    import torch

MiB = 1024 * 1024


class Backend(abc.ABC):
    """A reserved virtual range of ``num_pages`` slots, each mapped to memory on request.

    Thread-safe: map, unmap and close are serialised by one lock, because the engine may unmap
    from a background thread while the scheduler maps. Use as a context manager or call
    ``close()``; both are idempotent.

    NOTE: each step is exact and observable: a slot is mapped or it is not, mapping a mapped slot
    or unmapping an unmapped one is an error rather than a silent no-op (both would hide an
    accounting bug upstream). A failed map leaves nothing behind, and a slot whose memory was
    returned reads as zeros instead of faulting. Subclasses supply only the ``_reserve``,
    ``_map``, ``_unmap``, ``_tensor`` and ``_close`` steps.
    """

    kind: str = "abstract"

    def __init__(self, page_bytes: int) -> None:
        self._page_bytes = int(page_bytes)
        self._num_pages = 0
        # One byte per slot instead of a set: O(1) checks without hashing on the hot path,
        # and a range of 40k slots costs 40 kB.
        self._mapped = bytearray()
        self._mapped_count = 0
        self._reserved = False
        self._closed = False
        self._lock = threading.Lock()

    # -- what subclasses implement --------------------------------------------------------

    @abc.abstractmethod
    def _reserve(self, num_pages: int) -> None:
        """Reserve ``num_pages * page_bytes`` of address space, backed by nothing yet."""

    @abc.abstractmethod
    def _map(self, index: int) -> None:
        """Back slot ``index`` with fresh memory; on failure, leave the slot as it was."""

    @abc.abstractmethod
    def _unmap(self, index: int) -> None:
        """Return slot ``index``'s memory; later reads of the slot return zeros."""

    @abc.abstractmethod
    def _tensor(self, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D view over the whole range that keeps the range alive."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Return every mapped slot's memory and give up this object's hold on the range."""

    @abc.abstractmethod
    def resident_bytes(self) -> int:
        """Physical memory the range holds now, as measured by the backend."""

    # -- the interface ------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def mapped_count(self) -> int:
        return self._mapped_count

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def nbytes(self) -> int:
        return self._num_pages * self._page_bytes

    def reserve(self, num_pages: int) -> None:
        """Reserve the range. Once per backend: the range never grows, because views handed
        out by ``tensor()`` point at its start and would not see a moved range."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise BackendError(f"{self.kind}: reserve needs a positive page count, got {num_pages!r}")
        with self._lock:
            self._check_open()
            if self._reserved:
                raise BackendError(
                    f"{self.kind}: range already reserved ({self._num_pages} pages); a backend reserves once"
                )
            self._reserve(num_pages)
            self._num_pages = num_pages
            self._mapped = bytearray(num_pages)
            self._reserved = True

    def map_page(self, index: int) -> None:
        """Back slot ``index`` with fresh physical memory, read-write."""
        with self._lock:
            self._check_slot(index)
            if self._mapped[index]:
                raise BackendError(f"{self.kind}: page {index} is already mapped")
            self._map(index)
            self._mapped[index] = 1
            self._mapped_count += 1

    def unmap_page(self, index: int) -> None:
        """Return slot ``index``'s physical memory; reads of it afterwards return zeros.

        The caller must make sure no queued GPU work still touches the slot: an unmap is not
        ordered after kernels or copies in flight (that ordering is what the ledger's pins are
        for)."""
        with self._lock:
            self._check_slot(index)
            if not self._mapped[index]:
                raise BackendError(f"{self.kind}: page {index} is not mapped")
            # Marked unmapped before the call: a failing unmap may already have returned the
            # memory, and claiming it is still mapped would invite a second unmap of nothing.
            # A subclass that failed before touching the slot says so with PageStillMappedError.
            self._mapped[index] = 0
            self._mapped_count -= 1
            try:
                self._unmap(index)
            except PageStillMappedError:
                self._mapped[index] = 1
                self._mapped_count += 1
                raise

    def is_mapped(self, index: int) -> bool:
        self._check_index(index)
        return bool(self._mapped[index])

    def mapped_pages(self) -> list[int]:
        return [i for i, m in enumerate(self._mapped) if m]

    def tensor(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A 1-D tensor over the whole range (``nbytes // itemsize`` elements).

        The view holds a reference to the object that owns the range, so the range outlives
        every view even after ``close()``; see the subclass for what a view reads after close.
        """
        import torch

        dt = torch.uint8 if dtype is None else dtype
        with self._lock:
            self._check_open()
            self._check_reserved()
            if self.nbytes % dt.itemsize:
                raise BackendError(f"{self.kind}: range of {self.nbytes} bytes is not a whole number of {dt}")
            return self._tensor(dt)

    def close(self) -> None:
        """Unmap every page and give up the range. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._close()
            finally:
                self._mapped = bytearray(self._num_pages)
                self._mapped_count = 0

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._mapped_count}/{self._num_pages} mapped"
        return f"<{type(self).__name__} page_bytes={self._page_bytes} {state}>"

    # -- checks ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"{self.kind}: backend is closed")

    def _check_reserved(self) -> None:
        if not self._reserved:
            raise BackendError(f"{self.kind}: no range reserved yet; call reserve(num_pages) first")

    def _check_index(self, index: int) -> None:
        # bool is an int subclass; a True slipping through as page 1 would be a silent bug.
        if isinstance(index, bool) or not isinstance(index, int):
            raise BackendError(f"{self.kind}: page index must be an int, got {index!r}")
        if not 0 <= index < self._num_pages:
            raise BackendError(f"{self.kind}: page index {index} out of range [0, {self._num_pages})")

    def _check_slot(self, index: int) -> None:
        self._check_open()
        self._check_reserved()
        self._check_index(index)


class PageStillMappedError(BackendError):
    """Raised by a subclass's ``_unmap`` when it failed before touching the slot, so the
    page is still mapped and the bookkeeping must say so."""
