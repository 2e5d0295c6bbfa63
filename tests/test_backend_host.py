"""The host backend keeps the backend contract with real memory: pages really go back to the OS on unmap,
unmapped pages read zeros, errors are loud, and views outlive close() safely."""

from __future__ import annotations

import gc
import mmap
import threading
import weakref
from collections.abc import Iterator

import pytest

try:
    import torch
except ImportError:  # pragma: no cover - torch is in the test environment
    pytest.skip("torch is not installed", allow_module_level=True)

from kvcached.backends import HostBackend, MiB, make_backend
from kvcached.errors import BackendError, ConfigError

PAGE = 2 * MiB


@pytest.fixture
def backend() -> Iterator[HostBackend]:
    b = HostBackend(page_bytes=PAGE)
    b.reserve(32)
    yield b
    b.close()


def test_map_unmap_is_mapped(backend: HostBackend) -> None:
    assert backend.num_pages == 32 and backend.page_bytes == PAGE and backend.nbytes == 32 * PAGE
    assert backend.mapped_count == 0 and not backend.is_mapped(5)
    backend.map_page(5)
    backend.map_page(0)
    assert backend.is_mapped(5) and backend.is_mapped(0) and backend.mapped_count == 2
    assert backend.mapped_pages() == [0, 5]
    backend.unmap_page(5)
    assert not backend.is_mapped(5) and backend.mapped_count == 1
    backend.map_page(5)
    assert backend.mapped_count == 2


def test_errors(backend: HostBackend) -> None:
    backend.map_page(3)
    with pytest.raises(BackendError, match="page 3 is already mapped"):
        backend.map_page(3)
    with pytest.raises(BackendError, match="page 4 is not mapped"):
        backend.unmap_page(4)
    for bad in (32, -1, 1000):
        with pytest.raises(BackendError, match=rf"page index {bad} out of range \[0, 32\)"):
            backend.map_page(bad)
        with pytest.raises(BackendError, match="out of range"):
            backend.unmap_page(bad)
        with pytest.raises(BackendError, match="out of range"):
            backend.is_mapped(bad)
    with pytest.raises(BackendError, match="must be an int"):
        backend.map_page(True)
    with pytest.raises(BackendError, match="already reserved"):
        backend.reserve(4)
    assert backend.mapped_count == 1


def test_not_reserved_and_bad_config() -> None:
    b = HostBackend()
    with pytest.raises(BackendError, match="reserve"):
        b.map_page(0)
    with pytest.raises(BackendError, match="reserve"):
        b.tensor()
    with pytest.raises(BackendError, match="positive"):
        b.reserve(0)
    b.close()
    with pytest.raises(ConfigError, match=r"KVCACHED_PAGE_SIZE_MB.*multiple of the OS page size"):
        HostBackend(page_bytes=mmap.PAGESIZE + 1)
    with pytest.raises(ConfigError, match="KVCACHED_PAGE_SIZE_MB"):
        HostBackend(page_bytes=0)


def test_view_reads_and_writes_through_the_range(backend: HostBackend) -> None:
    t = backend.tensor()
    assert t.dtype == torch.uint8 and t.numel() == 32 * PAGE
    backend.map_page(2)
    backend.map_page(3)
    t[2 * PAGE : 3 * PAGE] = 7
    t[3 * PAGE : 4 * PAGE] = 9
    # A second, typed view sees the same bytes: it is the same memory, not a copy.
    f = backend.tensor(torch.int32)
    assert f.numel() == 32 * PAGE // 4
    assert int(f[2 * PAGE // 4]) == 0x07070707
    f[3 * PAGE // 4] = 0x01020304
    assert t[3 * PAGE : 3 * PAGE + 4].tolist() == [4, 3, 2, 1]
    # Bytes survive while mapped, whatever happens to the neighbours.
    backend.map_page(4)
    backend.unmap_page(4)
    assert bool((t[2 * PAGE : 3 * PAGE] == 7).all())


def test_unmapped_page_reads_zeros(backend: HostBackend) -> None:
    t = backend.tensor()
    backend.map_page(6)
    t[6 * PAGE : 7 * PAGE] = 42
    backend.unmap_page(6)
    assert int(t[6 * PAGE : 7 * PAGE].count_nonzero()) == 0
    backend.map_page(6)  # a re-mapped page starts from zeros too
    assert int(t[6 * PAGE : 7 * PAGE].count_nonzero()) == 0


def test_resident_memory_really_drops_after_unmap() -> None:
    with HostBackend(page_bytes=PAGE, num_pages=32) as b:
        t = b.tensor()
        base = b.resident_bytes()
        assert base < 2 * PAGE  # nothing written yet: MAP_NORESERVE + lazy faulting
        for i in range(16):
            b.map_page(i)
        t[: 16 * PAGE] = 1
        filled = b.resident_bytes()
        assert filled - base >= 16 * PAGE - PAGE // 2, (base, filled)
        assert filled <= 16 * PAGE + 2 * PAGE
        for i in range(8):
            b.unmap_page(i)
        half = b.resident_bytes()
        assert filled - half >= 8 * PAGE - PAGE // 2, (filled, half)
        for i in range(8, 16):
            b.unmap_page(i)
        empty = b.resident_bytes()
        assert filled - empty >= 16 * PAGE - PAGE // 2, (filled, empty)  # ~32 MiB back to the OS
        assert empty <= base + PAGE // 2
        assert b.mapped_count == 0
    assert b.resident_bytes() == 0


def test_view_keeps_range_alive_after_close() -> None:
    # Chosen semantics: close() returns every page and drops the backend's reference to the mmap; views keep
    # the mapping itself alive (no dangling pointer), read zeros, and the mapping goes with the last view.
    b = HostBackend(page_bytes=PAGE, num_pages=4)
    t = b.tensor()
    b.map_page(1)
    t[PAGE : 2 * PAGE] = 5
    mm_ref = weakref.ref(b._mm)
    b.close()
    assert b.closed and b.mapped_count == 0 and b.resident_bytes() == 0
    assert mm_ref() is not None  # the view holds it
    assert int(t.count_nonzero()) == 0  # the pages were returned: zeros, not the old bytes
    t[0:16] = 3  # writing is safe (memory faults back in until the view dies)
    assert int(t[:16].sum()) == 48
    with pytest.raises(BackendError, match="closed"):
        b.map_page(0)
    with pytest.raises(BackendError, match="closed"):
        b.tensor()
    b.close()  # idempotent
    del t
    gc.collect()
    assert mm_ref() is None  # last view gone: the mapping is released


def test_close_without_views_frees_at_once() -> None:
    b = HostBackend(page_bytes=PAGE, num_pages=4)
    b.map_page(0)
    mm_ref = weakref.ref(b._mm)
    b.close()
    assert mm_ref() is None
    b.close()


def test_concurrent_map_unmap_keeps_counts_exact() -> None:
    with HostBackend(page_bytes=PAGE, num_pages=64) as b:
        errors: list[BaseException] = []

        def work(lo: int) -> None:
            try:
                for _ in range(50):
                    for i in range(lo, lo + 16):
                        b.map_page(i)
                    for i in range(lo, lo + 16):
                        b.unmap_page(i)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k * 16,)) for k in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors and b.mapped_count == 0


def test_make_backend() -> None:
    b = make_backend("host", page_bytes=PAGE, num_pages=2)
    assert isinstance(b, HostBackend)
    b.close()
    with pytest.raises(ConfigError, match="unknown"):
        make_backend("tpu")
    if not torch.cuda.is_available():
        auto = make_backend("auto", device=0, num_pages=1)
        assert isinstance(auto, HostBackend)
        auto.close()
        with pytest.raises(ConfigError, match=r"needs a CUDA GPU: none is visible \(CUDA_VISIBLE_DEVICES="):
            make_backend("cuda")


# --- checking mode: an access to an unmapped page is detected, not backed by zeros ------------


def test_checking_mode_names_the_unmapped_page_before_any_access() -> None:
    from kvcached.backends.host import UnmappedAccessError

    with HostBackend(page_bytes=PAGE, num_pages=4, checking=True) as b:
        b.map_page(1)
        view = b.tensor()
        view[PAGE : PAGE + 8] = 7  # a mapped page: read and written as always
        b.check_access(PAGE, PAGE)
        assert b.unmapped_in(0, 3 * PAGE) == [0, 2]
        with pytest.raises(UnmappedAccessError, match=r"unmapped page 2 at bytes .* \(store job 5\)") as info:
            b.check_access(PAGE, 2 * PAGE, "store job 5")
        assert info.value.page == 2
        b.unmap_page(1)
        with pytest.raises(UnmappedAccessError, match="page 1"):
            b.check_access(PAGE, 8)
        # Recorded, then let through as an unchecked backend would: zeros.
        b.expose(1)
        assert int(view[PAGE : PAGE + 8].sum()) == 0
        view[PAGE : PAGE + 8] = 9  # written while unmapped ...
        b.map_page(1)
        assert int(view[PAGE : PAGE + 8].sum()) == 0  # ... a map still starts from zeros
    assert int(view[:16].sum()) == 0  # after close every view reads zeros, as unchecked


_FAULT = """
import sys
from kvcached.backends import HostBackend
b = HostBackend(page_bytes=2 << 20, num_pages=2, checking={checking})
b.map_page(0); b.map_page(1); view = b.tensor(); view[(2 << 20) + 3] = 5; b.unmap_page(1)
print("read", int(view[(2 << 20) + 3]), flush=True)
"""


@pytest.mark.parametrize("checking", [False, True])
def test_an_unchecked_access_to_an_unmapped_page_faults_in_checking_mode(checking: bool) -> None:
    import signal
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FAULT.format(checking=checking)], capture_output=True, text=True, timeout=120
    )
    if checking:  # detected: the process dies on the access instead of reading zeros
        assert proc.returncode == -signal.SIGSEGV and "read" not in proc.stdout
    else:  # the unchecked backend: fresh zero memory, silently (what checking mode exists for)
        assert proc.returncode == 0 and proc.stdout.strip() == "read 0"
