"""What the GPU test modules share: the module-level guard and the device's free memory.

``require_gpu()`` skips the calling module on a machine without a CUDA GPU (or cuda-python),
except under ``KVCACHED_REQUIRE_GPU=1`` (``scripts/gpu_check.sh``), where a missing GPU is an
error: a run on the GPU machine must never pass by skipping. A plain module, not a conftest,
because gpu_check.sh runs pytest with ``--noconftest``.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest


def require_gpu() -> Any:
    """torch, once a CUDA GPU and cuda-python are known to be there; call at module level."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        if os.environ.get("KVCACHED_REQUIRE_GPU") == "1":
            raise RuntimeError("KVCACHED_REQUIRE_GPU=1 but torch sees no CUDA GPU")
        pytest.skip("no CUDA GPU visible", allow_module_level=True)
    pytest.importorskip("cuda.bindings")
    return torch


def free_bytes() -> int:
    """Free device memory as the driver sees it, after torch has let go of what it caches."""
    import torch

    from kvcached.backends.cuda import load_driver

    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    cu: Any = load_driver()
    err, free, _total = cu.cuMemGetInfo()
    assert int(err) == 0
    return int(free)
