"""kvcached's series on SGLang's ``/metrics`` (``--enable-metrics``), the same as under vLLM.

SGLang serves ``/metrics`` from its HTTP server process with a registry it makes once around a
``MultiProcessCollector`` (``add_prometheus_middleware``, sglang/srt/utils/common.py), which reads
the files its processes write under ``PROMETHEUS_MULTIPROC_DIR``. The patch table wraps that
collector's ``collect`` (``hooks.PATCHES``) to add the families of the engine-neutral collector
(``kvcached.engine.metrics``): the schedulers this server started, asked over their ledger
sockets at scrape time. Names and labels are those under vLLM, so one dashboard and one set of
alerts serve both engines; ``serving`` in ``vllm:kvcached_info`` says which engine it is.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..engine.metrics import Collector
from ..engine.releases import Releases

log = logging.getLogger("sglang.kvcached")

_collector: Collector | None = None


def families(releases: Releases) -> list[Any]:
    """The families of this process's engines for one scrape (the collector made at the first)."""
    global _collector
    if _collector is None:
        _collector = Collector(os.getpid(), releases=releases)
    return _collector.families(log)
