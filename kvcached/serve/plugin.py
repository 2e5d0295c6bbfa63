"""The vLLM plugin: with ``ENABLE_KVCACHED=1``, every vLLM process of a server uses kvcached.

vLLM calls ``register`` (entry point ``vllm.general_plugins``) in each of its processes before
it builds anything; without the variable it returns at once and vLLM runs exactly as shipped.
With it, three of vLLM's functions are wrapped in that process, vLLM's files staying untouched:

* ``EngineArgs.create_engine_config`` (API server): the startup checks, so that an unsupported
  setup is refused with one line before an engine process starts;
* ``allocate_kv_cache`` (worker): the KV cache tensors become views of kvcached pages
  (``kv_memory``), with the shapes and strides vLLM's own allocation gives them;
* ``Scheduler.__init__`` (engine core): the scheduler's block pool becomes page-aware, backed by
  a kvcached manager over the worker's range, the OffloadingConnector gets the bridge (all of
  it built by ``vllm_bridge.engine.assemble``, as the scenarios and benchmarks build it), and
  the ledger service runs in every engine: a live socket for ``kvctl`` with a replica of the
  ledger, the flight recorder, and with ``KVCACHED_LEDGER_JOURNAL`` a journal. The scheduler's
  KV methods run under the engine's lock (``control``), so that ``kvctl limit`` applies between
  two of them. ``Scheduler.shutdown`` closes the service. The engine core logs one line saying
  kvcached is active and with what.

In the API server, kvcached's series join vLLM's ``/metrics`` (``metrics``), and kvcached's
loggers write through vLLM's handlers, so its lines look like vLLM's and obey
``VLLM_LOGGING_LEVEL``.

The settings are upstream kvcached's variables (``settings.Settings``); a malformed one is
refused like an unsupported setup.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import sys
from typing import Any

from ..errors import ConfigError, KvcachedError
from ..ledger.compiled import compiled_status
from ..service.ledger_service import ServiceConfig
from ..service.live import default_socket_path
from ..settings import Settings
from ..version import KVCACHED_VERSION
from ..vllm_bridge.engine import EngineConfig, assemble
from . import checks, control, kv_memory, step_channel

log = logging.getLogger("vllm.kvcached")  # a child of vLLM's logger: vLLM's format and handlers
_ALLOC_USERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.attn_utils")

_installed: Settings | None = None


def register() -> None:
    """vLLM's entry point; idempotent, and a no-op unless ``ENABLE_KVCACHED`` is set."""
    global _installed
    try:
        if not Settings.enabled_in() or _installed is not None:
            return
        settings = Settings.from_env()
    except ConfigError as e:
        _refuse(str(e))
    kv_memory.engine_key()  # made here, in the first process, so that every child inherits it
    # The first process is vllm serve's API server: its pid and port go to every engine core it
    # starts (inherited), for kvctl list and for its /metrics to find them.
    os.environ.setdefault("KVCACHED_SERVE_PID", str(os.getpid()))
    port = control.serve_port(sys.argv)
    if port is not None:
        os.environ.setdefault("KVCACHED_SERVE_PORT", str(port))
    _route_logs()
    _wrap_config(settings)
    _wrap_allocation(settings)
    _wrap_scheduler(settings)
    _installed = settings


def _route_logs() -> None:
    """kvcached's own loggers (``kvcached.*``: the ledger service, the live view) write through
    vLLM's handlers and level; without this their lines reach stderr through Python's
    last-resort handler, unformatted and ignoring ``VLLM_LOGGING_LEVEL``."""
    ours, theirs = logging.getLogger("kvcached"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _bare(e: BaseException) -> str:
    return str(e).removeprefix("kvcached: ")


def _refuse(message: str) -> Any:
    line = message if message.startswith("kvcached") else f"kvcached: {message}"
    # SystemExit prints its message on stderr: that is the one line (a log line as well was two).
    raise SystemExit(line)


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


# --- API server: the startup checks --------------------------------------------------------------


def _wrap_config(settings: Settings) -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "_kvcached", False):
        return

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = original(self, *args, **kwargs)
        try:
            checks.check_config(config, settings, version=_vllm_version(), on_cpu=_on_cpu())
        except ConfigError as e:
            _refuse(str(e))
        from . import metrics  # the API server's process: its /metrics gets kvcached's series

        metrics.install(os.getpid())
        return config

    create_engine_config._kvcached = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign,unused-ignore]


# --- worker: KV cache tensors on kvcached pages --------------------------------------------------


def _wrap_allocation(settings: Settings) -> None:
    import vllm.v1.worker.utils as worker_utils

    original = worker_utils.allocate_kv_cache
    if getattr(original, "_kvcached", False):
        return

    @functools.wraps(original)
    def allocate_kv_cache(
        kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: list[int] | None = None
    ) -> Any:
        try:
            return kv_memory.allocate(
                kv_cache_config,
                device,
                layout,
                kernel_block_sizes,
                page_bytes=settings.page_bytes,
                backend=settings.backend,
            )
        except KvcachedError as e:
            log.error("[kvcached] refused: %s", _bare(e))
            raise

    allocate_kv_cache._kvcached = True  # type: ignore[attr-defined]
    worker_utils.allocate_kv_cache = allocate_kv_cache
    # Modules that imported the name before this ran hold the original: rebind theirs too.
    for name in _ALLOC_USERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "allocate_kv_cache", None) is original:
            module.allocate_kv_cache = allocate_kv_cache  # type: ignore[attr-defined]


# --- engine core: page-aware pool, bridge, journal -------------------------------------------------


def service_config(settings: Settings, socket: str) -> ServiceConfig:
    """The ledger service of a served engine (the bridge benchmark measures the same one)."""
    return ServiceConfig(
        journal=settings.journal,
        replica=True,
        snapshot_every=1_000_000 if settings.journal else 0,
        flush_interval=0.005,
        socket=socket,
        flight_events=settings.flight_recorder_events,
        dump_dir=settings.dump_dir,
    )


class EngineState:
    """What kvcached holds in the engine-core process for one scheduler."""

    def __init__(self, scheduler: Any, settings: Settings) -> None:
        cfg = scheduler.kv_cache_config
        plan = kv_memory.plan(cfg, settings.page_bytes)
        # The workers own the KV memory; the scheduler's decisions reach them with each step.
        backends = step_channel.attach_scheduler(scheduler, plan, kind="host" if _on_cpu() else "cuda")
        backend = backends[0]
        geometry = plan.geometry
        block_size = int(scheduler.cache_config.block_size)
        cap = settings.max_cached_blocks(block_size)
        # The service runs in every engine (live socket, replica, flight recorder); the journal,
        # if any, is written by its thread, off the scheduler's path, within ``flush_interval`` of
        # each event: vLLM kills the engine core at shutdown without calling the scheduler's
        # shutdown, so nothing may wait for a final flush.
        socket = default_socket_path()
        service = service_config(settings, socket)
        config = EngineConfig(
            policy=settings.policy,
            min_reserved_pages=settings.min_reserved_pages,
            max_reserved_pages=settings.max_reserved_pages,
            max_cached_blocks=cap,
            journal_service=service,
            max_reserved_bytes=settings.max_reserved_bytes,
            budget=settings.budget,
            budget_bytes=settings.budget_bytes,
        )
        self.engine = assemble(scheduler, geometry, backends, config)
        self.recorder = self.engine.recorder
        self.manager = self.engine.manager
        self.pool = self.engine.pool
        self.bridge = self.engine.bridge
        self._closed = False
        info = control.engine_info(
            scheduler, socket=socket, policy=settings.policy.value,
            versions={"vllm": _vllm_version(), "kvcached": KVCACHED_VERSION}, budget=settings.budget,
        )
        self.control = control.ServedEngine(self.engine, info, self.engine.page_bytes)
        self.lock = self.control.lock
        self.failed = self.control.failed
        if not self.engine.offloading and self.engine.manager is not None:
            control.close_builds_without_connector(scheduler, self.engine, self.lock)
        if self.engine.service is not None:
            self.engine.service.service.control = self.control
        atexit.register(self.close)
        slow = compiled_status()
        if slow is not None:
            log.warning("%s", slow)
        flight = f"last {settings.flight_recorder_events} events" if settings.flight_recorder_events else "off"
        log.info(
            "[kvcached] active: backend=%s, page=%g MiB, policy=%s, journal=%s, offloading bridge=%s, "
            "kvctl socket=%s, flight recorder=%s, %s, budget=%s, KV: %s",
            backend.kind + (" (shared)" if getattr(backend, "shared", None) else ""),
            geometry.page_bytes / (1 << 20),
            settings.policy.value,
            settings.journal or "off",
            "on" if self.engine.offloading else "off",
            socket,
            flight,
            self.engine.describe_reserve(),
            settings.budget or "none",
            plan.describe(),
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.engine.close()
        except KvcachedError as e:  # losing the trace must not fail the shutdown
            log.error("[kvcached] journal: %s", e)


def _wrap_scheduler(settings: Settings) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    original_init = Scheduler.__init__
    if getattr(original_init, "_kvcached", False):
        return
    original_shutdown = Scheduler.shutdown

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            self._kvcached = EngineState(self, settings)
        except KvcachedError as e:
            log.error("[kvcached] refused: %s", _bare(e))
            raise

    @functools.wraps(original_shutdown)
    def shutdown(self: Any) -> None:
        try:
            original_shutdown(self)
        finally:
            state = getattr(self, "_kvcached", None)
            if state is not None:
                state.close()

    __init__._kvcached = True  # type: ignore[attr-defined]
    Scheduler.__init__ = __init__  # type: ignore[method-assign,unused-ignore]
    Scheduler.shutdown = shutdown  # type: ignore[method-assign,unused-ignore]
    step_channel.install_engine_core()  # an idle engine core sends pending decisions; kvctl can wake it
    control.lock_scheduler_methods(Scheduler, "_kvcached")
    try:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    except ImportError:  # a vLLM without async scheduling
        return
    control.lock_scheduler_methods(AsyncScheduler, "_kvcached")
