"""One wrapper around each of the scheduler's KV calls: the engine's lock, then the drain.

kvcached's allocator, manager and page-aware pool belong to the scheduler's thread and are not
thread-safe, while ``kvctl limit`` and ``kvctl status`` arrive on the ledger service's thread.
So each scheduler method that can touch them is shadowed with a wrapper that holds the engine's
lock while vLLM's method runs (``install``). Before the lock is let go the wrapper finishes the
call's kvcached side, in one place (``_wrap``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .. import patches
from ..step_channel import ATTR

if TYPE_CHECKING:
    from ...kv_cache_manager import KVCacheManager
    from ..step_channel import PageLog
    from .bridge import Bridge


class Engine(Protocol):
    """What the wrappers need of ``engine.Engine`` (named so, without importing it: that module
    imports this one)."""

    lock: threading.RLock
    bridge: Bridge
    manager: KVCacheManager | None
    page_log: PageLog | None

    @property
    def offloading(self) -> bool: ...

    def drain(self) -> None: ...

    def step_ended(self) -> None: ...

    def batch_applied(self, message: tuple[int, ...] | None) -> None: ...

    def failed(self, where: str, exc: BaseException) -> None: ...

    def close_logged(self) -> None: ...


# The calls after which, without a connector, the open build is closed: the ones that free blocks.
# Without a KV connector nothing calls ``build_connector_meta``, so the ledger's grace pins (which
# end at the next build) would keep every freed page mapped for good. With no connector there is
# no copy a build could have captured a freed block for, so the bridge closes the open build at
# the end of each call that frees blocks (``Bridge.close_build``).
_FREEING = frozenset(("schedule", "update_from_output", "finish_requests", "reset_prefix_cache"))


def install(scheduler: Any, engine: Engine) -> None:
    """Shadow ``scheduler``'s KV calls (those it has) with the engine's wrappers.

    NOTE: each scheduler method that can touch kvcached's state (``patches.SCHEDULER_CALLS``:
    vLLM's ``Scheduler.schedule``, ``update_from_output``, ``finish_requests``,
    ``reset_prefix_cache`` and the others there) is shadowed on the one scheduler instance. Its
    wrapper holds the engine's reentrant lock while vLLM's method runs, and a limit takes the
    same lock. So a limit is applied between two scheduler calls, never inside one, and an idle
    engine (whose busy loop waits for requests and calls nothing) is steered at once.

    NOTE: the lock costs an uncontended acquire and release per call, against a scheduler step
    of milliseconds. The model's forward pass runs outside it, so a limit never waits for a
    step's GPU work."""
    patch = patches.by_name("the engine's lock and drain around each KV call")
    replacements = {
        name: _wrap(engine, name, getattr(scheduler, name))
        for name in patch.attrs
        if callable(getattr(scheduler, name, None))
    }
    patches.shadow(scheduler, patch, replacements)


def _wrap(engine: Engine, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper of scheduler method ``name``: under the engine's lock, vLLM's ``fn``, then the
    call's kvcached side.

    NOTE: before the lock is let go the wrapper finishes the call's kvcached side, in one place.

    * ``schedule`` attaches the page decisions made since the last step to its
      ``SchedulerOutput`` (``step_channel``). So a decision ``kvctl limit`` makes on another
      thread goes out whole, in this batch or the next.
    * Without a KV connector, the bridge closes the open build after each call that frees
      blocks (``Bridge.close_build``; why at ``_FREEING``).
    * ``update_from_output`` gets the model output of a step whose batch every worker applied
      before its forward pass. The budget bytes of that batch's unmaps go back first
      (``Engine.batch_applied``).
    * The allocator drains the pages the call's events released, once, as vLLM's own
      ``Scheduler.schedule`` drains ``BlockPool.take_events`` once a step.
    * ``schedule`` ends a step: the page ops decided since the last one are counted
      (``Engine.step_ended``, ``kvcached.engine.steps``).
    * ``shutdown`` closes the engine (journal, ledger service, budget) after vLLM's
      (``close_logged``).

    NOTE: a failure inside a call asks the ledger service to save its flight recorder before the
    exception goes on to vLLM, which stops the engine core. So the events that led to the error
    are on disk when the process dies."""
    lock = engine.lock
    bridge = engine.bridge
    closes = name in _FREEING and not engine.offloading and engine.manager is not None
    scheduled = name == "schedule"
    page_log = engine.page_log if scheduled else None
    applied = name == "update_from_output" and engine.page_log is not None
    shutdown = name == "shutdown"

    def call(*args: Any, **kwargs: Any) -> Any:
        with lock:
            try:
                if applied:  # vLLM's update_from_output(scheduler_output, model_runner_output)
                    step = args[0] if args else kwargs.get("scheduler_output")
                    engine.batch_applied(getattr(step, ATTR, None))
                try:
                    out = fn(*args, **kwargs)
                finally:
                    if closes:
                        bridge.close_build()
                    engine.drain()
                if scheduled:
                    engine.step_ended()
                if page_log is not None:
                    setattr(out, ATTR, page_log.take())
            except Exception as exc:
                engine.failed(name, exc)
                raise
            finally:
                if shutdown:
                    engine.close_logged()
        return out

    call.__name__ = call.__qualname__ = name
    call.__doc__ = fn.__doc__
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call
