"""Startup checks: the setups kvcached serves, and one line saying what to change otherwise.

They run where vLLM builds its configuration (the API server, before any engine process
starts), so a refusal costs a second, not a model load, and reads as one line instead of a
worker's traceback. What they accept is what the tests cover (``check_config``). Checks that need
the KV cache layout (a block that does not divide a page, an interleaved layout) can only run
once vLLM has sized the cache; they live in ``kv_layout.plan`` and fail the worker with the same
kind of line.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from ...backends import cuda_visible
from ...errors import ConfigError
from ...settings import Settings, ignored_settings, unknown_settings
from .. import patches
from ..patches import CONNECTOR_MODULE

log = logging.getLogger("vllm.kvcached")  # the plugin's logger: vLLM's format and handlers

SUPPORTED_EXECUTORS = ("mp", "uni", "ray")
OUR_SPEC = ("KvcachedCPUOffloadingSpec", "kvcached.vllm.offload.cpu")


def tested(version: str) -> bool:
    """Whether ``version`` is a release kvcached was tested on (``patches.TESTED``)."""
    return patches.VLLM.is_tested(version)


def check_vllm_version(version: str, *, strict: bool = False) -> str | None:
    """``Releases.check`` for vLLM: refuse an older release (or, ``strict``, an untested one);
    the warning to log for an untested one; None for a tested one."""
    return patches.VLLM.check(version, strict=strict)


def check_config(
    vllm_config: Any, settings: Settings, *, version: str, on_cpu: bool, env: Mapping[str, str] | None = None
) -> None:
    """Raise ``ConfigError`` (one line, what to change) for a setup kvcached does not serve; warn,
    one line each, of the ``KVCACHED_*`` variables in ``env`` (the environment) it does not read,
    and of those it reads that have no effect under vLLM (``settings.SCOPES``).

    NOTE: each ``KVCACHED_*`` variable kvcached does not read gets one warning line, as vLLM's
    ``validate_environ`` does for unknown ``VLLM_*`` variables: a misspelt setting would otherwise
    go unnoticed, its default in force. So does one it reads that has no effect under vLLM
    (``settings.SCOPES``: ``KVCACHED_CONTIGUOUS_LAYOUT``).

    NOTE: what the checks accept is what the tests cover:

    - vLLM's CPU build 0.32.0 and vLLM 0.33.0.
    - no KV connector, or ``OffloadingConnector`` as the only one.
    - tensor parallelism of any size (each rank's KV memory lives in its worker, which applies
      the scheduler's page decisions carried by each step: ``step_channel``), run by vLLM's
      multiprocessing, uniprocess or Ray executor, on the CPU build and on GPUs alike.
    - data parallelism of any size (each rank is an engine core of its own, with its own
      kvcached engine and files: ``engine_core.ranks.rank_path``).
    - several nodes through vLLM's own launch (``--nnodes`` with ``--headless`` workers, or
      data-parallel ranks on other nodes), a budget only where an engine's workers are on one
      node.
    - pipeline stages of equal layers (``_check_pipeline``).
    - the CUDA backend only where a GPU is visible."""
    e = os.environ if env is None else env
    for warning in [*unknown_settings(e), *ignored_settings("vllm", e)]:
        log.warning("[kvcached] %s", warning)
    untested = check_vllm_version(version, strict=settings.strict_versions)
    if untested is not None:
        log.warning("[kvcached] %s", untested)
    par = vllm_config.parallel_config
    if int(par.pipeline_parallel_size) > 1:
        _check_pipeline(vllm_config, on_cpu=on_cpu)
    nnodes = int(getattr(par, "nnodes", 1) or 1)
    if nnodes > 1 and settings.budget is not None:
        # A budget is a file on one node; the engine core that leases from it is on the first
        # node, and the workers on the others have no engine there to lease from theirs.
        raise ConfigError(
            f"kvcached: a budget is per node and --nnodes is {nnodes} (one engine's workers on several nodes): "
            "unset KVCACHED_BUDGET, or spread engines over nodes with --data-parallel-size"
        )
    tp = int(par.tensor_parallel_size)
    executor = par.distributed_executor_backend
    if executor is not None and executor not in SUPPORTED_EXECUTORS:
        name = executor if isinstance(executor, str) else getattr(executor, "__name__", repr(executor))
        raise ConfigError(
            f"kvcached needs vLLM's mp, uni or ray executor, not {name}: drop --distributed-executor-backend "
            "or disable kvcached"
        )
    if on_cpu and executor == "ray":
        # vLLM's CPU platform refuses Ray (ray_utils.initialize_ray_cluster): one line now, not its traceback.
        raise ConfigError("vLLM's CPU build does not run the ray executor: use mp (the default) or uni")
    _check_connector(vllm_config.kv_transfer_config, on_cpu=on_cpu)
    if on_cpu:
        # The host backend shares the KV cache through /dev/shm: refuse now, not with SIGBUS on
        # the first request that writes past what the tmpfs holds. (The worker checks the exact
        # size again once vLLM has sized the cache.)
        kv_bytes = getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None)
        if kv_bytes:
            from ..worker.kv_memory import check_shm_room

            # One range per worker of each data-parallel engine on this node (--nnodes spreads
            # one engine's tensor-parallel workers over the nodes evenly).
            local_dp = int(getattr(par, "data_parallel_size_local", None) or par.data_parallel_size or 1)
            check_shm_room(int(kv_bytes) * max(1, tp // nnodes) * local_dp)
    if settings.backend == "cuda" and (on_cpu or not cuda_visible()):
        raise ConfigError(
            "kvcached: KVCACHED_BACKEND=cuda needs a CUDA GPU and none is visible; "
            "set KVCACHED_BACKEND=host (or auto) on CPU machines"
        )
    if settings.backend == "host" and not on_cpu:
        raise ConfigError("kvcached: KVCACHED_BACKEND=host serves vLLM's CPU build only; use cuda or auto on GPUs")


def _check_pipeline(vllm_config: Any, *, on_cpu: bool) -> None:
    """Pipeline stages: each stage's workers map the pages the scheduler decides for their own
    layers (every worker gets each ``SchedulerOutput``), and a page costs one stage's layers on
    every worker (``step_sender.decision_backends``), which is exact when the stages hold equal
    numbers of layers: so they must. On vLLM's CPU build a stage after the first needs the
    warm-up that allocates its intermediate tensors (``GPUModelRunner._dummy_run``), which the
    CPU worker skips without compilation (``CPUModelRunner.warming_up_model``); it then asserts
    in ``sync_and_gather_intermediate_tensors`` at the first request, natively too."""
    from vllm.distributed.utils import get_pp_indices

    stages = int(vllm_config.parallel_config.pipeline_parallel_size)
    layers = int(vllm_config.model_config.get_total_num_hidden_layers())
    sizes = [hi - lo for lo, hi in (get_pp_indices(layers, r, stages) for r in range(stages))]
    if len(set(sizes)) > 1:
        raise ConfigError(
            f"kvcached needs pipeline stages of equal layers; {layers} layers over {stages} stages are "
            f"{'/'.join(map(str, sizes))}: use a --pipeline-parallel-size that divides {layers}, "
            "or set VLLM_PP_LAYER_PARTITION to equal parts"
        )
    mode = getattr(vllm_config.compilation_config, "mode", None)
    if on_cpu and int(getattr(mode, "value", mode) or 0) == 0:
        raise ConfigError(
            "vLLM's CPU build serves --pipeline-parallel-size > 1 only with compilation (its later stages "
            "skip the warm-up that allocates their inputs, then fail at the first request): drop --enforce-eager, "
            """or add --compilation-config '{"mode": 1, "backend": "eager"}'"""
        )


def _check_connector(ktc: Any, *, on_cpu: bool) -> None:
    if ktc is None or not getattr(ktc, "kv_connector", None):
        return
    name = ktc.kv_connector
    if name != "OffloadingConnector":
        raise ConfigError(
            f"kvcached works with OffloadingConnector as the only KV connector, not {name}: "
            "use --kv-offloading-size / kv_connector=OffloadingConnector, or disable kvcached"
        )
    module = getattr(ktc, "kv_connector_module_path", None)
    if module and module != CONNECTOR_MODULE:
        raise ConfigError(
            f"kvcached brings its own OffloadingConnector (vLLM's, reporting to kvcached); kv_connector_module_path "
            f"names {module}: remove it, or disable kvcached"
        )
    extra = dict(getattr(ktc, "kv_connector_extra_config", None) or {})
    spec = extra.get("spec_name", "CPUOffloadingSpec")
    if on_cpu and spec == "CPUOffloadingSpec":
        raise ConfigError(
            "kvcached: vLLM's CPUOffloadingSpec needs CUDA; on the CPU build set kv_connector_extra_config "
            f'"spec_name": "{OUR_SPEC[0]}", "spec_module_path": "{OUR_SPEC[1]}"'
        )
    if extra.get("canonical_layout"):
        raise ConfigError("kvcached: the canonical host layout is not supported; remove canonical_layout")
