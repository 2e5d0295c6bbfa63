"""Test-wide setup: say which ledger build is under test, refuse a silent fallback, and skip the
folders of an engine this environment lacks.

Each engine's tests live in a folder that only its own environment can run (``.venv-vllm`` and
``.venv-cpu`` have vLLM, ``.venv-sglang`` SGLang, ``.venv`` neither). There, every module of the
folder is reported as skipped instead of failing to import. (A ``pytest.skip`` in a conftest would
crash a run that names the folder on the command line.)
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvcached.ledger import ledger as _ledger
from kvcached.service.messages import HandoffStatus, JournalStatus, StatusReply

COMPILED = _ledger.__file__.endswith((".so", ".pyd"))


@pytest.fixture
def bdir(tmp_path: Path) -> str:
    """A directory for budgets, as kvcached.budget wants one: this user's, mode 0700."""
    d = tmp_path / "budgets"
    d.mkdir(mode=0o700)
    return str(d)


@pytest.fixture
def status_reply() -> Callable[..., StatusReply]:
    """Makes the ``StatusReply`` kvctl gets from an idle engine's service (no journal, nothing
    handed off), with the fields given changed (``memory``, ``engine``, ...)."""

    def make(**fields: Any) -> StatusReply:
        journal = JournalStatus(
            state="off",
            path=None,
            durability="flush",
            segment=0,
            segment_bytes=0,
            events_written=0,
            events_durable=0,
            snapshot_index=None,
            error=None,
        )
        idle: dict[str, Any] = {
            "pid": 1,
            "uptime_s": 1.0,
            "events": 0,
            "ledger": None,
            "journal": journal,
            "handoff": HandoffStatus(capacity=1, queued=0, dropped=0, gaps=0, episodes=0),
            "clients": 0,
            "dropped_clients": 0,
        }
        return StatusReply(**{**idle, **fields})

    return make


def pytest_report_header() -> str:
    return f"kvcached ledger: {'compiled (mypyc)' if COMPILED else 'pure Python'} from {_ledger.__file__}"


@pytest.fixture(autouse=True, scope="session")
def _expected_build() -> None:
    if os.environ.get("KVCACHED_EXPECT_COMPILED") == "1" and not COMPILED:
        pytest.fail("KVCACHED_EXPECT_COMPILED=1 but the pure-Python ledger was imported", pytrace=False)


# Folder -> (the engine, a module only its real package has: with tests/ on sys.path, a bare
# ``import vllm`` could find a folder of that name as a namespace package).
ENGINE_FOLDERS = {
    "vllm_scheduler": ("vLLM", "vllm.v1.core.sched.scheduler"),
    "sglang_engine": ("SGLang", "sglang.srt.managers.cache_controller"),
}
_missing: dict[str, str | None] = {}  # folder -> why its engine is not importable; None: it is


def _why_missing(folder: str) -> str | None:
    if folder not in _missing:
        engine, probe = ENGINE_FOLDERS[folder]
        try:
            importlib.import_module(probe)
            _missing[folder] = None
        except Exception as exc:  # a broken install (torch mismatch, missing CUDA libs) skips too
            _missing[folder] = f"{engine} is not importable here ({type(exc).__name__}: {exc})"
    return _missing[folder]


class _SkippedModule(pytest.Module):
    reason = ""

    def collect(self) -> Any:
        pytest.skip(self.reason, allow_module_level=True)


def pytest_pycollect_makemodule(module_path: Path, parent: Any) -> pytest.Module | None:
    folder = module_path.parent.name
    reason = _why_missing(folder) if folder in ENGINE_FOLDERS else None
    if reason is None:
        return None
    module = _SkippedModule.from_parent(parent, path=module_path)
    module.reason = reason
    return module
