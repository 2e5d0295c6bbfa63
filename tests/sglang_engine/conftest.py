"""Tests on real SGLang classes; only .venv-sglang has SGLang, so skip the folder there.

Each module of this folder is then reported as skipped instead of failing to import. (A
``pytest.skip`` in this conftest would crash a run that names this folder on the command line.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

SKIP_REASON: str | None = None
try:
    import sglang.srt.managers.cache_controller  # noqa: F401
except Exception as exc:  # a broken install skips too
    SKIP_REASON = f"SGLang is not importable here ({type(exc).__name__}: {exc})"


class _SkippedModule(pytest.Module):
    def collect(self) -> Any:
        pytest.skip(SKIP_REASON or "", allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> pytest.Module | None:
    if SKIP_REASON is None:
        return None
    return _SkippedModule.from_parent(parent, path=module_path)
