"""Running kvvalidate as a user does, and reading its check table (the served tests' helper)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def kvvalidate(out: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``kvvalidate run ARGV --device cpu -o OUT`` in its own process, as a user runs it."""
    if not os.environ.get("KVCACHED_SGLANG_PYTHON") and "sglang" in " ".join(argv):
        pytest.skip("needs SGLang's environment (KVCACHED_SGLANG_PYTHON, set by scripts/test.sh)")
    cmd = [sys.executable, "-m", "kvvalidate", "run", *argv, "--device", "cpu", "-o", str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=2400)


def rows(stdout: str) -> dict[tuple[str, str], tuple[str, str]]:
    """(case, check) -> (result, detail), from the table on stdout (nothing else is written there)."""
    found = {}
    for line in stdout.splitlines()[1:]:
        case, check, result, *detail = line.split(None, 3)
        found[case, check] = (result, detail[0] if detail else "")
    return found
