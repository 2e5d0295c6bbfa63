"""The KV cache manager and page allocator on the host backend: real memory that comes and goes."""

from __future__ import annotations

import os

import pytest
import torch

from kvcached.backends.base import PageStillMappedError
from kvcached.backends.host import HostBackend
from kvcached.errors import BackendError, ConfigError
from kvcached.kv_cache_manager import BlockStateError, KVCacheManager, KVGeometry, Layout, OutOfBlocksError
from kvcached.ledger import recorder as recorder_module
from kvcached.ledger.events import (
    BuildBoundary,
    Event,
    JobBuilt,
    JobKind,
    JobReported,
    RequestFinished,
    WindowHold,
    WindowRelease,
)
from kvcached.ledger.journal import read_journal
from kvcached.page_allocator import OutOfPagesError
from kvcached.settings import Settings

KiB = 1024
PAGE = 64 * KiB
STORE = JobKind.STORE


def geometry(num_blocks: int = 32, block: int = 16 * KiB, **kw: object) -> KVGeometry:
    return KVGeometry(num_blocks=num_blocks, block_bytes=block, page_bytes=PAGE, **kw)  # type: ignore[arg-type]


@pytest.fixture
def make():
    made: list[KVCacheManager] = []

    def _make(policy: str = "ledger", geo: KVGeometry | None = None, **kw: int) -> KVCacheManager:
        g = geo or geometry()
        m = KVCacheManager.standalone(g, HostBackend(page_bytes=PAGE), policy=policy, **kw)
        made.append(m)
        return m

    yield _make
    for m in made:
        m.backend.close()


def write(m: KVCacheManager, block: int, value: int) -> None:
    m.block_view(block).fill_(value)


def consistent(m: KVCacheManager) -> None:
    """The manager's incremental counts agree with its block and page state."""
    assert m._partial_free == sum(len(v) for v in m._free_in.values())
    assert m.num_allocated == sum(m._allocated) == sum(m._used)
    for page, free in m._free_in.items():
        assert len(free) + m._used[page] == len(m._blocks_of(page))


def record(m: KVCacheManager, event: Event) -> None:
    """Record an event from outside the manager as the bridge does: emit, then let pages go."""
    m.recorder.emit(event)
    m.drain_releasable()


def late_copy(m: KVCacheManager, block: int) -> torch.Tensor:
    """What a store job that runs now copies out of ``block`` (a real copy of real bytes)."""
    return m.block_view(block).clone()


# --- geometry and allocation --------------------------------------------------------------------


def test_geometry_blocks_never_straddle_pages() -> None:
    g = KVGeometry(num_blocks=10, block_bytes=24 * KiB, page_bytes=PAGE)
    assert g.blocks_per_page == 2  # 48 KiB used, 16 KiB of each page left unused
    assert g.num_pages == 5


def test_block_larger_than_page_names_the_setting() -> None:
    # 128 KiB: whole 4 KiB OS pages on the host, whole 2 MiB granules on CUDA
    hint = r"KVCACHED_PAGE_SIZE_MB to at least 0\.125 on the host backend \(2 on CUDA\)$"
    with pytest.raises(ConfigError, match=hint):
        KVGeometry(num_blocks=4, block_bytes=PAGE * 2, page_bytes=PAGE)


def test_alloc_prefers_partly_used_pages_and_maps_lazily(make) -> None:
    m = make()
    assert m.backend.mapped_count == 0
    a = m.alloc(3)
    assert {m.page_of(b) for b in a} == {0}
    assert m.backend.mapped_count == 1
    b = m.alloc(2)  # one more on page 0, then page 1
    assert [m.page_of(x) for x in b] == [0, 1]
    m.free(a)
    c = m.alloc(1)
    assert m.page_of(c[0]) == 0  # the low, partly used page, not a new one
    assert m.num_allocated == 3
    consistent(m)


def test_alloc_is_all_or_nothing_and_available_size_is_exact(make) -> None:
    m = make()
    assert m.available_size() == 32
    got = m.alloc(30)
    assert m.available_size() == 2
    with pytest.raises(OutOfBlocksError, match="asked for 3 KV blocks, 2 available"):
        m.alloc(3)
    assert m.num_allocated == 30
    consistent(m)
    m.free(got)
    assert m.available_size() == 32
    consistent(m)


def test_double_free_and_foreign_block_are_refused(make) -> None:
    m = make()
    (b,) = m.alloc(1)
    m.free([b])
    with pytest.raises(BlockStateError, match="freed but not allocated"):
        m.free([b])
    with pytest.raises(BlockStateError, match="outside pool"):
        m.free([99])
    assert m.recorder.ledger.violations == []


def test_every_step_is_a_ledger_event(make, tmp_path) -> None:
    path = str(tmp_path / "j.kvj")
    m = KVCacheManager.standalone(geometry(), HostBackend(page_bytes=PAGE), journal_path=path)
    try:
        blocks = m.alloc(5)
        m.free(blocks)
        record(m, BuildBoundary(0))
        m.recorder.close()
    finally:
        m.backend.close()
    names = [type(e).__name__ for e in read_journal(path).events]
    assert names == [
        *("PageMapped", "PageMapped", "BlockAlloc", "BlockFree"),
        *("BuildBoundary", "PageUnmapped", "PageUnmapped"),
    ]


# --- pins keep bytes; legacy loses them ----------------------------------------------------------


@pytest.mark.parametrize("policy", ["legacy", "ledger"])
def test_late_copy_of_a_freed_block(make, policy: str) -> None:
    """Case 1 of kvcached PR #598 on real memory: the store is submitted after the request freed its blocks."""
    m = make(policy)
    ledger = m.recorder.ledger
    blocks = m.alloc(4)  # exactly one page
    for b in blocks:
        write(m, b, 0x5A)
    record(m, JobBuilt(0, STORE, 0, (tuple(blocks),), 1))
    record(m, BuildBoundary(0))
    m.free(blocks)  # the one-token request finished
    copied = [late_copy(m, b) for b in blocks]  # the worker submits the store now
    record(m, BuildBoundary(1))
    record(m, JobReported(0, 1))
    intact = all(bool((c == 0x5A).all()) for c in copied)
    if policy == "legacy":
        assert not intact  # the page went back to the OS: the copy read zeros
        assert [v.invariant for v in ledger.violations] == ["I1"]
    else:
        assert intact
        assert ledger.violations == []
        assert m.backend.mapped_count == 0  # and the page went once the job was reported


def test_pins_keep_the_page_until_the_ledger_releases_it(make) -> None:
    m = make("ledger")
    blocks = m.alloc(4)
    for b in blocks:
        write(m, b, 7)
    record(m, JobBuilt(1, STORE, 0, (tuple(blocks),), 2))  # two workers
    m.free(blocks)
    for step in range(3):
        record(m, BuildBoundary(step))  # grace long over
        assert m.backend.is_mapped(0)
        assert bool((late_copy(m, blocks[0]) == 7).all())
    record(m, JobReported(1, 1))
    assert m.backend.is_mapped(0)  # one worker still copying
    record(m, JobReported(1, 1))
    assert not m.backend.is_mapped(0)
    assert bool((late_copy(m, blocks[0]) == 0).all())


def test_unmapped_memory_really_goes_back(make) -> None:
    g = KVGeometry(num_blocks=64, block_bytes=512 * KiB, page_bytes=2 << 20)  # 16 pages of 2 MiB
    m = KVCacheManager.standalone(g, HostBackend(page_bytes=2 << 20))
    try:
        blocks = m.alloc(64)
        for b in blocks:
            write(m, b, 1)
        full = m.backend.resident_bytes()
        m.free(blocks)
        record(m, BuildBoundary(0))
        assert full >= 32 << 20
        assert m.backend.resident_bytes() <= full - (30 << 20)
    finally:
        m.backend.close()


def test_window_holds_keep_freed_window_blocks(make) -> None:
    m = make("ledger")
    blocks = m.alloc(4)
    record(m, WindowHold(3, 0, tuple(blocks)))
    m.free(blocks)
    for step in range(5):
        record(m, BuildBoundary(step))
    assert m.backend.is_mapped(0)
    record(m, RequestFinished(3))
    assert not m.backend.is_mapped(0)


# --- reserved pages ------------------------------------------------------------------------------


def test_min_and_max_reserved_pages(make) -> None:
    m = make("ledger", min_reserved=2, max_reserved=3)
    blocks = m.alloc(1)
    assert m.state().reserved == 2 and m.backend.mapped_count == 3
    more = m.alloc(16)  # pages 0-4 in use
    m.free(blocks + more)
    record(m, BuildBoundary(0))
    st = m.state()
    assert st.in_use == 0 and st.reserved == 3  # kept up to max_reserved for reuse


# --- memory limit and shrink ---------------------------------------------------------------------


def test_lowering_the_limit_waits_on_pins_and_finishes_as_they_drop(make) -> None:
    m = make("ledger", max_reserved=8)
    rec = m.recorder
    a = m.alloc(8)  # pages 0, 1
    b = m.alloc(8)  # pages 2, 3
    record(m, JobBuilt(5, STORE, 0, (tuple(b),), 1))
    m.free(b)
    record(m, BuildBoundary(0))  # pages 2, 3 reserved, still pinned by job 5
    st = m.set_limit_pages(2)
    assert st.shrink_pending
    assert st.waiting_on == {"reserved, pinned by job": 2}
    assert "pinned by job" in st.reason
    # Pages the pins keep mapped anyway stay in service, but nothing new is mapped.
    assert m.available_size() == 8
    with pytest.raises(OutOfBlocksError, match="shrink pending"):
        m.alloc(9)
    assert m.backend.mapped_count == 4
    record(m, JobReported(5, 1))
    st = m.state()
    assert not st.shrink_pending and st.mapped == 2
    assert rec.ledger.violations == []
    m.free(a)


def test_pinned_pages_stay_in_service_during_a_shrink_p2(make) -> None:
    """P2: window holds of a preempted request pin pages over the limit. Refusing those pages
    would deadlock (the request lets go only when it runs again); reusing them does not."""
    m = make("ledger", max_reserved=8)
    rec = m.recorder
    a = m.alloc(16)  # pages 0-3
    record(m, WindowHold(7, 0, tuple(a[8:])))  # request 7's window blocks on pages 2, 3
    m.free(a)  # request 7 preempted: all its blocks freed
    record(m, BuildBoundary(0))
    st = m.set_limit_pages(1)
    assert st.shrink_pending and st.waiting_on == {"reserved, pinned by window": 2}
    assert m.state().mapped == 2  # pages 0, 1 went at once
    again = m.alloc(8)  # the request resumes on the pinned pages: no new map
    assert {m.page_of(b) for b in again} == {2, 3} and m.backend.mapped_count == 2
    record(m, WindowRelease(7))  # matching dropped its old block lists
    m.free(again)
    record(m, BuildBoundary(1))
    assert m.state().mapped == 1 and not m.state().shrink_pending
    assert rec.ledger.violations == []


def test_shrink_below_pages_in_use_completes_when_blocks_are_freed(make) -> None:
    m = make("ledger", max_reserved=8)
    a = m.alloc(16)
    st = m.set_limit_pages(1)
    assert st.waiting_on == {"in use (blocks allocated)": 3}
    m.free(a)
    record(m, BuildBoundary(0))
    assert m.state().mapped == 1 and not m.state().shrink_pending


def test_raising_the_limit_lets_the_pool_grow_again(make) -> None:
    m = make("ledger")
    m.set_limit_pages(2)
    m.alloc(8)
    with pytest.raises(OutOfBlocksError):
        m.alloc(1)
    m.set_limit_pages(8)
    assert len(m.alloc(8)) == 8
    assert m.backend.mapped_count == 4


# --- failures -------------------------------------------------------------------------------------


def test_a_failing_map_is_rolled_back_with_nothing_leaked(make, monkeypatch) -> None:
    m = make("ledger")
    kept = m.alloc(3)  # page 0, one block free on it
    real = HostBackend._map

    def fail_on_page_1(self: HostBackend, index: int) -> None:
        if index == 1:
            raise BackendError("injected: map failed")
        real(self, index)

    monkeypatch.setattr(HostBackend, "_map", fail_on_page_1)
    before = (m.available_size(), m.num_allocated, m.backend.mapped_count, m.recorder.ledger.index)
    with pytest.raises(BackendError, match="injected"):
        m.alloc(3)  # takes page 0's last block, then needs page 1
    assert (m.available_size(), m.num_allocated, m.backend.mapped_count, m.recorder.ledger.index) == before
    consistent(m)
    monkeypatch.setattr(HostBackend, "_map", real)
    assert len(m.alloc(3)) == 3  # and the pool still works
    consistent(m)
    m.free(kept)
    assert m.recorder.ledger.violations == []


def test_out_of_pages_is_a_clear_error(make) -> None:
    m = make("ledger")
    m.set_limit_pages(0)
    with pytest.raises(OutOfBlocksError, match="0 available"):
        m.alloc(1)
    with pytest.raises(OutOfPagesError):
        m.allocator.alloc_page()


# --- per-layer layout -----------------------------------------------------------------------------


def test_per_layer_layout_maps_a_page_in_every_layer(make) -> None:
    g = geometry(num_blocks=8, layout=Layout.PER_LAYER, num_layers=3)
    m = make("ledger", geo=g)
    (b,) = m.alloc(1)
    assert m.backend.mapped_count == 3  # page 0 of each layer's region
    for layer in range(3):
        m.block_view(b, layer).fill_(layer + 1)
    assert [int(m.block_view(b, layer)[0]) for layer in range(3)] == [1, 2, 3]
    m.free([b])
    record(m, BuildBoundary(0))
    assert m.backend.mapped_count == 0


def test_per_layer_map_failure_rolls_back_every_layer(make, monkeypatch) -> None:
    g = geometry(num_blocks=8, layout=Layout.PER_LAYER, num_layers=3)
    m = make("ledger", geo=g)
    real = HostBackend._map

    def fail_on_slot_4(self: HostBackend, index: int) -> None:
        if index == 4:  # page 0 of the third layer's region
            raise BackendError("injected")
        real(self, index)

    monkeypatch.setattr(HostBackend, "_map", fail_on_slot_4)
    with pytest.raises(BackendError):
        m.alloc(1)  # region 0 and 1 mapped, region 2 (slot 4) fails
    assert m.backend.mapped_count == 0
    assert m.recorder.ledger.mapped_pages == 0  # nothing recorded
    assert m.recorder.ledger.index == 0


def fail_unmap(monkeypatch, fail: dict[int, type[BackendError]]) -> None:
    """HostBackend's unmap of slot i fails once with ``fail[i]``: a PageStillMappedError before
    touching the slot, any other error after the memory is gone (as CUDA's cuMemRelease can)."""
    real = HostBackend._unmap

    def unmap(self: HostBackend, index: int) -> None:
        error = fail.pop(index, None)
        if error is PageStillMappedError:
            raise error(f"injected: slot {index} still mapped")
        real(self, index)
        if error is not None:
            raise error(f"injected: slot {index} returned, clean-up failed")

    monkeypatch.setattr(HostBackend, "_unmap", unmap)


def emptied_page(m: KVCacheManager) -> None:
    """Page 0 had blocks and was emptied in build 0: building it lets the page go."""
    m.free(m.alloc(2))


def test_a_page_still_mapped_after_a_failed_unmap_is_unmapped_at_the_next_drain(make, monkeypatch, caplog) -> None:
    m = make("ledger")
    emptied_page(m)
    fail_unmap(monkeypatch, {0: PageStillMappedError})
    record(m, BuildBoundary(0))  # grace ends: page 0 may go, and its unmap fails
    assert m.backend.is_mapped(0) and m.allocator.mapped == 1 and m.recorder.ledger.mapped_pages == 1
    assert [r.getMessage() for r in caplog.records if "stays mapped" in r.getMessage()] != []
    record(m, BuildBoundary(1))  # nothing new is releasable: the retry alone unmaps it
    assert not m.backend.is_mapped(0) and m.allocator.mapped == 0 and m.recorder.ledger.mapped_pages == 0
    assert m.recorder.ledger.violations == []
    assert len(m.alloc(2)) == 2 and m.backend.is_mapped(0)  # and it maps again


def test_a_page_whose_unmap_returned_its_memory_and_then_failed_counts_as_unmapped(make, monkeypatch) -> None:
    m = make("ledger")
    emptied_page(m)
    fail_unmap(monkeypatch, {0: BackendError})
    record(m, BuildBoundary(0))
    # Counted as mapped, it would be handed out with no memory behind it.
    assert not m.backend.is_mapped(0) and m.allocator.mapped == 0 and m.recorder.ledger.mapped_pages == 0
    (b,) = m.alloc(1)  # mapped afresh before a block goes on it
    assert m.backend.is_mapped(0)
    write(m, b, 7)
    assert int(m.block_view(b)[0]) == 7
    assert m.recorder.ledger.violations == []


def test_per_layer_unmap_failure_leaves_the_page_whole(make, monkeypatch) -> None:
    g = geometry(num_blocks=8, layout=Layout.PER_LAYER, num_layers=3)
    m = make("ledger", geo=g)
    emptied_page(m)
    fail_unmap(monkeypatch, {4: PageStillMappedError})  # page 0 of the third layer's region
    record(m, BuildBoundary(0))  # regions 0 and 1 unmapped, region 2 fails: they are mapped back
    assert m.backend.mapped_count == 3 and m.recorder.ledger.mapped_pages == 1
    record(m, BuildBoundary(1))
    assert m.backend.mapped_count == 0 and m.recorder.ledger.mapped_pages == 0


# --- settings ---------------------------------------------------------------------------------------


def test_settings_from_env_and_their_errors() -> None:
    s = Settings.from_env(
        {
            "KVCACHED_PAGE_SIZE_MB": "4",
            "KVCACHED_MAX_RESERVED_PAGES": "0",
            "KVCACHED_MIN_RESERVED_PAGES": "0",
            "KVCACHED_LEDGER_POLICY": "legacy",
        }
    )
    assert (s.page_bytes, s.max_reserved_pages, s.policy.value) == (4 << 20, 0, "legacy")
    with pytest.raises(ConfigError, match="KVCACHED_LEDGER_POLICY"):
        Settings.from_env({"KVCACHED_LEDGER_POLICY": "yolo"})
    with pytest.raises(ConfigError, match="KVCACHED_MIN_RESERVED_PAGES=7 is above"):
        Settings.from_env({"KVCACHED_MIN_RESERVED_PAGES": "7", "KVCACHED_MAX_RESERVED_PAGES": "2"})
    with pytest.raises(ConfigError, match="ENABLE_KVCACHED"):
        Settings.from_env({"ENABLE_KVCACHED": "maybe"})
    assert Settings.from_env(dict(os.environ)).page_bytes > 0


# --- how the allocator learns which pages may go --------------------------------------------------


@pytest.mark.skipif(
    not recorder_module.__file__.endswith(".py"),
    reason="replaces emit on a Recorder instance, which a mypyc-compiled Recorder forbids; the pure run covers it",
)
def test_no_event_is_emitted_from_inside_another(make) -> None:
    """The recorder calls nobody back: a PageUnmapped comes after the emit that let its page go
    has returned (it used to be emitted by a recorder listener, from inside that emit)."""
    m = make("ledger", max_reserved=1)
    depth, nested = [0], []
    real_emit = m.recorder.emit

    def emit(event: Event) -> None:
        if depth[0]:
            nested.append(type(event).__name__)
        depth[0] += 1
        try:
            real_emit(event)
        finally:
            depth[0] -= 1

    m.recorder.emit = emit  # type: ignore[method-assign]
    a = m.alloc(12)  # pages 0-2
    record(m, JobBuilt(0, STORE, 0, (tuple(a[:8]),), 1))
    m.free(a)
    record(m, BuildBoundary(0))  # grace ends: page 2 may go (pages 0, 1 wait on job 0)
    record(m, JobReported(0, 1))  # pages 0, 1 may go
    m.set_limit_pages(0)
    assert m.backend.mapped_count == 0 and m.recorder.ledger.unmaps == 3
    assert nested == []


def test_an_event_lets_pages_go_only_when_the_allocator_drains(make) -> None:
    m = make("ledger")
    m.free(m.alloc(4))
    m.recorder.emit(BuildBoundary(0))  # grace ends: the ledger lets page 0 go ...
    assert m.backend.is_mapped(0)  # ... but the recorder told nobody
    m.drain_releasable()
    assert not m.backend.is_mapped(0)


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_pages_emptied_by_one_free_go_in_the_order_they_emptied(make, tmp_path, order) -> None:
    """Under legacy the free itself lets the pages go; each is given back as it joins the reserve.
    (Draining page by page would lose the second page: the first drain takes both.)"""
    path = str(tmp_path / "j.kvj")
    m = KVCacheManager.standalone(geometry(), HostBackend(page_bytes=PAGE), policy="legacy", journal_path=path)
    try:
        a = m.alloc(8)  # pages 0, 1
        m.free([b for p in order for b in a if m.page_of(b) == p])
        assert m.backend.mapped_count == 0
        m.recorder.close()
    finally:
        m.backend.close()
    unmapped = [e.page for e in read_journal(path).events if type(e).__name__ == "PageUnmapped"]
    assert unmapped == list(order)


def test_a_page_mapped_by_a_failed_alloc_goes_back(make, monkeypatch) -> None:
    """The rolled-back page was mapped and recorded, then nothing went on it: it may go, though
    no event was recorded between its map and its return."""
    m = make("ledger")
    kept = m.alloc(4)  # page 0, full
    real = HostBackend._map

    def fail_on_page_2(self: HostBackend, index: int) -> None:
        if index == 2:
            raise BackendError("injected: map failed")
        real(self, index)

    monkeypatch.setattr(HostBackend, "_map", fail_on_page_2)
    with pytest.raises(BackendError, match="injected"):
        m.alloc(8)  # page 1 maps, page 2 fails: page 1 comes back empty
    assert m.backend.mapped_count == 1 and m.recorder.ledger.mapped_pages == 1
    assert m.state().reserved == 0
    consistent(m)
    m.free(kept)
    assert m.recorder.ledger.violations == []


def test_a_reserve_topped_up_by_an_alloc_is_given_back_by_a_lowered_limit(make) -> None:
    m = make("ledger", min_reserved=2, max_reserved=2)
    m.alloc(1)  # page 0 in use, pages 1, 2 reserved (mapped, nothing recorded on them since)
    st = m.set_limit_pages(1)
    assert st.mapped == 1 and not st.shrink_pending
