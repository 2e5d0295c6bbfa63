"""Whether the mypyc-compiled hot path is what runs, and one line saying what its absence costs.

``pip install .`` compiles the ledger and the modules on vLLM's scheduler step with mypyc
from the same typed source; without a C compiler, or with ``KVCACHED_MYPYC=0``, the install
falls back to pure Python and everything still works, only slower. A server that
silently runs the slow build would look like kvcached is expensive, so the engine logs
``compiled_status()`` once at start-up when it is not None. The costs it quotes are measured
on a 2-core machine by ``benchmarks/bench_bridge.py`` (scheduler step, instruction counts) and
``benchmarks/bench_replay.py`` (replay); they are figures to size the loss, not guarantees.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

# The modules ``pip install .`` compiles: setup.py and scripts/build-compiled.sh read this
# tuple from this file (a literal, so that they need not import the package to build it). The
# ledger's ``tables`` and ``queries`` go with ``ledger``: its hot handlers read the tables as
# native attributes only if those are compiled with it. The rest is what runs on vLLM's
# scheduler step (the manager, its page allocator, the page-aware pool, the bridge, the
# recorder): measured with callgrind (benchmarks/bench_bridge.py), about half of kvcached's
# cost on the step.
COMPILED_MODULES: tuple[str, ...] = (
    "kvcached.ledger.ledger",
    "kvcached.ledger.checks",
    "kvcached.ledger.tables",
    "kvcached.ledger.queries",
    "kvcached.ledger.recorder",
    "kvcached.kv_cache_manager",
    "kvcached.page_allocator",
    "kvcached.vllm.engine_core.block_pool",
    "kvcached.vllm.engine_core.cached_blocks",
    "kvcached.vllm.engine_core.pool_seam",
    "kvcached.vllm.engine_core.bridge",
    "kvcached.vllm.engine_core.scheduler_calls",
)

# The engine-neutral part of it, what a wing other than vLLM's runs: a check of the vLLM modules
# would import vLLM's wing into that engine's process.
CORE_COMPILED: tuple[str, ...] = tuple(m for m in COMPILED_MODULES if not m.startswith("kvcached.vllm."))

# What the pure-Python ledger costs, measured (see the module docstring).
PURE_COST = (
    "kvcached's share of vLLM's scheduler step is about 3x as large (5% against 1.6% at 256 running "
    "requests), the ledger's apply takes 3-5x the time and kvreplay replays at under half the speed"
)


def is_compiled(module: str) -> bool:
    """Whether ``module`` was loaded from a compiled extension rather than its ``.py`` source."""
    path = str(getattr(importlib.import_module(module), "__file__", "") or "")
    return not path.endswith(".py")


def compiled_status(modules: Sequence[str] = COMPILED_MODULES) -> str | None:
    """None when every module of the compiled hot path (``modules``) is compiled; else one log
    line saying which run as pure Python, what that costs and how to get the compiled build."""
    pure = [m for m in modules if not is_compiled(m)]
    if not pure:
        return None
    which = (
        "the hot path (ledger, manager, pool, bridge) runs" if len(pure) == len(modules) else f"{', '.join(pure)} run"
    )
    return (
        f"[kvcached] {which} as pure Python (installed without a C compiler, or with KVCACHED_MYPYC=0): "
        f"{PURE_COST}; reinstall with a C compiler on PATH (pip install .) to compile it"
    )
