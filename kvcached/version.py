"""kvcached's version, as installed: journals, ``kvctl --version`` and the engine's identity say it.

Read from the installed distribution's metadata so that one place (pyproject.toml) names it; a
source tree used without installing (PYTHONPATH) says so instead of guessing.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Final


def _installed() -> str:
    try:
        return version("kvcached")
    except PackageNotFoundError:
        return "0+source"


KVCACHED_VERSION: Final = _installed()
