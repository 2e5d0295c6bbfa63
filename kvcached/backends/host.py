"""Host memory backend: the same map/unmap contract as the CUDA backend, on an anonymous mmap.

It exists so that everything above the backend (page allocator, ledger-driven unmapping, the
freed-block-copy scenarios) runs and is tested on machines without a GPU, with memory that
really comes and goes. It runs on Linux only. *Shared* mode (``HostBackend(shared=path)``) serves
vLLM's CPU build, whose worker is a process of its own; *checking* mode
(``HostBackend(checking=True)``, for kvsim and tests) makes an access to an unmapped slot fault.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import sys
from typing import TYPE_CHECKING

from kvcached.backends.base import Backend, MiB, PageStillMappedError
from kvcached.errors import BackendError, ConfigError

if TYPE_CHECKING:
    import torch

# Python's mmap module gained MAP_NORESERVE only in 3.13; the value is 0x4000 on the Linux
# architectures that use the generic flag layout (not on mips, sparc, powerpc, where guessing
# would set an unrelated flag, so there we go without it).
_GENERIC_MMAP_ARCHES = {"x86_64", "amd64", "aarch64", "arm64", "riscv64", "s390x", "i386", "i686"}
_MAP_NORESERVE: int = getattr(mmap, "MAP_NORESERVE", 0) or (
    0x4000 if sys.platform == "linux" and platform.machine().lower() in _GENERIC_MMAP_ARCHES else 0
)

_MADV_REMOVE: int = getattr(mmap, "MADV_REMOVE", 9)
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE


class UnmappedAccessError(BackendError):
    """An access to a slot that is not mapped (checking mode): what would have read zeros."""

    def __init__(self, page: int, offset: int, nbytes: int, what: str = "") -> None:
        self.page, self.offset, self.nbytes = page, offset, nbytes
        about = f" ({what})" if what else ""
        super().__init__(f"host: access to unmapped page {page} at bytes {offset}..{offset + nbytes}{about}")


# mincore over huge ranges in one call would need a vector of one byte per OS page; 1 GiB at a
# time bounds it to 256 KiB with 4 KiB pages.
_MINCORE_CHUNK = 1 << 30
_LOW_BIT = bytes(b & 1 for b in range(256))


class HostBackend(Backend):
    """Anonymous-mmap backend. ``page_bytes`` must be a multiple of the OS page size, or
    ``madvise`` could not return a slot's memory without touching its neighbours.

    After ``close()``, views obtained from ``tensor()`` stay valid (the mmap is only unmapped
    when the last view is gone) and read zeros; writes through them fault in memory again,
    which is held until the last view is dropped and is no longer counted by
    ``resident_bytes()``.
    """

    kind = "host"

    def __init__(
        self,
        page_bytes: int = 2 * MiB,
        num_pages: int | None = None,
        *,
        shared: str | None = None,
        create: bool = True,
        checking: bool = False,
    ) -> None:
        # Linux only: elsewhere MADV_DONTNEED does not promise zeros, so the contract would not hold.
        if sys.platform != "linux":
            raise ConfigError(
                f"KVCACHED backend 'host' needs Linux (madvise(MADV_DONTNEED) returning zeroed "
                f"pages); this is {sys.platform}"
            )
        os_page = mmap.PAGESIZE
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ConfigError(f"KVCACHED_PAGE_SIZE_MB: page size must be a positive int of bytes, got {page_bytes!r}")
        if page_bytes % os_page:
            raise ConfigError(
                f"KVCACHED_PAGE_SIZE_MB: host page size {page_bytes} bytes is not a multiple of "
                f"the OS page size ({os_page} bytes), so an unmapped page's memory could not be "
                "returned to the OS"
            )
        super().__init__(page_bytes)
        self._mm: mmap.mmap | None = None
        self._addr = 0
        self.shared = shared
        self._create = create
        # What gives a slot's memory back: a private range drops its pages; a shared file's pages
        # must be removed from the file, or the other process's mapping would keep them.
        self._drop = _MADV_REMOVE if shared is not None else mmap.MADV_DONTNEED
        self.checking = checking
        if num_pages is not None:
            self.reserve(num_pages)

    def _reserve(self, num_pages: int) -> None:
        """NOTE: the range is one private anonymous ``mmap`` reserved with ``MAP_NORESERVE`` (no
        commit charge for slots never written), or a shared file (``_map_shared``)."""
        size = num_pages * self.page_bytes
        if self.shared is not None:
            mm = self._map_shared(self.shared, size)
        else:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
            try:
                mm = mmap.mmap(-1, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                raise BackendError(f"host: mmap of {size} bytes ({num_pages} pages) failed: {e}") from e
        # The address is needed for mincore; from_buffer exports the buffer, and an export
        # left alive would make the mmap unclosable, so the ctypes object is dropped at once.
        probe = ctypes.c_char.from_buffer(mm)
        self._addr = ctypes.addressof(probe)
        del probe
        self._mm = mm
        if self.checking:  # every slot starts unmapped: no access until it is mapped
            self._protect(0, size, _PROT_NONE)

    def _protect(self, start: int, length: int, prot: int) -> None:
        if _libc().mprotect(ctypes.c_void_p(self._addr + start), ctypes.c_size_t(length), prot) != 0:
            err = ctypes.get_errno()
            raise BackendError(f"host: mprotect of bytes {start}..{start + length} failed: {os.strerror(err)}")

    def _map_shared(self, path: str, size: int) -> mmap.mmap:
        """NOTE: shared mode serves vLLM's CPU build, whose worker runs in a process of its own,
        apart from the scheduler that decides which pages go. The range is a file on a tmpfs
        (``/dev/shm``) mapped ``MAP_SHARED`` by both, and "unmap" is ``MADV_REMOVE``. That frees
        the file's pages for every process that maps them, so the scheduler's unmap really
        returns the worker's memory and the worker's next read of the page sees zeros."""
        try:
            if self._create:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.ftruncate(fd, size)  # sparse: nothing is allocated until written
                except OSError:
                    os.close(fd)
                    os.unlink(path)
                    raise
            else:
                fd = os.open(path, os.O_RDWR)
                have = os.fstat(fd).st_size
                if have < size:
                    os.close(fd)
                    raise BackendError(f"host: shared KV memory {path} has {have} bytes, {size} needed")
        except OSError as e:
            raise BackendError(f"host: shared KV memory {path}: {e.strerror or e}") from e
        try:
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            if self._create:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            raise BackendError(f"host: mmap of shared KV memory {path} ({size} bytes) failed: {e}") from e
        finally:
            os.close(fd)  # the mapping keeps the file alive

    def _map(self, index: int) -> None:
        """NOTE: "map" only marks a slot usable: the kernel supplies zeroed memory on first write."""
        # Nothing to do: the slot was never written or was madvised away, so the kernel hands
        # out zeroed pages on first write. Touching them here would only cost time.
        if self.checking:
            assert self._mm is not None
            # An exposed slot may have been written while unmapped: a map starts from zeros.
            self._mm.madvise(self._drop, index * self.page_bytes, self.page_bytes)
            self._protect(index * self.page_bytes, self.page_bytes, _PROT_RW)

    def _unmap(self, index: int) -> None:
        """NOTE: "unmap" of a private range is ``madvise(MADV_DONTNEED)`` (of a shared one: see
        ``_map_shared``), which on Linux drops the slot's pages at once and makes the next read
        return zeros, the same observable behaviour as the CUDA backend's zero page."""
        assert self._mm is not None
        try:
            self._mm.madvise(self._drop, index * self.page_bytes, self.page_bytes)
        except OSError as e:
            # madvise either drops the pages or fails before touching them.
            raise PageStillMappedError(f"host: madvise of page {index} failed: {e}") from e
        if self.checking:
            self._protect(index * self.page_bytes, self.page_bytes, _PROT_NONE)

    # --- checking mode ----------------------------------------------------------------------
    #
    # A read of an unmapped page returning zeros is exactly how the freed-block copy hides. So in
    # checking mode an unmapped slot (never mapped, or unmapped) is also ``mprotect``ed
    # ``PROT_NONE``: any access to it faults at once instead of being backed by fresh zero
    # memory. A fault cannot be caught in Python (the process dies with SIGSEGV, which the
    # simulator reports as a crash with faulthandler's stack). So code that touches KV memory
    # asks first: ``check_access(offset, nbytes)`` raises ``UnmappedAccessError`` naming the
    # page, and ``unmapped_in`` lists them. A harness that has recorded such an access and wants
    # to go on as an unchecked backend would (reading zeros) calls ``expose(page)``. The slot's
    # next map or unmap protects it again, and a map in checking mode always starts from zeros.

    def unmapped_in(self, offset: int, nbytes: int) -> list[int]:
        """The slots within bytes ``offset..offset+nbytes`` of the range that are not mapped."""
        if nbytes <= 0:
            return []
        with self._lock:
            self._check_reserved()
            first, last = offset // self.page_bytes, (offset + nbytes - 1) // self.page_bytes
            if first < 0 or last >= self._num_pages:
                raise BackendError(f"host: bytes {offset}..{offset + nbytes} outside the range")
            return [i for i in range(first, last + 1) if not self._mapped[i]]

    def check_access(self, offset: int, nbytes: int, what: str = "") -> None:
        """Raise ``UnmappedAccessError`` if bytes ``offset..offset+nbytes`` touch an unmapped slot."""
        bad = self.unmapped_in(offset, nbytes)
        if bad:
            raise UnmappedAccessError(bad[0], offset, nbytes, what)

    def expose(self, index: int) -> None:
        """Checking mode: let an unmapped slot be read and written (zeros) as an unchecked backend
        would, after its access was recorded; its next map or unmap protects it again."""
        with self._lock:
            self._check_reserved()
            if self.checking and not self._mapped[index]:
                self._protect(index * self.page_bytes, self.page_bytes, _PROT_RW)

    def unmap_all(self) -> None:
        """Drop the memory of every slot, mapped or not: another process sharing the range may
        have written pages this object never mapped (vLLM's warm-up runs, say)."""
        with self._lock:
            self._check_reserved()
            assert self._mm is not None
            for i in range(self._num_pages):
                if not self._mapped[i]:
                    try:
                        self._mm.madvise(self._drop, i * self.page_bytes, self.page_bytes)
                    except OSError as e:
                        raise BackendError(f"host: madvise of page {i} failed: {e}") from e

    def unlink(self) -> None:
        """Remove the shared file's name; the mappings (and the memory in use) stay."""
        if self.shared is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.shared)

    def _tensor(self, dtype: torch.dtype) -> torch.Tensor:
        import torch

        assert self._mm is not None
        # torch.frombuffer keeps a reference to the mmap object (not a buffer export), so the
        # view keeps the object, and with it the mapping, alive. It does not stop mmap.close()
        # from unmapping under the view, which is why this class never calls close() on it.
        return torch.frombuffer(self._mm, dtype=dtype)

    def _close(self) -> None:
        mm = self._mm
        if mm is None:
            return
        # One madvise over the whole range also reclaims anything written through a stale view
        # into an unmapped slot, which per-page unmapping would miss.
        if self.checking:  # views outlive close() and read zeros, as in the unchecked mode
            self._protect(0, len(mm), _PROT_RW)
        try:
            # Of a shared file, the creator returns the memory; an attached process only lets go.
            if self.shared is None or self._create:
                mm.madvise(self._drop, 0, len(mm))
        except OSError as e:
            raise BackendError(f"host: madvise of the whole range failed: {e}") from e
        finally:
            # Dropping the reference, not mm.close(): with views alive, close() would munmap
            # under them (a segfault on their next access). Without views, CPython frees the
            # object here and its dealloc munmaps the range.
            self._mm = None
            self._addr = 0

    def resident_bytes(self) -> int:
        """Bytes of this range resident in RAM now, from mincore(2) over the range.

        NOTE: the kernel is asked over exactly this range because the process RSS (or
        ``smaps_rollup``) cannot tell this range from the rest of the heap, and the tests must
        see the memory go back.

        Pages that were only *read* after an unmap map the kernel's shared zero page and count
        as resident here though they cost no memory; writes are what the tests measure."""
        with self._lock:
            mm, addr = self._mm, self._addr
            if mm is None:
                return 0
            return _mincore_resident(addr, len(mm))


def _mincore_resident(addr: int, length: int) -> int:
    libc = _libc()
    os_page = mmap.PAGESIZE
    total = 0
    for start in range(0, length, _MINCORE_CHUNK):
        n = min(_MINCORE_CHUNK, length - start)
        pages = (n + os_page - 1) // os_page
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(addr + start), ctypes.c_size_t(n), vec) != 0:
            err = ctypes.get_errno()
            raise BackendError(f"host: mincore over the range failed: {os.strerror(err)}")
        # Only bit 0 is defined; the others are reserved, so mask before counting.
        total += bytes(vec).translate(_LOW_BIT).count(1)
    return total * os_page


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        lib.mincore.restype = ctypes.c_int
        lib.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.mprotect.restype = ctypes.c_int
        _LIBC = lib
    return _LIBC
