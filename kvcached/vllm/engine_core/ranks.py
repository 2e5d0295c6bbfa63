"""Which engine core this is among a server's: its data-parallel rank, how many there are, and
the names of its own files.

vLLM runs each data-parallel rank as an engine core of its own (``run_engine_core``), with its
own scheduler under which kvcached builds its own engine; two ranks must never share a journal or
a socket. The rank is in the engine core's config; the size is too for a MoE model, but a dense
model's ranks are independent engines whose config vLLM resets to one rank, so the size comes
from the API server (``api_server.startup`` puts it in the environment its engine cores inherit).
Kept apart from ``control`` and ``engine``, which both need it, so that neither imports the other.
"""

from __future__ import annotations

import os
from typing import Any

from ..api_server.startup import DP_SIZE_ENV


def engine_index(scheduler: Any) -> int:
    """vLLM's index of this engine core: its data-parallel rank. ``EngineCoreProc`` gets it as
    ``engine_index`` and ``run_engine_core`` stores it as ``parallel_config.data_parallel_index``
    before building the engine (vLLM 0.32+; ``data_parallel_rank`` is reset to 0 for a non-MoE
    model's independent ranks), and the API server's ``PrometheusStatLogger`` labels that engine's
    series ``engine=str(index)``."""
    parallel = getattr(getattr(scheduler, "vllm_config", None), "parallel_config", None)
    for name in ("data_parallel_index", "data_parallel_rank"):
        value = getattr(parallel, name, None)
        if isinstance(value, int) and value >= 0:
            return value
    return 0


def data_parallel_size(scheduler: Any) -> int:
    """How many engine cores serve this model side by side (``--data-parallel-size``): each is a
    scheduler of its own with its own kvcached engine, so each needs files of its own. A MoE
    model's ranks keep the size in their config; a dense model's forget it (vLLM's
    ``run_engine_core`` calls ``ParallelConfig.reconfigure_for_independent_dp_rank``), and read
    what the API server's startup patch left them in the environment."""
    parallel = getattr(getattr(scheduler, "vllm_config", None), "parallel_config", None)
    size = getattr(parallel, "data_parallel_size", 1)
    if isinstance(size, int) and size > 1:
        return size
    inherited = os.environ.get(DP_SIZE_ENV, "")
    return int(inherited) if inherited.isdigit() and int(inherited) > 1 else 1


def rank_path(path: str, index: int, size: int) -> str:
    """``path`` for data-parallel rank ``index`` of ``size``: itself for one rank, else
    ``P.dp<index>`` (``ledger-1.dp1.sock`` for a socket, which ``kvctl`` finds by its suffix).
    Two ranks given one ``KVCACHED_LEDGER_JOURNAL`` would otherwise write one file (the second
    refused by the segment lock, ``journal_files.lock``) and one socket (the second unreachable)."""
    if size <= 1:
        return path
    stem, dot, ext = path.rpartition(".")
    if dot and ext == "sock":
        return f"{stem}.dp{index}.sock"
    return f"{path}.dp{index}"
