"""Registers the ``gpu`` marker for runs that do not read the project's pyproject (scripts/gpu_check.sh runs
pytest with its own minimal config on the GPU machine); registering it twice is harmless."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and cuda-python (skipped without one)")
