"""Startup checks: supported setups pass, others are refused with one line saying what to change.

The checks run on vLLM's real ``VllmConfig`` (built by ``EngineArgs`` from the tiny model); two
refusals are also checked on a real server launch: one line on stderr, a non-zero exit, no
traceback, and no engine process started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcached.errors import ConfigError
from kvcached.settings import SETTINGS, Settings
from kvcached.testing.tiny_model import build
from kvcached.vllm.api_server import checks
from kvcached.vllm.testing.e2e import free_port

OURS = {"spec_name": checks.OUR_SPEC[0], "spec_module_path": checks.OUR_SPEC[1], "cpu_bytes_to_use": 1 << 26}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build(tmp_path_factory.mktemp("tiny-llama")))


def _config(model: str, **kw: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, enforce_eager=True, max_model_len=1024, **kw).create_engine_config()


def _offload(extra: dict[str, Any], connector: str = "OffloadingConnector") -> dict[str, Any]:
    return {"kv_transfer_config": {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra}}


def test_supported_setups_pass(model: str) -> None:
    on = Settings.from_env({"ENABLE_KVCACHED": "1"})
    checks.check_config(_config(model), on, version="0.32.0", on_cpu=True)
    checks.check_config(_config(model, **_offload(OURS)), on, version="0.32.0", on_cpu=True)


@pytest.mark.parametrize(
    ("kw", "version", "settings", "needle"),
    [
        ({}, "0.29.1", {}, "supports vLLM 0.30.0 to 0.34.0 .*this is 0.29.1"),
        (_offload({**OURS, "spec_name": "CPUOffloadingSpec"}), "0.32.0", {}, "spec_name"),
        (_offload({**OURS, "canonical_layout": True}), "0.32.0", {}, "canonical_layout"),
        (_offload({}, connector="LMCacheConnectorV1"), "0.32.0", {}, "OffloadingConnector as the only KV connector"),
        ({}, "0.32.0", {"KVCACHED_BACKEND": "cuda"}, "KVCACHED_BACKEND=host"),
    ],
)
def test_unsupported_setups_are_refused(
    model: str, kw: dict[str, Any], version: str, settings: dict[str, str], needle: str
) -> None:
    s = Settings.from_env({"ENABLE_KVCACHED": "1", **settings})
    with pytest.raises(ConfigError, match=needle) as e:
        checks.check_config(_config(model, **kw), s, version=version, on_cpu=True)
    assert "\n" not in str(e.value)


def test_an_untested_newer_vllm_serves_with_one_warning_unless_strict(model: str, caplog) -> None:
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm.kvcached"):
        checks.check_config(_config(model), Settings.from_env({"ENABLE_KVCACHED": "1"}), version="0.35.0", on_cpu=True)
    (line,) = [r.getMessage() for r in caplog.records if "0.35.0" in r.getMessage()]
    assert line.startswith("[kvcached] vLLM 0.35.0 is newer than kvcached was tested on"), line
    strict = Settings.from_env({"ENABLE_KVCACHED": "1", "KVCACHED_STRICT_VERSIONS": "1"})
    with pytest.raises(ConfigError, match="KVCACHED_STRICT_VERSIONS=1"):
        checks.check_config(_config(model), strict, version="0.35.0", on_cpu=True)


def test_tensor_parallel_and_the_mp_executor_pass_on_cpu_and_gpu(model: str) -> None:
    """Each rank's memory is its worker's, steered by the decisions each step carries
    (step_channel): tensor parallel sizes and the mp executor pass, on the CPU build and on a GPU."""
    cfg = _config(model)
    cfg.parallel_config.distributed_executor_backend = "mp"
    cfg.parallel_config.tensor_parallel_size = 4
    on = Settings.from_env({"ENABLE_KVCACHED": "1"})
    checks.check_config(cfg, on, version="0.32.0", on_cpu=True)
    checks.check_config(cfg, on, version="0.33.0", on_cpu=False)


def test_a_kv_cache_larger_than_dev_shm_is_refused(model: str) -> None:
    import os

    st = os.statvfs("/dev/shm")
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    cfg = _config(model)
    cfg.cache_config.kv_cache_memory_bytes = too_big
    with pytest.raises(ConfigError, match=r"/dev/shm has \d+ MiB free.*--shm-size"):
        checks.check_config(cfg, Settings.from_env({"ENABLE_KVCACHED": "1"}), version="0.32.0", on_cpu=True)


def test_pipeline_stages_pass_when_equal_and_compiled_on_cpu(model: str) -> None:
    from vllm.config import CompilationMode

    on = Settings.from_env({"ENABLE_KVCACHED": "1"})
    cfg = _config(model)  # the tiny llama's 8 layers: 4 and 4 at PP=2, 3/3/2 at PP=3
    cfg.parallel_config.pipeline_parallel_size = 2
    checks.check_config(cfg, on, version="0.33.0", on_cpu=False)  # a GPU needs no compilation for it
    with pytest.raises(ConfigError, match="drop --enforce-eager") as e:  # _config is eager
        checks.check_config(cfg, on, version="0.32.0", on_cpu=True)
    assert "\n" not in str(e.value)
    cfg.compilation_config.mode = CompilationMode.STOCK_TORCH_COMPILE
    checks.check_config(cfg, on, version="0.32.0", on_cpu=True)
    cfg.parallel_config.pipeline_parallel_size = 3
    with pytest.raises(ConfigError, match="8 layers over 3 stages are 3/3/2: use a --pipeline-parallel-size") as e:
        checks.check_config(cfg, on, version="0.32.0", on_cpu=True)
    assert "\n" not in str(e.value)


def test_several_nodes_pass_without_a_budget_only(model: str) -> None:
    cfg = _config(model)
    cfg.parallel_config.tensor_parallel_size, cfg.parallel_config.nnodes = 2, 2
    checks.check_config(cfg, Settings.from_env({"ENABLE_KVCACHED": "1"}), version="0.32.0", on_cpu=True)
    budget = Settings.from_env({"ENABLE_KVCACHED": "1", "KVCACHED_BUDGET": "b"})
    with pytest.raises(ConfigError, match=r"a budget is per node and --nnodes is 2.*--data-parallel-size") as e:
        checks.check_config(cfg, budget, version="0.32.0", on_cpu=True)
    assert "\n" not in str(e.value)


def test_data_parallel_passes_and_its_ranks_count_for_dev_shm(model: str) -> None:
    import os

    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    cfg = _config(model)
    on = Settings.from_env({"ENABLE_KVCACHED": "1"})
    cfg.parallel_config.data_parallel_size = cfg.parallel_config.data_parallel_size_local = 2
    checks.check_config(cfg, on, version="0.32.0", on_cpu=True)  # each rank an engine of its own
    cfg.cache_config.kv_cache_memory_bytes = free // 2 + (64 << 20)  # fits once, not once per rank
    with pytest.raises(ConfigError, match="/dev/shm has"):
        checks.check_config(cfg, on, version="0.32.0", on_cpu=True)


def test_dev_shm_room_counts_every_rank(model: str) -> None:
    import os

    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    cfg = _config(model)
    cfg.cache_config.kv_cache_memory_bytes = free // 2 + (64 << 20)  # fits once, not twice
    on = Settings.from_env({"ENABLE_KVCACHED": "1"})
    checks.check_config(cfg, on, version="0.32.0", on_cpu=True)
    cfg.parallel_config.tensor_parallel_size = 2
    with pytest.raises(ConfigError, match="/dev/shm has"):
        checks.check_config(cfg, on, version="0.32.0", on_cpu=True)


def test_unknown_kvcached_variables_get_one_warning_line_each(model: str) -> None:
    import logging

    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.kvcached")  # vLLM's logger does not propagate to caplog's
    logger.addHandler(handler)
    try:
        env = {"KVCACHED_PAGESIZE_MB": "4", "KVCACHED_IPC_NAME": "x", "KVCACHED_PAGE_SIZE_MB": "2", "PATH": "/bin"}
        on = Settings.from_env({"ENABLE_KVCACHED": "1"})
        checks.check_config(_config(model), on, version="0.32.0", on_cpu=True, env=env)
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 2 and all("\n" not in line for line in seen), seen
    assert "KVCACHED_PAGESIZE_MB (ignored); did you mean KVCACHED_PAGE_SIZE_MB?" in seen[1]
    assert "KVCACHED_IPC_NAME is upstream kvcached's and does not apply here" in seen[0]


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("env", "extra", "needle"),
    [
        ({"KVCACHED_LEDGER_POLICY": "optimistic"}, {**OURS}, "KVCACHED_LEDGER_POLICY='optimistic'"),
        ({"KVCACHED_PAGE_SIZE_MB": "nan"}, {**OURS}, "KVCACHED_PAGE_SIZE_MB='nan'"),  # was a traceback
        ({"KVCACHED_PAGESIZE_MB": "4"}, {**OURS, "spec_name": "CPUOffloadingSpec"}, "CPUOffloadingSpec needs CUDA"),
    ],
)
def test_server_refuses_in_one_line(
    model: str, tmp_path: Path, env: dict[str, str], extra: dict[str, Any], needle: str
) -> None:
    import os

    ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(free_port()),
        "--enforce-eager",
        "--kv-transfer-config",
        json.dumps(ktc),
    ]
    full_env = {**os.environ, "ENABLE_KVCACHED": "1", "HF_HUB_OFFLINE": "1", **env}
    r = subprocess.run(argv, capture_output=True, text=True, env=full_env, timeout=180)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr + r.stdout, (r.stderr + r.stdout)[-3000:]
    assert "EngineCore" not in r.stderr + r.stdout  # refused before an engine process started
    lines = [line for line in (r.stderr + r.stdout).splitlines() if needle in line]
    assert len(lines) == 1, (r.stderr + r.stdout)[-3000:]  # one line per refusal, not a log line as well
    for name in env.keys() - {v.name for v in SETTINGS}:  # a misspelt name: one warning line
        assert (r.stderr + r.stdout).count(f"variable {name} (ignored)") == 1, (r.stderr + r.stdout)[-3000:]
    # Through vLLM's logger (its format, its stream: stdout by default), prefixed as kvcached's
    # other lines are; once.
    refused = [line for line in (r.stderr + r.stdout).splitlines() if "[kvcached] refused: " in line]
    assert len(refused) == 1 and needle in refused[0], (r.stderr + r.stdout)[-3000:]


def test_ray_on_the_cpu_build_is_refused_in_one_line(model: str) -> None:
    cfg = _config(model)
    cfg.parallel_config.distributed_executor_backend = "ray"
    on = Settings.from_env({"ENABLE_KVCACHED": "1"})
    with pytest.raises(ConfigError, match="does not run the ray executor: use mp"):
        checks.check_config(cfg, on, version="0.32.0", on_cpu=True)
    checks.check_config(cfg, on, version="0.33.0", on_cpu=False)  # on GPUs vLLM runs it, and so does kvcached
