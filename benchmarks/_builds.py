"""Pure Python and mypyc-compiled ledger, side by side: the one runner the benchmarks share.

A benchmark measures a comparison in one run, so each of them re-runs itself as a child process
per build, with ``PYTHONPATH`` pointing at the build's copy of ``kvcached`` and ``-P`` so that
the source tree on the script's path cannot shadow it; the child prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def builds(tmp: str, *, compiled: bool = True) -> dict[str, str]:
    """{"pure": source tree, "compiled": a mypyc build made in ``tmp``}."""
    out = {"pure": str(ROOT)}
    if compiled:
        path = os.path.join(tmp, "compiled")
        subprocess.run(["bash", str(ROOT / "scripts/build-compiled.sh"), path], check=True)
        out["compiled"] = path
    return out


def child(build: str, script: str, *args: str, cwd: str | None = None) -> Any:
    """Run ``script --child *args`` against ``build``; return the JSON of its last output line."""
    cmd = [sys.executable, "-P", script, "--child", *args]
    env = dict(os.environ, PYTHONPATH=build)
    proc = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=cwd)
    return json.loads(proc.stdout.strip().splitlines()[-1])
