"""Memory backends: where kvcached's pages physically live, behind one interface (``Backend``).

Two implementations with the same observable contract: ``CudaVmmBackend`` maps GPU pages with the CUDA
virtual-memory driver API, ``HostBackend`` does the same with an anonymous mmap and madvise so that the allocator,
the ledger-driven unmapping and the freed-block-copy scenarios run on CPU machines with memory that really comes
and goes. ``make_backend`` picks one by name; choosing is kept here, and nothing in this package imports torch or
cuda-python at import time, so ``import kvcached.backends`` stays cheap and works on machines with neither (the
ledger and its msgspec dependency are not imported either).
"""

from __future__ import annotations

import os
from typing import Any

from kvcached.backends.base import Backend, MiB, PageStillMappedError
from kvcached.backends.cuda import CudaVmmBackend
from kvcached.backends.host import HostBackend
from kvcached.errors import BackendError, ConfigError

__all__ = [
    "Backend",
    "BackendError",
    "CudaVmmBackend",
    "HostBackend",
    "MiB",
    "PageStillMappedError",
    "cuda_visible",
    "make_backend",
]

KINDS = ("host", "cuda", "auto")


def cuda_visible() -> bool:
    """Whether torch sees a CUDA GPU (False without torch, or with a CPU-only torch)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def make_backend(kind: str = "auto", **kw: Any) -> Backend:
    """A backend by name: "host", "cuda", or "auto" (cuda when a GPU is visible, else host).

    Keyword arguments go to the backend's constructor (``page_bytes``, ``num_pages``; for cuda also ``device``,
    ``zero_page``). Under "auto", cuda-only arguments are dropped when the choice falls on host, so one call site
    serves both machines.
    """
    name = kind.strip().lower() if isinstance(kind, str) else kind
    if name not in KINDS:
        raise ConfigError(f"KVCACHED backend {kind!r} is unknown; use one of {', '.join(KINDS)}")
    if name == "auto":
        name = "cuda" if cuda_visible() else "host"
        if name == "host":
            kw = {k: v for k, v in kw.items() if k not in ("device", "zero_page")}
    if name == "host":
        return HostBackend(**kw)
    if not cuda_visible():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
        raise ConfigError(
            f"KVCACHED backend 'cuda' needs a CUDA GPU: none is visible (CUDA_VISIBLE_DEVICES={visible}); "
            "use the host backend on CPU machines"
        )
    return CudaVmmBackend(**kw)
