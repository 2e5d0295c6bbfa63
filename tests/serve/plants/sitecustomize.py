"""Planted bugs in a native vLLM server of the served tests, chosen by ``KVTEST_PLANTS``.

Put on ``PYTHONPATH`` of a test's native server only (tests/serve/test_model_kinds.py): Python
imports ``sitecustomize`` at start in every process of the server. ``KVTEST_PLANTS`` is a
comma-separated list of names from kvcached's one registry of planted bugs
(``kvcached.testing.plants``: ``evict-on-free``, ``zero-loads``, ...), each installed when its
module is first imported.
"""

from __future__ import annotations

import os

_NAMES = [p.strip() for p in os.environ.get("KVTEST_PLANTS", "").split(",") if p.strip()]
if _NAMES:
    from kvcached.testing import plants

    try:
        plants.install_on_import(_NAMES)
    except ValueError as e:
        raise SystemExit(f"KVTEST_PLANTS: {e}") from None
