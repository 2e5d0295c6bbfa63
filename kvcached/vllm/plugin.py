"""The vLLM plugin: with ``ENABLE_KVCACHED=1``, every vLLM process of a server uses kvcached.

vLLM calls ``register`` (its documented ``vllm.general_plugins`` entry point) in each of its
processes before it builds anything; without the variable it returns at once and vLLM runs
exactly as shipped. With it, the process-wide patches of ``kvcached.vllm.patches`` are checked,
all of them, and installed; what each does is found by the vLLM process it runs in (``register``).
"""

from __future__ import annotations

import logging
import os
import sys

from ..errors import ConfigError
from ..settings import Settings
from . import patches
from .api_server.startup import refuse, serve_port
from .kv_layout import server_key

_installed: Settings | None = None


def register() -> None:
    """vLLM's entry point; idempotent, and a no-op unless ``ENABLE_KVCACHED`` is set.

    NOTE: what the patches do, by the vLLM process they run in:

    * the API server (``api_server``): ``EngineArgs.create_engine_config`` runs the startup
      checks, so that an unsupported setup is refused with one line before an engine process
      starts, and kvcached's series join vLLM's ``/metrics``.
    * each worker (``worker``): ``allocate_kv_cache`` makes the KV cache tensors views of
      kvcached pages, with the shapes and strides vLLM's own allocation gives them, and each
      step's page decisions are applied before the step runs.
    * the engine core (``engine_core``): right after ``Scheduler.__init__``, kvcached's engine is
      built under the scheduler (the page-aware pool, the bridge on the OffloadingConnector, the
      ledger service, one wrapper around each KV call), and an idle engine still sends its
      decisions and can be woken by ``kvctl``.

    NOTE: the settings are upstream kvcached's variables (``settings.Settings``); a malformed
    one, or a vLLM whose targets moved, is refused like an unsupported setup."""
    global _installed
    try:
        if not Settings.enabled_in() or _installed is not None:
            return
        settings = Settings.from_env()
    except ConfigError as e:
        refuse(str(e))
    server_key()  # made here, in the first process, so that every child inherits it
    # The first process is vllm serve's API server: its pid and port go to every engine core it
    # starts (inherited), for kvctl list and for its /metrics to find them.
    os.environ.setdefault("KVCACHED_SERVE_PID", str(os.getpid()))
    port = serve_port(sys.argv)
    if port is not None:
        os.environ.setdefault("KVCACHED_SERVE_PORT", str(port))
    _route_logs()
    try:
        patches.install(patches.When.PLUGIN_LOAD, settings)
    except ConfigError as e:
        refuse(str(e))
    _installed = settings


def _route_logs() -> None:
    """kvcached's own loggers (``kvcached.*``: the ledger service, the live view) write through
    vLLM's handlers and level; without this their lines reach stderr through Python's
    last-resort handler, unformatted and ignoring ``VLLM_LOGGING_LEVEL``.

    NOTE: so kvcached's lines look like vLLM's and obey ``VLLM_LOGGING_LEVEL``."""
    ours, theirs = logging.getLogger("kvcached"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False
