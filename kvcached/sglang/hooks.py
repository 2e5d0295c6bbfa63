"""Every change kvcached makes to SGLang, declared once and installed through SGLang's own hooks.

SGLang has a plugin interface (``sglang/srt/plugins``): a general plugin runs in every SGLang
process and registers hooks with ``HookRegistry``. kvcached uses only that: ``PATCHES`` lists each
target with the SGLang function it relies on, ``check`` refuses in one line an SGLang that moved
one (before anything is changed), and ``install`` registers the hooks and applies them.
"""

from __future__ import annotations

import dataclasses
import logging
import pkgutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar, Final

from ..engine.releases import Releases
from ..engine.targets import Target, present
from ..errors import ConfigError
from ..ledger.events import JobKind
from .boundary import refusing
from .engine import ENGINE_ATTR, SglangConfig, SglangEngine, engine_of

log = logging.getLogger("sglang.kvcached")

# The SGLang releases every target below was read in and tested on, oldest first
# (scripts/compat.sh runs tests/sglang_engine on each).
KNOWN: Final = ("0.5.20", "0.5.21", "0.5.22", "0.5.23")
SGLANG: Final = Releases("SGLang", KNOWN)


class Patch(Target, frozen=True, kw_only=True):
    """A target of SGLang's (``kvcached.engine.targets.Target``) with one attribute: wrapped
    AROUND, or REPLACEd where it is a class (``owner`` None), through SGLang's ``HookRegistry``."""

    RELEASES: ClassVar[Releases] = SGLANG

    since: str = SGLANG.oldest

    @property
    def target(self) -> str:
        (target,) = self.targets()
        return target

    @property
    def attr(self) -> str:
        (attr,) = self.attrs
        return attr


_POOL = "sglang.srt.mem_cache.memory_pool"
_L2 = "sglang.srt.mem_cache.l2_transfer"
_SCHEDULER = "sglang.srt.managers.scheduler"
_TOKEN = "sglang.srt.mem_cache.allocator.token"
_PAGED = "sglang.srt.mem_cache.allocator.paged"
_CHECKER = "sglang.srt.managers.scheduler_components.invariant_checker"

PATCHES: Final = (
    Patch(
        module=_POOL,
        owner="MHATokenToKVPool",
        attrs=("_create_buffers_normal",),
        why="allocates the per-layer K and V tensors (torch.zeros); kvcached's are views of its page range",
    ),
    Patch(
        module=_POOL,
        owner="MLATokenToKVPool",
        attrs=("_create_buffers",),
        why="allocates the per-layer latent tensors of MLA (kv_buffer, torch.zeros); kvcached's are views of its range",
    ),
    Patch(
        module=_L2,
        owner="L2TransferEngine",
        attrs=("submit_device_to_host",),
        why="HiCacheController.start_writing's one D->H copy submission; its TransferCompletion.finish_event "
        "is the ack",
    ),
    Patch(
        module=_L2,
        owner="L2TransferEngine",
        attrs=("submit_host_to_device",),
        why="HiCacheController.start_loading's one H->D copy submission",
    ),
    Patch(
        module=_SCHEDULER,
        owner="Scheduler",
        attrs=("get_next_batch_to_run",),
        why="one scheduler step; it starts by draining HiCache's acks (_process_hicache_events)",
    ),
    Patch(
        module=_CHECKER,
        owner="SchedulerInvariantChecker",
        attrs=("_check_all_pools",),
        why="Scheduler.on_idle's leak check (total == available + evictable + ...); under a limit or a budget "
        "available_size is what may be mapped, so the check gets every free slot, as SGLang gives it for "
        "its sharded allocators (aggregate_free_size)",
    ),
    Patch(
        module="prometheus_client.multiprocess",
        owner="MultiProcessCollector",
        attrs=("collect",),
        why="SGLang's /metrics (--enable-metrics) is a registry around one MultiProcessCollector "
        "(add_prometheus_middleware); kvcached's series join what it collects, in the HTTP server",
    ),
    Patch(
        module=_TOKEN,
        owner=None,
        attrs=("TokenToKVPoolAllocator",),
        why="KVCacheConfigurator._build_token_to_kv_pool_allocator builds it for page_size 1",
    ),
    Patch(
        module=_PAGED,
        owner=None,
        attrs=("PagedTokenToKVPoolAllocator",),
        why="KVCacheConfigurator._build_token_to_kv_pool_allocator builds it for page_size > 1 (unless the platform "
        "names its own: get_paged_allocator_cls, refused at the first step)",
    ),
)

# What kvcached calls in SGLang without patching it (checked as the patches are).
_TREE = "sglang.srt.mem_cache.base_prefix_cache"
CALLED: Final = (
    Patch(
        module=_TREE,
        owner="BasePrefixCache",
        attrs=("evict",),
        why="a kvctl limit evicts the tree's cached nodes over it (LRU first)",
    ),
    Patch(module=_TREE, owner=None, attrs=("EvictParams",), why="evict's argument (num_tokens)"),
)


def check(*, strict: bool = False) -> str | None:
    """Refuse, in one line, an SGLang older than the oldest tested (or, ``strict``, any untested
    one) or one that lacks a target of its release (nothing is changed before); the warning to
    log for an untested release that has them all, else None."""
    return _check(_version(), strict=strict)


def _check(version: str, *, strict: bool) -> str | None:
    untested = SGLANG.check(version, strict=strict) if version != _UNKNOWN else None
    present((*PATCHES, *CALLED), version, lambda row, target: _refusal(version, row, target))
    return untested


def _refusal(version: str, row: Patch, target: str) -> ConfigError:
    return ConfigError(
        f"kvcached cannot run under SGLang {version}: {target} is missing (known for SGLang {row.range}); "
        f"known to work: SGLang {', '.join(KNOWN)}"
    )


_UNKNOWN: Final = "(unknown version)"


def _version() -> str:
    try:
        from .engine import sglang_version

        return sglang_version()
    except Exception:
        return _UNKNOWN


# --- the hooks ------------------------------------------------------------------------------

_config: SglangConfig | None = None


def _engine_for(pool: Any) -> SglangEngine:
    global _served
    assert _config is not None
    if _served is not None and _served.config is _config and not _served.closed:
        # One engine a scheduler process: its journal, its socket, its steps. A second pool is a
        # hybrid model's (SWAKVPool's two sub-pools) or a draft model's, which kvcached does not
        # take yet; refused before a second service could fight the first for its socket.
        raise ConfigError(
            f"kvcached under SGLang: this model builds a second KV pool ({type(pool).__name__} beside "
            f"{type(_served.pool).__name__}: a sliding-window, hybrid or draft model), which kvcached does not support "
            "yet; disable kvcached (ENABLE_KVCACHED=0) for this model"
        )
    engine = SglangEngine(pool, _config)
    setattr(pool, ENGINE_ATTR, engine)
    if _enabled:
        _served = engine
    log.info("[kvcached] SGLang %s pool on elastic pages: %s", type(pool).__name__, engine.manager.state().describe())
    return engine


def _create_buffers(original: Any, pool: Any, *args: Any, **kwargs: Any) -> Any:
    if _config is None:
        return original(pool, *args, **kwargs)
    with refusing():
        engine = _engine_for(pool)
    rows = pool.size + pool.page_size
    pool.k_buffer, pool.v_buffer = engine.buffers(pool.store_dtype, rows, (pool.head_num, pool.head_dim))
    return None


def _create_latent_buffers(original: Any, pool: Any, *args: Any, **kwargs: Any) -> Any:
    if _config is None:
        return original(pool, *args, **kwargs)
    with refusing():
        engine = _engine_for(pool)
    pool.kv_buffer = engine.region_views(pool.store_dtype, pool.size + pool.page_size, (1, pool.kv_cache_dim))
    return None


def _submit(kind: JobKind) -> Any:
    def hook(original: Any, l2: Any, transfers: Any, *args: Any, **kwargs: Any) -> Any:
        completion = original(l2, transfers, *args, **kwargs)
        for t in transfers:
            engine = engine_of(t.device_pool)
            if engine is not None:
                return engine.bridge.submitted(kind, transfers, completion)
        return completion

    return hook


def _check_pools(original: Any, checker: Any, stats: Any, *args: Any, **kwargs: Any) -> Any:
    allocator = getattr(checker, "token_to_kv_pool_allocator", None)
    engine = engine_of(allocator)
    if engine is not None:
        stats = dataclasses.replace(stats, full_available_size=engine.free_slots())
    return original(checker, stats, *args, **kwargs)


def _collect(original: Any, collector: Any, *args: Any, **kwargs: Any) -> Any:
    from . import metrics

    return [*original(collector, *args, **kwargs), *metrics.families(SGLANG)]


def _step(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    engine = engine_of(allocator)
    if engine is not None:
        if not engine.allocator_checked:
            with refusing():
                _check_allocator(allocator)
            engine.allocator_checked = True
        engine.bridge.hold_frees = bool(getattr(scheduler, "enable_overlap", False))
        control = engine.control
        if control is not None and control.evict_cached is None:
            tree = getattr(scheduler, "tree_cache", None)
            if tree is not None:
                control.evict_cached = _evictor(tree)
        engine.bridge.step()
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        if engine is not None:
            engine.bridge.step_done()


def _check_allocator(allocator: Any) -> None:
    """A pool on kvcached pages must be allocated from by kvcached: SGLang's own allocator would
    hand out slots on pages never mapped (a platform may name its own paged allocator class)."""
    from .allocator import KvcachedPagedAllocator, KvcachedTokenAllocator

    if not isinstance(allocator, (KvcachedTokenAllocator, KvcachedPagedAllocator)):
        raise ConfigError(
            f"kvcached under SGLang: the scheduler allocates with {type(allocator).__qualname__}, not kvcached's "
            "allocator (a platform's own paged allocator?); disable kvcached for this server"
        )


def _evictor(tree: Any) -> Any:
    """Evict up to n tokens of ``tree``'s device cache, as SGLang evicts when it needs slots."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    def evict(n: int) -> int:
        return int(tree.evict(EvictParams(num_tokens=n)).num_tokens_evicted)

    return evict


def install(*, strict: bool = False) -> None:
    """Register and apply the AROUND hooks of this SGLang's release (idempotent); they act on
    kvcached's pools only. An untested release is said once, in one line.

    NOTE: a general plugin, named in the ``sglang.srt.plugins`` entry-point group, runs in every
    SGLang process (the scheduler subprocess's ``run_scheduler_process`` calls ``load_plugins``
    first). It registers hooks with ``HookRegistry``: AROUND a function, or REPLACE of a class,
    which ``_propagate_patch`` also rebinds where a module imported it by name.

    NOTE: every AROUND hook looks up the kvcached engine of the object it is called on
    (``engine.engine_of``) and, finding none, calls SGLang's function as it is: pools built while
    kvcached is not enabled stay SGLang's."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    global _installed
    if _installed:
        return
    version = _version()
    untested = _check(version, strict=strict)
    if untested is not None:
        log.warning("[kvcached] %s", untested)
    # The rows of this release whose targets are there (the table's own checker, as ``_check``).
    rows = [row for row, _ in present(PATCHES, version, lambda row, target: _refusal(version, row, target))]
    around = {
        "_create_buffers_normal": _create_buffers,
        "_create_buffers": _create_latent_buffers,
        "submit_device_to_host": _submit(JobKind.STORE),
        "submit_host_to_device": _submit(JobKind.LOAD),
        "get_next_batch_to_run": _step,
        "_check_all_pools": _check_pools,
        "collect": _collect,
    }
    before = {p.target: pkgutil.resolve_name(p.target) for p in rows if p.owner is not None}
    for p in rows:
        if p.owner is not None:
            HookRegistry.register(p.target, around[p.attr], HookType.AROUND)
    HookRegistry.apply_hooks()
    # apply_hooks logs a target it fails to patch and goes on; kvcached must not half-install.
    missed = [t for t, fn in before.items() if pkgutil.resolve_name(t) is fn]
    if missed:
        raise ConfigError(f"kvcached under SGLang: SGLang's HookRegistry did not apply {', '.join(missed)}")
    _installed = True


_installed = False
_enabled = False  # enable() ran: a server's process, one engine (pools_on_kvcached's tests build several)
_served: SglangEngine | None = None


def enable(config: SglangConfig) -> None:
    """kvcached under every KV pool this process builds from now on (a server's plugin).

    NOTE: the class replacement (the allocator) is registered only here, which a server's plugin
    calls when kvcached is asked for."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .allocator import KvcachedPagedAllocator, KvcachedTokenAllocator

    global _config, _enabled
    install(strict=config.strict_versions)
    _config = config
    _enabled = True
    HookRegistry.register(f"{_TOKEN}.TokenToKVPoolAllocator", KvcachedTokenAllocator, HookType.REPLACE)
    HookRegistry.register(f"{_PAGED}.PagedTokenToKVPoolAllocator", KvcachedPagedAllocator, HookType.REPLACE)
    HookRegistry.apply_hooks()


@contextmanager
def pools_on_kvcached(config: SglangConfig) -> Iterator[None]:
    """KV pools built inside the block are on kvcached pages (tests build their allocator)."""
    global _config
    install()
    saved, _config = _config, config
    try:
        yield
    finally:
        _config = saved
