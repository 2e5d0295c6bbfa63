"""kvcached: elastic GPU KV memory that stays correct under vLLM's CPU KV offloading.

The public face is small, as ``trio.testing`` is over its private modules: the pin ledger that
decides when a page may be unmapped (``Ledger``), the KV cache manager that hands out blocks on
pages and gives pages back (``KVCacheManager`` over a ``KVGeometry``), the settings a served
engine reads from ``KVCACHED_*`` variables (``Settings``), the base of every error kvcached raises
on purpose (``KvcachedError``, whose kinds are in ``kvcached.errors``) and ``__version__``. The
serving engines' integrations are packages of their own (``kvcached.vllm``), loaded by the
engine through its plugin hooks, never by this module.

The names are resolved on first use, so that ``import kvcached.ledger`` in a replay tool loads
the ledger alone and not the manager, its backends or the settings; type checkers read them
from ``__init__.pyi``, as msgspec's face is typed.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import KvcachedError
from .version import KVCACHED_VERSION as __version__

__all__ = ["KVCacheManager", "KVGeometry", "KvcachedError", "Ledger", "Settings", "__version__"]

_LAZY = {
    "KVCacheManager": "kvcached.kv_cache_manager",
    "KVGeometry": "kvcached.kv_cache_manager",
    "Ledger": "kvcached.ledger.ledger",
    "Settings": "kvcached.settings",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcached' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
