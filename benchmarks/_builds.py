"""Pure Python and mypyc-compiled ledger, side by side: the one runner the benchmarks share.

A benchmark measures a comparison in one run, so each of them re-runs itself as a child process
per build, with ``PYTHONPATH`` pointing at the build's copy of ``kvcached`` and ``-P`` so that
the source tree on the script's path cannot shadow it; the child prints one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
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


def builds_at(rev: str, tmp: str) -> dict[str, str]:
    """{"pure@REV", "compiled@REV"}: ``kvcached`` and ``kvreplay`` as they were at git revision
    ``rev``, each build with its own copy of ``kvreplay`` (on ``PYTHONPATH`` it comes before the
    editable install's), the compiled one made by that revision's ``build-compiled.sh``. For a
    comparison with older code in one run, as a stated "today N events/s" was measured on a
    machine whose speed has moved since."""
    src = os.path.join(tmp, f"src-{rev}")
    os.makedirs(src)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "kvcached", "tools", "scripts", "setup.py"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    os.symlink(ROOT / ".venv", os.path.join(src, ".venv"))  # the build script runs its root's mypyc
    pure, compiled = os.path.join(tmp, f"pure-{rev}"), os.path.join(tmp, f"compiled-{rev}")
    os.makedirs(pure)
    shutil.copytree(os.path.join(src, "kvcached"), os.path.join(pure, "kvcached"))
    subprocess.run(["bash", os.path.join(src, "scripts/build-compiled.sh"), compiled], check=True)
    # kvreplay's source: tools/kvreplay, or tools/replay at revisions before the tools lived together.
    replay = next(d for d in ("tools/kvreplay", "tools/replay") if os.path.isdir(os.path.join(src, d)))
    for build in (pure, compiled):
        shutil.copytree(os.path.join(src, replay), os.path.join(build, "kvreplay"))
    return {f"pure@{rev}": pure, f"compiled@{rev}": compiled}


def child(build: str, script: str, *args: str, cwd: str | None = None) -> Any:
    """Run ``script --child *args`` against ``build``; return the JSON of its last output line."""
    cmd = [sys.executable, "-P", script, "--child", *args]
    env = dict(os.environ, PYTHONPATH=build)
    proc = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=cwd)
    return json.loads(proc.stdout.strip().splitlines()[-1])
