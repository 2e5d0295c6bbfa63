"""The API server's patch: the startup checks, then kvcached's series on its ``/metrics``.

``EngineArgs.create_engine_config`` builds the ``VllmConfig`` every engine of ``vllm serve``
starts from, in the API server's process, before any engine process exists: its replacement runs
vLLM's, then ``checks.check_config``, which refuses an unsupported setup with one line (an error
on vLLM's logger, then ``SystemExit``: no traceback), names kvcached's OffloadingConnector for
vLLM's connector factory (``name_connector``), then joins kvcached's series to vLLM's Prometheus
registry. Under ``--api-server-count N`` every API server process runs it too (each builds its
own config in ``build_async_engine_client_from_engine_args``), and each gets the collector; the
registry vLLM serves there is made later, by ``get_prometheus_registry``, whose wrapper adds the
collector.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from ...errors import ConfigError
from ...settings import Settings
from .. import patches
from . import checks

# vllm serve's --data-parallel-size, for its engine cores (``engine_core.ranks.data_parallel_size``).
DP_SIZE_ENV = "KVCACHED_SERVE_DP_SIZE"

log = logging.getLogger("vllm.kvcached")  # the plugin's logger: vLLM's format and handlers


class Refused(SystemExit):
    """Exit status 1 once the refusal is logged. The interpreter prints a ``SystemExit``'s text
    (a second copy of the line) unless its code is a number; ``str`` still gives the text, for
    whoever catches it."""

    def __init__(self, line: str) -> None:
        super().__init__(1)
        self.line = line

    def __str__(self) -> str:
        return self.line


def refuse(message: str) -> NoReturn:
    """End the process with one line: an error on vLLM's logger, prefixed as kvcached's other
    lines are (``[kvcached] refused: ...``, as the engine core's ``served.wrap_scheduler_init``
    says it), and exit status 1. A level that hides errors (``VLLM_LOGGING_LEVEL=CRITICAL``) must
    not make the refusal silent: the line then goes to stderr as it is."""
    line = "[kvcached] refused: " + message.removeprefix("kvcached: ")
    if log.isEnabledFor(logging.ERROR):
        log.error("%s", line)
    else:
        print(line, file=sys.stderr, flush=True)
    raise Refused(line)


def name_connector(kv_transfer_config: Any) -> None:
    """Have vLLM's connector factory build kvcached's OffloadingConnector (vLLM's, reporting its
    scheduler-side calls to the bridge) in every process of this server: the factory takes the
    class named ``kv_connector`` from ``kv_connector_module_path`` before its own registry
    (``KVConnectorFactory.get_connector_class``). The checks refused any other module."""
    if kv_transfer_config is not None and kv_transfer_config.kv_connector == "OffloadingConnector":
        kv_transfer_config.kv_connector_module_path = patches.CONNECTOR_MODULE


def take_kv_sizing(engine_args: Any) -> None:
    """Turn vLLM's extensible KV cache off, and name the memory utilization kvcached sizes with.

    NOTE: vLLM 0.34 (``VllmConfig._resolve_extensible_kv_cache``) turns its extensible KV cache
    on by default on CUDA: the worker reserves the KV range itself and commits it in one piece
    after warm-up (``vllm/v1/worker/extensible_kv_cache.py``), passing ``allocate=`` to
    ``allocate_kv_cache``. Its release is all or nothing and its regrowth discards contents, so
    kvcached keeps its own per-page mapping and turns vLLM's off rather than building on it. With
    it on, an unset ``gpu_memory_utilization`` resolves to 1.0 ("this GPU is mine"), the opposite
    of engines sharing a GPU; with it off, vLLM's own default (0.92) is set here explicitly. A
    vLLM without the setting (before 0.34) is left as it is."""
    if not hasattr(engine_args, "enable_extensible_kv_cache"):
        return
    if engine_args.enable_extensible_kv_cache:
        raise ConfigError(
            "kvcached: --enable-extensible-kv-cache makes vLLM own the KV range kvcached maps page by page: "
            "drop it, or disable kvcached (ENABLE_KVCACHED=0)"
        )
    engine_args.enable_extensible_kv_cache = False
    if getattr(engine_args, "gpu_memory_utilization", 0.0) is None:
        from vllm.config import CacheConfig

        engine_args.gpu_memory_utilization = float(getattr(CacheConfig, "DEFAULT_GPU_MEMORY_UTILIZATION", 0.92))


def wrap_create_engine_config(original: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            take_kv_sizing(self)
        except ConfigError as e:
            refuse(str(e))
        config = original(self, *args, **kwargs)
        try:
            checks.check_config(config, settings, version=patches.vllm_version(), on_cpu=patches.on_cpu())
        except ConfigError as e:
            refuse(str(e))
        name_connector(config.kv_transfer_config)
        # A non-MoE data-parallel rank's engine core forgets the size (vLLM's run_engine_core calls
        # ParallelConfig.reconfigure_for_independent_dp_rank): each engine core inherits it here.
        os.environ[DP_SIZE_ENV] = str(int(config.parallel_config.data_parallel_size or 1))
        if getattr(self, "_api_process_rank", 0) == -1:
            # vllm serve --api-server-count N's manager (cli/serve.py's run_multi_api_server sets
            # rank -1): it serves no /metrics; the API servers it spawns each install their own.
            return config
        from . import metrics  # an API server's process: its /metrics gets kvcached's series

        # The engines name the first vllm serve process (plugin.register); a spawned API server
        # inherits its pid in the environment.
        root = os.environ.get("KVCACHED_SERVE_PID", "")
        metrics.install(int(root) if root.isdigit() else os.getpid())
        return config

    return create_engine_config


def wrap_multiprocess_collect(original: Callable[..., Any], _settings: Settings) -> Callable[..., Any]:
    """``MultiProcessCollector.collect``, with kvcached's families added where this process made
    the collector (an API server: ``create_engine_config`` ran here); elsewhere it adds nothing."""

    @functools.wraps(original)
    def collect(self: Any) -> list[Any]:
        found = list(original(self))
        metrics = sys.modules.get(f"{__package__}.metrics")  # imported by install(): API servers only
        return found + metrics.families() if metrics is not None else found

    return collect


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
