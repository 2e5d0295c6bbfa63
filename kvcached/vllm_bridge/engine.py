"""One engine assembly: backends -> manager -> bridge -> page-aware pool, over one recorder.

kvcached under a vLLM scheduler is always the same chain: a ledger (with its journal: written
inline, or by the ledger service's thread), a KV cache manager over the backends that hold the
worker's KV memory, the bridge on the scheduler's connector and block pool, and the page-aware
pool. The vLLM plugin, the real-vLLM scenarios (whose journals are the golden traces) and the
benchmarks all build it with ``assemble``, so a change to the chain (its order, which events
each part records, who drains the ledger's releasable pages) is made once. What differs
between them is data: ``EngineConfig``. The order matters twice: the bridge is installed
before the page-aware pool, whose prefix-cache reset wraps the bridge's (a reset is recorded
before the frees it causes), and the manager before the bridge, which drains it after each
event. vLLM is only imported when a scheduler's parts are looked at, as in the bridge.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from ..backends.base import Backend
from ..errors import ConfigError
from ..kv_cache_manager import KVCacheManager, KVGeometry
from ..ledger.events import Header, Policy
from ..ledger.journal import JournalWriter
from ..ledger.ledger import Ledger
from ..ledger.recorder import Recorder
from ..service.ledger_service import BackgroundService, ServiceConfig
from .block_pool import PageAwarePool, install_page_aware_pool
from .bridge import Bridge, install_bridge

KVCACHED_VERSION = "0.1.0.dev0"


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What differs between the engines kvcached builds (the plugin's comes from ``Settings``)."""

    policy: Policy = Policy.LEDGER
    min_reserved_pages: int = 0
    max_reserved_pages: int = 0
    max_cached_blocks: int | None = None  # KVCACHED_MAX_CACHED_TOKENS in blocks; None: no cap
    # False: vLLM's own block pool and no manager, the bridge's events only (a benchmark's baseline).
    page_aware: bool = True
    # At most one journal. Inline: framed every 256 events on the scheduler's thread, so that
    # the same run gives the same bytes (the golden traces). Service: written by the ledger
    # service's thread, off the scheduler's path (a server).
    journal_path: str | None = None
    journal_service: ServiceConfig | None = None

    def __post_init__(self) -> None:
        if self.journal_path is not None and self.journal_service is not None:
            raise ConfigError("engine: a journal is written inline (journal_path) or by the service, not both")
        if self.min_reserved_pages < 0 or self.max_reserved_pages < 0:
            raise ConfigError(
                f"engine: reserved pages must be >= 0, got {self.min_reserved_pages}..{self.max_reserved_pages}"
            )
        if self.max_cached_blocks is not None and self.max_cached_blocks < 0:
            raise ConfigError(f"engine: max_cached_blocks must be >= 0, got {self.max_cached_blocks}")


class Engine:
    """What ``assemble`` built for one scheduler; ``close`` ends its journal (not the backends,
    which belong to whoever made them)."""

    def __init__(
        self,
        recorder: Recorder,
        *,
        manager: KVCacheManager | None,
        pool: PageAwarePool | None,
        bridge: Bridge,
        service: BackgroundService | None,
    ) -> None:
        self.recorder = recorder
        self.manager = manager
        self.pool = pool
        self.bridge = bridge
        self.service = service
        self._closed = False

    @property
    def ledger(self) -> Ledger:
        return self.recorder.ledger

    @property
    def offloading(self) -> bool:
        """Whether the bridge is on an OffloadingConnector (else it records resets only)."""
        return self.bridge.connector is not None

    def close(self) -> None:
        """Flush and close the journal, then stop the service; once. Raises what they raise."""
        if self._closed:
            return
        self._closed = True
        try:
            self.recorder.close()
        finally:
            if self.service is not None:
                self.service.close()


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def header_for(scheduler: Any, geometry: KVGeometry, policy: Policy) -> Header:
    """The journal header of an engine over ``scheduler``: one pool, its workers, the producers."""
    return Header(
        page_bytes=geometry.page_bytes,
        pools=(geometry.pool(),),
        workers=int(scheduler.vllm_config.parallel_config.world_size),
        policy=policy,
        producer={"vllm": _vllm_version(), "kvcached": KVCACHED_VERSION},
    )


def assemble(scheduler: Any, geometry: KVGeometry, backends: Sequence[Backend], config: EngineConfig) -> Engine:
    """Put kvcached under ``scheduler`` (before its first request) and return the parts.

    ``backends``: the primary range first, then one replica per further tensor-parallel rank
    that keeps its own copy (empty when ``config.page_aware`` is off). The scheduler's
    connector, if it has one, must be vLLM's OffloadingConnector.
    """
    if config.page_aware and not backends:
        raise ConfigError("engine: a page-aware pool needs at least one backend")
    header = header_for(scheduler, geometry, config.policy)
    service = None
    if config.journal_service is not None:
        service = BackgroundService.start(header, config.journal_service)
    try:
        if service is not None:
            recorder = Recorder(Ledger(header), sink=service.producer)
        elif config.journal_path is not None:
            recorder = Recorder(Ledger(header), JournalWriter.create(config.journal_path, header))
        else:
            recorder = Recorder(Ledger(header))
        try:
            manager = None
            if config.page_aware:
                manager = KVCacheManager(
                    geometry,
                    backends[0],
                    recorder,
                    replicas=backends[1:],
                    min_reserved=config.min_reserved_pages,
                    max_reserved=config.max_reserved_pages,
                )
            bridge = install_bridge(
                scheduler,
                recorder,
                drain=None if manager is None else manager.drain_releasable,
                offloading=getattr(scheduler, "connector", None) is not None,
            )
            pool = None
            if manager is not None:
                pool = install_page_aware_pool(scheduler, manager, max_cached_blocks=config.max_cached_blocks)
        except BaseException:
            recorder.close()
            raise
    except BaseException:
        if service is not None:
            service.close()
        raise
    return Engine(recorder, manager=manager, pool=pool, bridge=bridge, service=service)
