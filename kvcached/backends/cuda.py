"""CUDA virtual-memory backend: one reserved device address range, physical pages (2 MiB on the H200) mapped
into it and returned to the driver one at a time, through cuda-python's driver API, with the calls that
``vmm_probe.py`` verified on the H200.

Like upstream kvcached, every slot without a page of its own is backed by one shared, zero-filled *zero page*, so
a late read of a freed slot (the freed-block copy) returns zeros instead of an illegal-address fault that would
kill the whole CUDA context. cuda-python is imported lazily, so the package imports without it.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kvcached.backends.base import Backend, PageStillMappedError
from kvcached.errors import BackendError, ConfigError

if TYPE_CHECKING:
    import torch

_UNBACKED, _ZERO, _REAL = 0, 1, 2


def load_driver() -> ModuleType:
    """cuda-python's driver module: ``cuda.bindings.driver`` (cuda-python >= 12.6), else the
    older ``cuda.cuda`` layout. ConfigError if neither is installed."""
    failures = []
    for name in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            return importlib.import_module(name)
        except Exception as e:  # not only ImportError: a broken install can fail while loading
            failures.append(f"{name}: {e}")
    raise ConfigError(
        "KVCACHED backend 'cuda' needs cuda-python (pip install cuda-python, or cuda-bindings); "
        "it is not importable here (" + "; ".join(failures) + ")"
    )


def _call(cu: ModuleType, name: str, *args: Any, what: str = "") -> Any:
    """Call driver function ``name``; its value(s) without the CUresult. Looked up by name on every call so
    that tests can monkeypatch the module to inject errors."""
    result = getattr(cu, name)(*args)
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:  # CUDA_SUCCESS is 0 in every CUresult enum
        where = f" ({what})" if what else ""
        raise BackendError(f"cuda: {name} failed with {getattr(err, 'name', None) or err} ({int(err)}){where}")
    if not isinstance(result, tuple) or len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


class _Resources:
    """Everything the driver must be given back, shared by the backend and the finalizer. It never references the
    owner, or the owner could never die."""

    def __init__(self, cu: ModuleType, device: int, dev: Any, ctx: Any, zero_page: bool) -> None:
        self.cu = cu
        self.device = device
        self.dev = dev
        self.ctx = ctx
        self.ctx_int = int(ctx)
        self.ctx_retained = True
        self.zero_page = zero_page
        self.page_bytes = 0
        self.va: Any = None  # the CUdeviceptr from cuMemAddressReserve; None when not held
        self.base = 0
        self.size = 0
        self.zero_handle: Any = None
        self.slots = bytearray()  # _UNBACKED / _ZERO / _REAL per slot
        self.handles: dict[int, Any] = {}
        self.errors: list[str] = []  # failures while tearing down, reported by close()
        # Reentrant: a GC pass in close() can drop the last view and run the finalizer in this very thread.
        self.lock = threading.RLock()
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        self.prop = prop
        access = cu.CUmemAccessDesc()
        access.location = prop.location
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.access = [access]

    def enter(self) -> bool:
        """Make the primary context current in this thread; True if pushed (pop it after). A thread other than
        the one torch initialised CUDA in has no current context and VMM calls there would fail: a null context is
        replaced for good (cheap next time); another context is pushed and popped, not clobbered."""
        cur = _call(self.cu, "cuCtxGetCurrent")
        cur_int = int(cur)
        if cur_int == self.ctx_int:
            return False
        if cur_int == 0:
            _call(self.cu, "cuCtxSetCurrent", self.ctx)
            return False
        _call(self.cu, "cuCtxPushCurrent", self.ctx)
        return True

    def leave(self, pushed: bool) -> None:
        if pushed:
            _call(self.cu, "cuCtxPopCurrent")

    def ptr(self, index: int) -> int:
        return self.base + index * self.page_bytes

    def map_handle(self, index: int, handle: Any, what: str) -> None:
        """cuMemMap + cuMemSetAccess at slot ``index``; leaves the slot empty on failure."""
        ptr, pb = self.ptr(index), self.page_bytes
        _call(self.cu, "cuMemMap", ptr, pb, 0, handle, 0, what=what)
        try:
            _call(self.cu, "cuMemSetAccess", ptr, pb, self.access, 1, what=what)
        except BaseException as e:
            # A mapping without access rights is useless and blocks the slot.
            failed = self.try_call("cuMemUnmap", ptr, pb, what=f"rollback, {what}")
            if failed:
                e.add_note(f"rollback failed too, the slot stays mapped: {failed}")
            raise

    def map_zero(self, index: int) -> None:
        self.map_handle(index, self.zero_handle, f"zero page at page {index}")
        self.slots[index] = _ZERO

    def try_call(self, name: str, *args: Any, what: str = "") -> str | None:
        """A call on a cleanup path, where a failure must not mask the error being handled: returns the
        failure's message, or None when the call succeeded."""
        try:
            _call(self.cu, name, *args, what=what)
            return None
        except BackendError as e:
            return str(e)

    def teardown_call(self, name: str, *args: Any, what: str = "") -> bool:
        """try_call that records the failure for close() to report; True on success."""
        failed = self.try_call(name, *args, what=what)
        if failed:
            self.errors.append(failed)
        return failed is None

    def free_range(self) -> None:
        """Unmap every slot, release every handle and the range; each failure goes to ``errors``, the rest runs."""
        with self.lock:
            if self.va is None:
                return
            pushed = self.enter()
            try:
                # Kernels or copies still queued on the range would fault once it is unmapped.
                self.teardown_call("cuCtxSynchronize", what="before freeing the range")
                pb = self.page_bytes
                for index, state in enumerate(self.slots):
                    if state != _UNBACKED:
                        self.teardown_call("cuMemUnmap", self.ptr(index), pb, what=f"page {index}")
                        self.slots[index] = _UNBACKED
                for index, handle in self.handles.items():
                    self.teardown_call("cuMemRelease", handle, what=f"page {index}")
                self.handles.clear()
                if self.zero_handle is not None:
                    self.teardown_call("cuMemRelease", self.zero_handle, what="zero page")
                    self.zero_handle = None
                self.teardown_call("cuMemAddressFree", self.va, self.size, what="the range")
                self.va = None
                self.base = self.size = 0
            finally:
                self.leave(pushed)


def _finalize(res: _Resources) -> None:
    """Runs once, when the backend and every view have let go of the range owner (or at exit)."""
    try:
        res.free_range()
    except BaseException as e:  # a finalizer must not raise into whoever dropped the last view
        res.errors.append(f"cuda: freeing the range failed: {e}")
    if res.ctx_retained:
        res.ctx_retained = False
        res.teardown_call("cuDevicePrimaryCtxRelease", res.dev, what=f"device {res.device}")


class _RangeOwner:
    """What torch views point at: keeping it alive keeps the range, since the finalizer that frees it hangs here.

    NOTE: torch views keep this owner alive (torch increfs the ``__cuda_array_interface__`` provider until the
    tensor's storage dies), and the range is freed by a ``weakref.finalize`` on it, so the range can never be freed
    under a live view."""

    def __init__(self, res: _Resources) -> None:
        self._res = res

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        res = self._res
        return {"shape": (res.size,), "typestr": "|u1", "data": (res.base, False), "version": 3}


class CudaVmmBackend(Backend):
    """CUDA VMM pages behind one reserved range on ``device`` (an ordinal under CUDA_VISIBLE_DEVICES, as torch
    counts them). ``page_bytes`` defaults to the allocation granularity (2 MiB on the H200) and must be a multiple
    of it. After ``close()`` every page is returned; views still alive keep the range, read zeros (the zero page)
    and must not be written (a write lands in the page shared by every unmapped slot); the range goes with the
    last view.

    NOTE: mapping a slot first unmaps the zero page there and unmapping maps it back, at the price of one extra
    driver step each way (``bench_backend_cuda.py`` reports it; ``zero_page=False`` drops the safety net for
    measurements).
    """

    kind = "cuda"

    def __init__(
        self, device: int = 0, page_bytes: int | None = None, num_pages: int | None = None, *, zero_page: bool = True
    ) -> None:
        cu = load_driver()
        try:
            _call(cu, "cuInit", 0)
        except BackendError as e:
            raise ConfigError(f"KVCACHED backend 'cuda': the CUDA driver did not initialise: {e}") from e
        except Exception as e:  # cuda-bindings raises its own error when libcuda is absent
            raise ConfigError(f"KVCACHED backend 'cuda': no usable CUDA driver: {e}") from e
        try:
            dev = _call(cu, "cuDeviceGet", int(device), what=f"device {device}")
        except BackendError as e:
            raise ConfigError(f"KVCACHED backend 'cuda': no CUDA device {device} here: {e}") from e
        ctx = _call(cu, "cuDevicePrimaryCtxRetain", dev, what=f"device {device}")
        try:
            res = _Resources(cu, int(device), dev, ctx, zero_page)
        except BaseException:
            cu.cuDevicePrimaryCtxRelease(dev)
            raise
        self._res = res
        self._owner: _RangeOwner | None = _RangeOwner(res)
        # From here on the retain (and later the range) is released when the owner dies, even
        # if this constructor raises below.
        self._finalizer = weakref.finalize(self._owner, _finalize, res)
        minimum = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        pushed = res.enter()
        try:
            gran = int(_call(cu, "cuMemGetAllocationGranularity", res.prop, minimum))
        finally:
            res.leave(pushed)
        self.granularity = gran
        self.device = int(device)
        self.zero_page = zero_page
        if page_bytes is None:
            page_bytes = gran
        if isinstance(page_bytes, bool) or not isinstance(page_bytes, int) or page_bytes <= 0:
            raise ConfigError(f"KVCACHED_PAGE_SIZE_MB: page size must be a positive int of bytes, got {page_bytes!r}")
        if page_bytes % gran:
            raise ConfigError(
                f"KVCACHED_PAGE_SIZE_MB: page size {page_bytes} bytes is not a multiple of the "
                f"CUDA allocation granularity of device {device} ({gran} bytes = "
                f"{gran / 2**20:g} MiB); set KVCACHED_PAGE_SIZE_MB to a multiple of {gran / 2**20:g}"
            )
        res.page_bytes = page_bytes
        super().__init__(page_bytes)
        if num_pages is not None:
            self.reserve(num_pages)

    def _reserve(self, num_pages: int) -> None:
        res = self._res
        size = num_pages * self.page_bytes
        pushed = res.enter()
        try:
            with res.lock:
                res.va = _call(res.cu, "cuMemAddressReserve", size, 0, 0, 0, what=f"{size} bytes")
                res.base, res.size = int(res.va), size
                res.slots = bytearray(num_pages)
                try:
                    if res.zero_page:
                        res.zero_handle = _call(res.cu, "cuMemCreate", self.page_bytes, res.prop, 0, what="zero page")
                        for index in range(num_pages):
                            res.map_zero(index)
                        # cuMemCreate does not promise zeroed memory. Every slot shows the same
                        # page, so clearing it through slot 0 clears it everywhere.
                        _call(res.cu, "cuMemsetD8", res.base, 0, self.page_bytes, what="zero page")
                        _call(res.cu, "cuCtxSynchronize", what="zero page")
                except BaseException as e:
                    res.free_range()
                    res.slots = bytearray()
                    for failed in res.errors:
                        e.add_note(f"cleanup: {failed}")
                    res.errors.clear()
                    raise
        finally:
            res.leave(pushed)

    def _map(self, index: int) -> None:
        """NOTE: failures roll back: a map that fails after cuMemCreate releases the handle and puts the zero page
        back, so nothing leaks."""
        res = self._res
        pushed = res.enter()
        try:
            with res.lock:
                what = f"page {index}"
                # Created first: it is the call that fails when memory is short, and nothing
                # else has been touched yet.
                handle = _call(res.cu, "cuMemCreate", self.page_bytes, res.prop, 0, what=what)
                try:
                    if res.slots[index] == _ZERO:
                        _call(res.cu, "cuMemUnmap", res.ptr(index), self.page_bytes, what=f"zero page at {what}")
                        res.slots[index] = _UNBACKED
                    res.map_handle(index, handle, what)
                except BaseException as e:
                    failed = res.try_call("cuMemRelease", handle, what=f"rollback, {what}")
                    if failed:
                        e.add_note(f"rollback could not release the new page: {failed}")
                    if res.zero_page and res.slots[index] == _UNBACKED:
                        try:
                            res.map_zero(index)
                        except BackendError as z:
                            e.add_note(f"and the zero page could not be put back, so page {index} is unbacked: {z}")
                    raise
                res.handles[index] = handle
                res.slots[index] = _REAL
        finally:
            res.leave(pushed)

    def _unmap(self, index: int) -> None:
        res = self._res
        try:
            pushed = res.enter()
        except BackendError as e:
            raise PageStillMappedError(str(e)) from e
        try:
            with res.lock:
                what = f"page {index}"
                try:
                    _call(res.cu, "cuMemUnmap", res.ptr(index), self.page_bytes, what=what)
                except BackendError as e:
                    raise PageStillMappedError(str(e)) from e
                res.slots[index] = _UNBACKED
                handle = res.handles.pop(index)
                release_failed = res.try_call("cuMemRelease", handle, what=what)
                if res.zero_page:
                    try:
                        res.map_zero(index)
                    except BackendError as e:
                        raise BackendError(
                            f"{e}: page {index} was returned but has no zero page behind it; a read of it would fault"
                        ) from e
                if release_failed:
                    raise BackendError(f"{release_failed}: page {index} is unmapped but its memory may leak")
        finally:
            res.leave(pushed)

    def _tensor(self, dtype: torch.dtype) -> torch.Tensor:
        import torch

        owner = self._owner
        assert owner is not None
        # The device is explicit: with a bare "cuda", another current device would make as_tensor *copy* the range.
        t = torch.as_tensor(owner, device=torch.device("cuda", self._res.device))
        if t.data_ptr() != self._res.base:
            raise BackendError("cuda: torch copied the range instead of viewing it")
        return t if dtype == torch.uint8 else t.view(dtype)

    def _close(self) -> None:
        res = self._res
        owner, self._owner = self._owner, None
        assert owner is not None
        probe = weakref.ref(owner)
        del owner
        if probe() is not None:
            # Views keep the range: return the pages now, with the zero page behind them so stale reads get zeros;
            # the finalizer frees the rest when the last view dies.
            self._return_pages_keep_range()
        if res.errors:
            raise BackendError("cuda: close: " + "; ".join(res.errors))

    def _return_pages_keep_range(self) -> None:
        res = self._res
        with res.lock:
            if res.va is None:  # the last view died meanwhile and the finalizer freed it all
                return
            pushed = res.enter()
            try:
                res.teardown_call("cuCtxSynchronize", what="before returning the pages")
                for index, handle in list(res.handles.items()):
                    if res.va is None:
                        break  # a view died during this loop (GC) and the finalizer already freed it all
                    if not res.teardown_call("cuMemUnmap", res.ptr(index), self.page_bytes, what=f"page {index}"):
                        continue  # still mapped: the finalizer will retry with the rest
                    res.slots[index] = _UNBACKED
                    del res.handles[index]
                    res.teardown_call("cuMemRelease", handle, what=f"page {index}")
                    if res.zero_page:
                        try:
                            res.map_zero(index)
                        except BackendError as e:
                            res.errors.append(str(e))
            finally:
                res.leave(pushed)

    def resident_bytes(self) -> int:
        """Mapped pages times page size; the shared zero page (one page more while the range exists) is not counted."""
        return self.mapped_count * self.page_bytes
