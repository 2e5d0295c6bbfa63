"""kvcached under one SGLang KV pool: its memory on elastic pages, its ledger, its journal.

SGLang's KV pool owns one tensor per layer's K and V, or per layer's latent (MLA), indexed by
token slot; kvcached puts those tensors on pages (``pool_geometry``). The same core serves vLLM:
``KVCacheManager`` chooses blocks and records every alloc and free, the ledger decides what may be
unmapped, the journal has the format ``kvreplay`` reads. What is SGLang's here is the geometry
(read from the pool's own fields) and the header's producer (``SglangEngine``).
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from ..backends import cuda_visible, make_backend
from ..backends.base import Backend
from ..budget import Budget
from ..engine.config import CoreConfig
from ..engine.control import floor
from ..errors import ConfigError
from ..kv_cache_manager import KVCacheManager, KVGeometry, Layout
from ..ledger.events import Header
from ..ledger.ledger import Ledger
from ..ledger.recorder import Recorder
from ..page_size import choose_page
from ..service.ledger_service import BackgroundService
from ..version import KVCACHED_VERSION
from .bridge import Bridge
from .control import SglangControl, engine_info

if TYPE_CHECKING:
    import torch

log = logging.getLogger("sglang.kvcached")

# What kvcached adds to an SGLang pool: its engine, found by the allocator and the hooks.
ENGINE_ATTR = "_kvcached_engine"


class SglangConfig(CoreConfig, frozen=True, kw_only=True):
    """The core's configuration and what only SGLang's pools are built with (tests choose; a
    server's comes from the settings, ``plugin.config_from``)."""

    page_bytes: int = 2 << 20
    # KVCACHED_PAGE_SIZE_MB was set: the page is taken as it is (or refused); else kvcached may
    # choose a page of whole blocks near it (``page_size.choose_page``: MLA's 576-wide latent).
    page_bytes_set: bool = True
    backend: str = "auto"  # kvcached.backends.make_backend: "cuda", "host" or "auto"
    # KVCACHED_MIN_KV_CACHE_MB: the least this engine yields down to on a shared budget, and what
    # it waits for when it starts on a full one (at least its padding page; Budget.join).
    min_kv_cache_bytes: int = 0
    # KVCACHED_STRICT_VERSIONS: refuse an SGLang release kvcached was not tested on (else: warn).
    strict_versions: bool = False


def sglang_version() -> str:
    from importlib.metadata import version

    return version("sglang")


def is_mla(pool: Any) -> bool:
    """Whether ``pool`` is an ``MLATokenToKVPool``: one latent (``kv_cache_dim`` wide) per token
    and layer, in one buffer per layer (``kv_buffer``), in place of K and V."""
    return hasattr(pool, "kv_lora_rank") and hasattr(pool, "kv_cache_dim")


def pool_geometry(pool: Any, page_bytes: int, *, backend: str = "host", page_set: bool = True) -> KVGeometry:
    """The geometry of SGLang pool ``pool`` (an ``MHATokenToKVPool`` or ``MLATokenToKVPool`` being
    built): one block per SGLang page, ``size // page_size + 1`` of them (page 0 is the padding
    page), one region per layer's K and per layer's V, or per layer's latent (MLA); the page is
    ``page_bytes`` or, unless ``page_set``, one of whole blocks on ``backend`` near it.

    NOTE: SGLang's ``MHATokenToKVPool`` owns one K and one V tensor per layer, indexed by token
    slot (``memory_pool.py``, ``_create_buffers_normal``); its ``MLATokenToKVPool`` (DeepSeek's
    MLA) one latent tensor per layer (``_create_buffers``). Its allocators hand out slot indices
    (``TokenToKVPoolAllocator`` at page_size 1, ``PagedTokenToKVPoolAllocator`` above, whole
    SGLang pages). kvcached puts those tensors on pages: a *block* is one SGLang page
    (``page_size`` slots, one slot at page_size 1), every layer's K, V or latent is a region of
    its own (the per-layer layout, ``Layout.PER_LAYER``), and logical page ``p`` is mapped in all
    regions at once."""
    page_size: int = pool.page_size
    rows = pool.size + page_size
    if is_mla(pool):
        if getattr(pool, "use_dsa", False):
            raise ConfigError("kvcached under SGLang: DeepSeek sparse attention's pools (DSA) are not supported yet")
        row_bytes = pool.kv_cache_dim * pool.store_dtype.itemsize
        regions = pool.layer_num
        what = f"{page_size} token(s) x {pool.kv_cache_dim} x {pool.store_dtype}"
    else:
        if pool.v_head_dim != pool.head_dim:
            raise ConfigError(
                f"kvcached under SGLang: K and V heads of different widths ({pool.head_dim}, {pool.v_head_dim}) "
                "are not supported yet"
            )
        if pool.kv_cache_layout not in ("nhd", None):
            raise ConfigError(
                f"kvcached under SGLang: KV cache layout {pool.kv_cache_layout!r} is not supported (nhd only)"
            )
        row_bytes = pool.head_num * pool.head_dim * pool.store_dtype.itemsize
        regions = 2 * pool.layer_num
        what = f"{page_size} token(s) x {pool.head_num} heads x {pool.head_dim} x {pool.store_dtype}"
    block_bytes = page_size * row_bytes
    # A region must be a plain array of slots for SGLang's kernels to index it, so a page holds
    # whole blocks and nothing else; no ``tokens``: the block-size hint is vLLM's flag.
    try:
        page_bytes = choose_page(block_bytes, backend=backend, page_bytes=page_bytes, page_set=page_set).page_bytes
    except ConfigError as e:
        said = str(e).removeprefix("kvcached: ").replace("a KV block takes", f"a KV block ({what}) takes", 1)
        raise ConfigError(f"kvcached under SGLang: {said}") from None
    return KVGeometry(
        # A partial last page (a size not a multiple of page_size) still has rows in SGLang's
        # tensors; SGLang never hands it out (``PagedTokenToKVPoolAllocator``: size // page_size pages).
        num_blocks=-(-rows // page_size),
        block_bytes=block_bytes,
        page_bytes=page_bytes,
        num_layers=regions,
        layout=Layout.PER_LAYER,
    )


class SglangEngine:
    """kvcached under one SGLang KV pool: backend, manager (with its ledger) and bridge."""

    def __init__(self, pool: Any, config: SglangConfig) -> None:
        self.closed = False
        self.config = config
        kind = config.backend.strip().lower()
        if kind == "auto":
            kind = "cuda" if cuda_visible() else "host"
        self.geometry = g = pool_geometry(pool, config.page_bytes, backend=kind, page_set=config.page_bytes_set)
        self.page_size: int = pool.page_size
        self.pool = pool  # the SGLang pool whose slots are this engine's blocks
        header = Header(
            page_bytes=g.page_bytes,
            pools=(g.pool(),),
            # Each SGLang tensor-parallel rank is a scheduler process with its own pool, so
            # its own engine and journal: one worker acknowledges each copy.
            workers=1,
            policy=config.policy,
            # The producer names SGLang and its version, so that a reader knows which engine wrote
            # a trace (``Header.producer``, which ``kvreplay show`` prints).
            producer={"sglang": sglang_version(), "kvcached": KVCACHED_VERSION},
            clock_base_unix=time.time() if config.clock else 0.0,
        )
        self.budget: Budget | None = None
        page_cost = g.page_bytes * g.regions
        # The pages it yields down to: the padding page at least, KVCACHED_MIN_KV_CACHE_MB's if more.
        self.floor_pages, floor_why = floor(
            1, "SGLang's padding slot 0 keeps its page", config.min_kv_cache_bytes, page_cost
        )
        reserve = config.reserve_pages(page_cost)
        self.service: BackgroundService | None = None
        # NOTE: opened in this order and closed in the reverse one (the journal and its service
        # first, then the pages, then the share of the budget), whether the engine is closed or
        # its start fails half-way: whatever was opened is closed.
        with ExitStack() as opening:
            if config.budget is not None:
                budget = Budget.open(config.budget, config.budget_bytes or None, directory=config.budget_dir)
                self.budget = budget
                opening.callback(budget.close)
                budget.join(self.floor_pages * page_cost, config.join_wait_s)
            self.backend: Backend = make_backend(config.backend, page_bytes=g.page_bytes)
            opening.callback(self.backend.close)
            if config.journal_service is not None:
                self.service = service = BackgroundService.start(header, config.journal_service)
                opening.callback(service.close)
                self.recorder = Recorder(Ledger(header), sink=service.producer)
            else:
                self.recorder = Recorder.for_header(header, journal_path=config.journal_path)
            opening.callback(self.recorder.close)
            self.manager = KVCacheManager(
                g,
                self.backend,
                self.recorder,
                min_reserved=reserve[0],
                max_reserved=reserve[1],
                placement=config.placement,
                budget=self.budget,
                # Short of the budget while serving, it asks for its floor's worth or a reserve's.
                ask_pages=max(self.floor_pages, reserve[1], 1),
            )
            # SGLang's padding page: padded tokens write into slot 0 (``TokenToKVPoolAllocator.clear``);
            # and a partial last page, which SGLang never hands out. Block 0 is taken at start and
            # never freed, so its page stays mapped.
            self.manager.take([0, *range(pool.size // self.page_size + 1, g.num_blocks)])
            self.manager.drain_releasable()  # the lease the count took, back to the budget
            self._closing = opening.pop_all()
        self.bridge = Bridge(self.recorder, self.manager, pool, self.page_size)
        self.control: SglangControl | None = None  # a served engine's (kvctl)
        self.allocator_checked = False  # hooks._step: the scheduler's allocator is kvcached's
        socket = config.journal_service.socket if config.journal_service is not None else None
        if self.service is not None and socket:
            info = engine_info(
                socket=socket,
                policy=config.policy.value,
                sglang=header.producer["sglang"],
                budget=config.budget,
                backend=self.backend.kind,
                page_size=g.page_bytes,
                page_cost=page_cost,
            )
            control = SglangControl(
                self.manager,
                self.budget,
                info,
                page_cost,
                self.page_size,
                floor_pages=self.floor_pages,
                floor_why=floor_why,
                page_ops=self.bridge.page_ops,
            )
            self.control = control
            self.service.service.control = control
            self.bridge.on_step = control.apply  # kvctl's limit, applied on the scheduler's thread

    @property
    def ledger(self) -> Any:
        return self.recorder.ledger

    def sglang_blocks(self) -> range:
        """The blocks SGLang's allocators hand out: its pages 1 to size // page_size."""
        return range(1, self.pool.size // self.page_size + 1)

    def reset(self) -> None:
        """``flush_cache``'s ``clear``: every block SGLang handed out is freed through the ledger,
        after the cache reset that orphans the copies in flight (``Bridge.cache_reset``)."""
        manager = self.manager
        held = [b for b in self.sglang_blocks() if manager.holds(b)]
        self.bridge.cache_reset()
        if held:
            manager.free(held)
        manager.drain_releasable()

    def available_blocks(self) -> int:
        """The allocators' ``available_size``, in blocks."""
        if not self.bridge.scheduling:
            # NOTE: counted outside a step (SGLang's stats and idle checks, on every turn of its
            # event loop, hundreds a second while idle): no allocation follows, so the budget's
            # room is read, not leased. Leased and given back at once, the room was taken and
            # returned some 800 times a second by an idle engine, and a neighbour counting in
            # between saw the budget full and reused its own cache rather than grow.
            return self.manager.available_unleased()
        return self.manager.available_size()

    def alloc_blocks(self, n: int) -> list[int] | None:
        """``n`` blocks for the allocators, or None (SGLang's answer when the pool is short)."""
        manager = self.manager
        try:
            if n > manager.available_size():
                return None
            return manager.alloc(n)
        finally:
            # Counting leased the shared budget's room (``PageAllocator.lease_short``). Within a
            # step, the step's other counts (the batch's admission) still stand on it, and the
            # step's end gives back what no alloc mapped; outside one, it goes back now.
            if not self.bridge.scheduling:
                manager.drain_releasable()

    def free_slots(self) -> int:
        """Slots not allocated, whatever the limit or the budget lets be mapped: what SGLang's
        accounting of its pool counts as free."""
        return (self.geometry.num_blocks - self.manager.num_allocated) * self.page_size

    def region_views(self, dtype: torch.dtype, rows: int, row_shape: tuple[int, ...]) -> list[Any]:
        """Each region's first ``rows`` slots on kvcached's range, as ``(rows, *row_shape)`` of ``dtype``."""
        g = self.geometry
        whole = self.backend.tensor()
        region = g.num_pages * g.page_bytes
        row_bytes = g.block_bytes // self.page_size
        return [
            whole[r * region : r * region + rows * row_bytes].view(dtype).view(rows, *row_shape)
            for r in range(g.num_layers)
        ]

    def buffers(self, dtype: torch.dtype, rows: int, row_shape: tuple[int, ...]) -> tuple[list[Any], list[Any]]:
        """Per-layer K and V tensors (MHA): region ``2l`` is layer ``l``'s K, region ``2l + 1`` its V."""
        views = self.region_views(dtype, rows, row_shape)
        return views[0::2], views[1::2]

    def close(self) -> None:
        """The journal (and the service), then the pages, then this engine's share of the
        budget; once. Each is closed even if one before it raises."""
        if self.closed:
            return
        self.closed = True
        self._closing.close()


def engine_of(obj: Any) -> SglangEngine | None:
    """The engine behind an SGLang pool, or behind an allocator or controller over one."""
    for candidate in (obj, getattr(obj, "_kvcache", None), getattr(obj, "mem_pool_device", None)):
        engine = getattr(candidate, ENGINE_ATTR, None) if candidate is not None else None
        if isinstance(engine, SglangEngine):
            return engine
    return None
