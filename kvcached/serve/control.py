"""Steering a served engine while it runs: its memory limit, its memory report, one lock.

``kvctl limit`` and ``kvctl status`` reach the engine core through the ledger service's live
socket, whose loop runs in its own thread; kvcached's allocator, manager and page-aware pool
are the scheduler's and are not thread-safe. So every scheduler method that can touch them
(vLLM's ``Scheduler.schedule``, ``update_from_output``, ``finish_requests``,
``reset_prefix_cache`` and the few others in ``LOCKED``) runs under one reentrant lock per
engine, and a limit or a memory report takes the same lock: it is applied between two
scheduler calls, never inside one, and an idle engine (whose busy loop waits for requests and
calls nothing) is steered at once. The lock costs an uncontended acquire and release per call,
about 0.1 us, against a scheduler step of milliseconds; the model's forward pass runs outside
it, so a limit never waits for a step's GPU work.

A failure inside a locked call asks the ledger service to save its flight recorder before the
exception goes on to vLLM, which stops the engine core: the events that led to the error are
on disk when the process dies.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from ..service.messages import EngineInfo, MemoryStatus

log = logging.getLogger("vllm.kvcached")

# The scheduler's methods that read or change KV state (vLLM v1, 0.32 and 0.33:
# vllm/v1/core/sched/scheduler.py; AsyncScheduler overrides some of them).
LOCKED: Final = (
    "schedule",
    "update_from_output",
    "finish_requests",
    "add_request",
    "reset_prefix_cache",
    "reset_connector_cache",
    "set_pause_state",
    "update_draft_token_ids",
    "make_stats",
    "get_kv_cache_usage",
)


def lock_scheduler_methods(cls: type, state_attr: str) -> None:
    """Wraps ``cls``'s own methods in ``LOCKED`` to run under ``getattr(self, state_attr).lock``
    (instances without that state, such as vLLM's schedulers in a process without kvcached's
    engine, run as shipped)."""
    for name in LOCKED:
        original = cls.__dict__.get(name)
        if original is None or getattr(original, "_kvcached_locked", False):
            continue

        def make(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
            @functools.wraps(fn)
            def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
                state = self.__dict__.get(state_attr)
                if state is None:
                    return fn(self, *args, **kwargs)
                with state.lock:
                    try:
                        return fn(self, *args, **kwargs)
                    except Exception as exc:
                        state.failed(name, exc)
                        raise

            locked._kvcached_locked = True  # type: ignore[attr-defined]
            return locked

        setattr(cls, name, make(original, name))


def close_open_build(engine: Any) -> None:
    """Without a connector: close the open build if freed pages wait for it, and let them go
    (see ``close_builds_without_connector``); the caller holds the engine's lock."""
    from ..ledger.events import BuildBoundary

    ledger = engine.recorder.ledger
    if ledger.pending_grace_pages():
        engine.recorder.emit(BuildBoundary(ledger.build))
        if engine.manager is not None:
            engine.manager.drain_releasable()


def close_builds_without_connector(scheduler: Any, engine: Any, lock: threading.RLock) -> None:
    """An engine without a KV connector has no builds (``build_connector_meta`` is never
    called), so the ledger's grace pins, which end at the next build, would keep every freed
    page mapped for good. With no connector there is no copy that a build could have captured a
    freed block for; each scheduler call that frees blocks therefore closes the open build
    itself, under the engine's lock, as the bridge's ``build_connector_meta`` does with one."""

    def closing(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            with lock:
                try:
                    return fn(*args, **kwargs)
                finally:
                    close_open_build(engine)

        return call

    for name in ("schedule", "update_from_output", "finish_requests", "reset_prefix_cache"):
        original = getattr(scheduler, name, None)
        if original is not None:
            setattr(scheduler, name, closing(original))


class ServedEngine:
    """The ``EngineControl`` of one engine core (``service.messages``): its identity, its memory
    and its limit, each under the engine's lock."""

    def __init__(self, engine: Any, info: EngineInfo, page_cost: int) -> None:
        self.engine = engine
        self.lock = threading.RLock()
        self._info = info
        self.page_cost = page_cost  # bytes one page costs: one page in every region of every backend
        self._failed = False
        self.wake: Callable[[], None] | None = None  # steps an idle engine core (set by the plugin)

    def info(self) -> EngineInfo:
        return self._info

    def memory(self) -> MemoryStatus:
        with self.lock:
            return self._status()

    def set_limit(self, size: int | None) -> MemoryStatus:
        """Sets the memory limit to ``size`` bytes, rounded down to whole pages (None: no limit),
        and shrinks as far as pins allow now; the rest follows as they are released."""
        with self.lock:  # Engine.set_limit_bytes refuses a negative size and an engine without the pool
            self.engine.set_limit_bytes(size)
            if not getattr(self.engine, "offloading", True):
                close_open_build(self.engine)
            status = self._status()
        if self.wake is not None:
            self.wake()  # pages emptied now may wait for a build, decisions for a step
        return status

    def _status(self) -> MemoryStatus:
        manager = self.engine.manager
        if manager is None:
            return MemoryStatus(
                page_bytes=self.page_cost, num_pages=0, mapped_pages=0, in_use_pages=0, reserved_pages=0,
                limit_pages=0, shrink_pending=False, waiting_on={}, reason="vLLM's own block pool",
            )
        st = manager.state()
        return MemoryStatus(
            page_bytes=self.page_cost, num_pages=manager.allocator.num_pages, mapped_pages=st.mapped,
            in_use_pages=st.in_use, reserved_pages=st.reserved, limit_pages=st.limit,
            shrink_pending=st.shrink_pending, waiting_on=dict(st.waiting_on), reason=st.reason,
        )

    def failed(self, where: str, exc: BaseException) -> None:
        """A scheduler call raised: save the flight recorder once (the engine core stops next)."""
        if self._failed:
            return
        self._failed = True
        service = getattr(self.engine, "service", None)
        if service is None:
            return
        path = service.service.request_dump(f"engine error in {where}: {type(exc).__name__}")
        if path is not None:
            log.error("[kvcached] the scheduler failed in %s; the flight recorder is saved to %s", where, path)


def engine_info(
    scheduler: Any, *, socket: str, policy: str, versions: dict[str, str], budget: str | None
) -> EngineInfo:
    """Who this engine core is, for ``kvctl list`` and the metrics' labels."""
    model = "?"
    with_model = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
    if with_model is not None:
        model = str(getattr(with_model, "served_model_name", None) or getattr(with_model, "model", "?"))
    port = os.environ.get("KVCACHED_SERVE_PORT")
    api = os.environ.get("KVCACHED_SERVE_PID")
    return EngineInfo(
        model=model, pid=os.getpid(), api_pid=int(api) if api and api.isdigit() else None,
        port=int(port) if port and port.isdigit() else None, socket=socket, started_unix=time.time(),
        policy=policy, vllm=versions.get("vllm", "?"), kvcached=versions.get("kvcached", "?"), budget=budget,
    )


def serve_port(argv: list[str]) -> int | None:
    """The HTTP port of a ``vllm serve`` (or ``-m vllm.entrypoints.openai.api_server``) command
    line: ``--port N``/``--port=N``, else vLLM's default 8000; None for any other program."""
    serving = any(a == "serve" or a.endswith("api_server") or a.endswith("api_server.py") for a in argv[:4])
    for i, a in enumerate(argv):
        if a == "--port" and i + 1 < len(argv) and argv[i + 1].isdigit():
            return int(argv[i + 1])
        if a.startswith("--port=") and a[7:].isdigit():
            return int(a[7:])
    return 8000 if serving else None
