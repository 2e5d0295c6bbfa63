"""The engine a served vLLM engine core runs: built from ``Settings`` right after its scheduler.

``Scheduler.__init__`` (the patch table's "kvcached under the scheduler") builds vLLM's KV cache
manager, block pool and scheduler-side connector; its replacement runs it, then ``build`` puts
kvcached under them, as the scenarios and benchmarks do (``engine.assemble``), with what only a
server has: the manager's backends are ``DecisionBackend`` objects, whose decisions ride each
step to the workers that own the KV memory (``step_sender``); the ledger service runs in every
engine (a live socket for ``kvctl`` with a replica of the ledger, the flight recorder, and with
``KVCACHED_LEDGER_JOURNAL`` a journal); ``kvctl`` steers the engine through its ``LiveControl``.
The engine core then logs one line saying kvcached is active, with what, and what it changed in
vLLM.
"""

from __future__ import annotations

import atexit
import functools
import logging
from collections.abc import Callable
from typing import Any

from ...engine.config import core_fields
from ...errors import KvcachedError
from ...ledger.compiled import compiled_status
from ...page_size import mib
from ...service.config import service_config
from ...service.live import default_socket_path
from ...settings import Settings
from .. import patches
from ..kv_layout import plan_page
from . import control, ranks, step_sender
from .engine import Engine, EngineConfig, assemble, page_cost_of

log = logging.getLogger("vllm.kvcached")


def build(scheduler: Any, settings: Settings) -> Engine:
    """kvcached under a served engine core's freshly built ``scheduler``."""
    kind = "host" if patches.on_cpu() else "cuda"  # what each worker's device.type gives (kv_memory.allocate)
    plan, page = plan_page(
        scheduler.kv_cache_config, settings.page_bytes, backend=kind, page_set=settings.page_bytes_set
    )
    if page.chosen:  # once, here: every worker chose the same page from the same inputs
        log.info("[kvcached] %s", page.describe())
    # The workers own the KV memory; the scheduler's decisions reach them with each step.
    backends, page_log = step_sender.decision_backends(scheduler, plan, kind=kind)
    geometry = plan.geometry
    # Each data-parallel rank is an engine core of its own (vLLM's EngineCoreProc per rank): its
    # own journal and socket; the flight recorder's dumps and the budget's shares go by pid.
    index, count = ranks.engine_index(scheduler), ranks.data_parallel_size(scheduler)
    socket = ranks.rank_path(default_socket_path(), index, count)
    journal = ranks.rank_path(settings.journal, index, count) if settings.journal else None
    page_cost = page_cost_of(geometry, backends)
    floor = control.request_floor(scheduler, geometry.blocks_per_page, page_cost, settings.min_kv_cache_bytes)
    config = EngineConfig(
        **core_fields(settings, service_config(settings, socket, journal)),
        max_cached_blocks=settings.max_cached_blocks(int(scheduler.cache_config.block_size)),
        join_floor_pages=floor[0],
    )
    engine = assemble(scheduler, geometry, backends, config, page_log=page_log)
    slow = compiled_status()
    info = control.engine_info(
        scheduler,
        socket=socket,
        policy=settings.policy.value,
        vllm=patches.vllm_version(),
        budget=settings.budget,
        backend=backends[0].kind,
        page_size=geometry.page_bytes,
        page_cost=engine.page_bytes,
        compiled=slow is None,
    )
    live = control.LiveControl(engine, info, engine.page_bytes, floor)
    engine.control = live
    if engine.service is not None:
        engine.service.service.control = live
    atexit.register(engine.close_logged)
    if slow is not None:
        log.warning("%s", slow)
    backend = backends[0]
    flight = f"last {settings.flight_recorder_events} events" if settings.flight_recorder_events else "off"
    on_objects = sum(len(p.attrs) for p in patches.engine_patches())
    log.info(
        "[kvcached] active: backend=%s, page=%s MiB%s, policy=%s, journal=%s, offloading bridge=%s, "
        "kvctl socket=%s, flight recorder=%s, %s, budget=%s, KV: %s; vLLM changed: %s, and %d attributes "
        "of this engine's scheduler, connector and block pool (kvcached/vllm/patches.py)",
        backend.kind + (" (shared)" if getattr(backend, "shared", None) else ""),
        mib(geometry.page_bytes),
        " (chosen for the block)" if page.chosen else "",
        settings.policy.value,
        journal or "off",
        "on" if engine.offloading else "off",
        socket,
        flight,
        "; ".join((engine.describe_reserve(), *settings.notes, *vllm_sizing(scheduler.cache_config))),
        settings.budget or "none",
        plan.describe(),
        ", ".join(patches.installed()) or "nothing process-wide",
        on_objects,
    )
    return engine


def vllm_sizing(cache_config: Any) -> list[str]:
    """What kvcached set of vLLM's KV sizing, for the active line (``api_server.startup.take_kv_sizing``)."""
    if not hasattr(cache_config, "enable_extensible_kv_cache"):
        return []  # before vLLM 0.34: nothing to say
    state = "off" if not cache_config.enable_extensible_kv_cache else "ON (kvcached refuses its allocate=)"
    util = getattr(cache_config, "gpu_memory_utilization", None)
    return [f"vLLM's extensible KV cache {state}, gpu_memory_utilization={util}"]


def wrap_scheduler_init(original: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    """``Scheduler.__init__``: vLLM's, then kvcached's engine under it (refused in one line)."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            build(self, settings)
        except KvcachedError as e:
            log.error("[kvcached] refused: %s", str(e).removeprefix("kvcached: "))
            raise

    return __init__
