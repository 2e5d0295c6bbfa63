"""The worker's patches: vLLM's KV cache tensors made on kvcached pages.

``allocate_kv_cache`` (``vllm/v1/worker/utils.py``) is where a worker makes its KV cache; its
replacement returns the same views over kvcached's range (``kv_memory.allocate``), and a refusal
(a layout kvcached cannot serve) is logged as one ``[kvcached] refused:`` line before vLLM
reports that the engine failed to start. Model-runner modules that imported the function by name
before the plugin ran hold vLLM's; their names are rebound to the same replacement.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ...errors import ConfigError, KvcachedError
from ...settings import Settings
from . import kv_memory

log = logging.getLogger("vllm.kvcached")
_replacement: Callable[..., Any] | None = None  # the wrapper of vllm.v1.worker.utils' function


def _on_pages(
    settings: Settings, kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: list[int] | None
) -> Any:
    try:
        return kv_memory.allocate(
            kv_cache_config,
            device,
            layout,
            kernel_block_sizes,
            page_bytes=settings.page_bytes,
            page_set=settings.page_bytes_set,
            backend=settings.backend,
        )
    except KvcachedError as e:
        log.error("[kvcached] refused: %s", str(e).removeprefix("kvcached: "))
        raise


def wrap_allocate_kv_cache(original: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    global _replacement

    @functools.wraps(original)
    def allocate_kv_cache(
        kv_cache_config: Any, device: Any, layout: Any, kernel_block_sizes: list[int] | None = None
    ) -> Any:
        return _on_pages(settings, kv_cache_config, device, layout, kernel_block_sizes)

    _replacement = allocate_kv_cache
    return allocate_kv_cache


def wrap_allocate_kv_cache_with_allocate(original: Callable[..., Any], settings: Settings) -> Callable[..., Any]:
    """vLLM 0.34's form: ``allocate``, when given, makes the backing buffer instead of vLLM's
    zeroed one. vLLM's extensible KV cache passes its own (``ExtensibleKVCache``: a VA range it
    commits itself); kvcached turns that cache off at startup (``api_server.startup``), so one
    arriving here is a setup kvcached did not make, and two owners of one KV range is refused
    rather than served."""
    global _replacement

    @functools.wraps(original)
    def allocate_kv_cache(
        kv_cache_config: Any,
        device: Any,
        layout: Any,
        kernel_block_sizes: list[int] | None = None,
        allocate: Callable[[int], Any] | None = None,
    ) -> Any:
        if allocate is not None:
            e = ConfigError(
                "kvcached: vLLM asked for its KV cache through allocate= (its extensible KV cache, "
                f"{getattr(allocate, '__qualname__', type(allocate).__name__)}), which would own the range "
                "kvcached maps: set enable_extensible_kv_cache=False or disable kvcached"
            )
            log.error("[kvcached] refused: %s", str(e).removeprefix("kvcached: "))
            raise e
        return _on_pages(settings, kv_cache_config, device, layout, kernel_block_sizes)

    _replacement = allocate_kv_cache
    return allocate_kv_cache


def rebind_allocate_kv_cache(held: Callable[..., Any], _settings: Settings) -> Callable[..., Any] | None:
    """A runner module's name for ``allocate_kv_cache``: rebound if it holds vLLM's function."""
    ours = _replacement
    if ours is None or held is not getattr(ours, "__wrapped__", None):  # functools.wraps keeps vLLM's
        return None
    return ours
