"""The SGLang plugin: with ``ENABLE_KVCACHED=1``, every SGLang KV pool of the process is on kvcached pages.

SGLang runs the functions of its ``sglang.srt.plugins`` entry-point group (``load_plugins``,
``sglang/srt/plugins/__init__.py``) early in each of its processes, the scheduler subprocess
included (``run_scheduler_process``), and applies the hooks they registered; ``SGLANG_PLUGINS``
may narrow the set by name (this one is ``kvcached``). Without the variable ``register``
returns at once and SGLang runs as shipped. With it, the settings are upstream kvcached's
variables (``settings.Settings``), the patch table is checked and the hooks installed
(``hooks.enable``). A malformed setting or an SGLang whose targets moved ends the process with
one line: ``load_plugins`` logs an ``Exception`` with its traceback and goes on, so the refusal
is a ``SystemExit``, which it lets through (``refuse``; the hooks and the allocator refuse the
same way where SGLang calls them, ``refusing``).
"""

from __future__ import annotations

import os

from ..engine.config import core_fields
from ..errors import ConfigError
from ..service.config import service_config
from ..service.live import default_socket_path
from ..settings import Settings
from .boundary import refuse
from .engine import SglangConfig

_installed: SglangConfig | None = None


def config_from(settings: Settings) -> SglangConfig:
    """The engine's configuration from the settings: what SGLang's pools are built with. The
    ledger service runs as in a served vLLM engine: the journal (``KVCACHED_LEDGER_JOURNAL``) and
    the live socket for ``kvctl``, one per scheduler process (its pid names the socket)."""
    return SglangConfig(
        **core_fields(settings, service_config(settings, default_socket_path())),
        page_bytes=settings.page_bytes,
        page_bytes_set=settings.page_bytes_set,
        backend=settings.backend,
        min_kv_cache_bytes=settings.min_kv_cache_bytes,
        strict_versions=settings.strict_versions,
    )


def register() -> None:
    """SGLang's entry point; idempotent, and a no-op unless ``ENABLE_KVCACHED`` is set."""
    global _installed
    try:
        if not Settings.enabled_in() or _installed is not None:
            return
        # The first process to load the plugin is the one that starts SGLang's schedulers (the HTTP
        # server under launch_server): they inherit its pid, by which its /metrics finds them.
        os.environ.setdefault("KVCACHED_SERVE_PID", str(os.getpid()))
        config = config_from(Settings.from_env())
        from . import hooks

        hooks.enable(config)
    except ConfigError as e:
        refuse(e)
    _installed = config
