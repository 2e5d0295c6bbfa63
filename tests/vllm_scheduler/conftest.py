"""Tests that drive the real vLLM scheduler; the main test venv has no vLLM, so skip the folder there.

Each module of this folder is then reported as skipped instead of failing to import. (A
``pytest.skip`` in this conftest would crash a run that names this folder on the command line.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

SKIP_REASON: str | None = None
try:
    # Not a bare ``import vllm``: with tests/ on sys.path this folder itself imports as a
    # namespace package named vllm, so ask for a module only the real package has.
    import vllm.v1.core.sched.scheduler  # noqa: F401
except Exception as exc:  # a broken install (torch mismatch, missing CUDA libs) skips too
    SKIP_REASON = f"vLLM is not importable here ({type(exc).__name__}: {exc})"


class _SkippedModule(pytest.Module):
    def collect(self) -> Any:
        pytest.skip(SKIP_REASON or "", allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> pytest.Module | None:
    if SKIP_REASON is None:
        return None
    return _SkippedModule.from_parent(parent, path=module_path)
