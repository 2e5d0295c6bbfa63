"""Whether the mypyc-compiled hot path is what runs, and one line saying what its absence costs.

``pip install .`` compiles the ledger (and, where they compile, the modules on vLLM's scheduler
step) with mypyc from the same typed source; without a C compiler, or with ``KVCACHED_MYPYC=0``,
the install falls back to pure Python and everything still works, only slower. A server that
silently runs the slow build would look like kvcached is expensive, so the engine logs
``compiled_status()`` once at start-up when it is not None. The costs it quotes are measured
on a 2-core machine by ``benchmarks/bench_bridge.py`` (scheduler step, instruction counts) and
``benchmarks/bench_replay.py`` (replay); they are figures to size the loss, not guarantees.
"""

from __future__ import annotations

import importlib

# The modules setup.py compiles (its COMPILED list, as import names).
COMPILED_MODULES: tuple[str, ...] = (
    "kvcached.ledger.ledger",
    "kvcached.ledger.checks",
    "kvcached.ledger.tables",
    "kvcached.ledger.queries",
)

# What the pure-Python ledger costs, measured (see the module docstring).
PURE_COST = (
    "the ledger's apply takes about 2x the time, kvcached's share of vLLM's scheduler step is "
    "about twice as large and kvreplay replays about half as fast"
)


def is_compiled(module: str) -> bool:
    """Whether ``module`` was loaded from a compiled extension rather than its ``.py`` source."""
    path = str(getattr(importlib.import_module(module), "__file__", "") or "")
    return not path.endswith(".py")


def compiled_status() -> str | None:
    """None when every module of the compiled hot path is compiled; else one log line saying
    which run as pure Python, what that costs and how to get the compiled build."""
    pure = [m for m in COMPILED_MODULES if not is_compiled(m)]
    if not pure:
        return None
    which = "the ledger runs" if len(pure) == len(COMPILED_MODULES) else f"{', '.join(pure)} run"
    return (
        f"[kvcached] {which} as pure Python (installed without a C compiler, or with KVCACHED_MYPYC=0): "
        f"{PURE_COST}; reinstall with a C compiler on PATH (pip install .) to compile it"
    )
