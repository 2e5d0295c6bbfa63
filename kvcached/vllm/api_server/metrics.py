"""kvcached's series on vLLM's ``/metrics``: the engine-neutral collector (``kvcached.engine.metrics``)
put where vLLM's API server reads, for the engine cores its ``vllm serve`` started.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ...engine import metrics as core
from ...engine.metrics import PREFIX, SERIES, documented_names, exposed_names, page_states
from .. import patches

__all__ = [
    "PREFIX",
    "SERIES",
    "Collector",
    "collector",
    "documented_names",
    "exposed_names",
    "families",
    "install",
    "page_states",
]

log = logging.getLogger("vllm.kvcached")


class Collector(core.Collector):
    """The collector of the engine cores ``vllm serve`` pid ``api_pid`` started."""

    def __init__(self, api_pid: int, folder: str | None = None) -> None:
        super().__init__(api_pid, folder, releases=patches.VLLM)


_collector: Collector | None = None


def install(api_pid: int) -> None:
    """Makes this API server's collector (once) and puts it where vLLM's ``/metrics`` reads;
    ``api_pid`` is the ``vllm serve`` process that started the engines (``KVCACHED_SERVE_PID``,
    inherited by the API servers it spawns), not necessarily this one.

    NOTE: under ``--api-server-count N`` vLLM sets ``PROMETHEUS_MULTIPROC_DIR``. ``/metrics`` is
    then answered by prometheus-fastapi-instrumentator's ``expose`` route, which builds a fresh
    registry per scrape holding only a ``MultiProcessCollector`` (the files every process
    writes). No registry lives long enough to register with, so the patch table wraps
    ``MultiProcessCollector.collect`` in the API server to add this server's families."""
    global _collector
    if _collector is not None:
        return
    collector = Collector(api_pid)
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") is None:
        try:
            from prometheus_client import REGISTRY

            REGISTRY.register(collector)
        except Exception as exc:  # metrics are worth a warning, never a failed start
            log.warning("[kvcached] metrics: not on /metrics: %s", exc)
            return
    # else: /metrics is a registry made per scrape around a MultiProcessCollector, whose collect
    # the patch table wraps to add families() (see the NOTE above).
    _collector = collector
    log.info("[kvcached] metrics: kvcached's series on the /metrics of API server pid %d", os.getpid())


def collector() -> Collector | None:
    """This API server's collector (``install``), which also finds its engines for the HTTP
    routes (``api_server.http``); None in any other process."""
    return _collector


def families() -> list[Any]:
    """This API server's kvcached families for a multiprocess scrape; none where there is no
    collector (an engine core, a worker)."""
    collector = _collector
    return [] if collector is None else collector.families(log)
