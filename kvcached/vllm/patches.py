"""Every change kvcached makes to vLLM, declared once: its target, the vLLM it is known for, why.

kvcached leaves vLLM's files as shipped and changes a few of its attributes at run time. Each
such change is one ``Patch`` in ``PATCHES``: the target (module, class, attribute), the vLLM
versions it is known to hold for, the vLLM function or pull request it relies on, how it is
installed and when. Nothing else in kvcached assigns to a vLLM attribute; the installers here
do (``install``, ``shadow``), each after checking its targets (``check``). Where vLLM offers a
documented seam it is used instead of a patch (``CONNECTOR_MODULE``).
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Final

from ..engine.releases import Releases
from ..engine.targets import Target, present
from ..errors import ConfigError

# Each replacement carries one sentinel: a wrapper function names its patch, and a patched vLLM
# object lists the patches on it. A target carrying it is installed, which makes installing
# idempotent and lets ``installed()`` say what this process changed (the engine core's
# ``[kvcached] active`` line lists it).
SENTINEL: Final = "__kvcached_patch__"
# Where vLLM offers a documented seam it is used instead of a patch. The seams: the
# general-plugin entry point (``vllm.general_plugins``, which runs ``kvcached.vllm.plugin.register``
# in every vLLM process), the connector factory's ``kv_connector_module_path`` (vLLM builds
# kvcached's subclass of its ``OffloadingConnector``, ``CONNECTOR_MODULE``) and the offloading
# spec's ``spec_module_path`` (``kvcached.vllm.offload.cpu``).
#
# vLLM's connector factory takes ``kv_connector`` from this module when the config names it
# (``kv_connector_module_path``): kvcached's OffloadingConnector, vLLM's under the same name.
CONNECTOR_MODULE: Final = "kvcached.vllm.engine_core.connector"
# The vLLM releases every target below was read in and tested on, oldest first. The API server
# refuses an older one; a newer one serves, with a warning, where every target it needs is there
# (``api_server.checks.check_vllm_version``).
TESTED: Final = ("0.30.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0")
VLLM: Final = Releases("vLLM", TESTED)
OLDEST: Final = VLLM.oldest
NEWEST: Final = VLLM.newest
release = VLLM.parse


class When(enum.Enum):
    """The four moments patches are installed at.

    NOTE: at plugin load (process-wide wrappers of a module's or a class's function, in every
    vLLM process), at a worker's KV allocation (its model runner), at engine build (bound methods
    shadowed on the one scheduler, connector and block pool kvcached is put under, and an
    attribute added), and when the engine core's busy loop starts.
    """

    PLUGIN_LOAD = "plugin load"  # ``register``, in every vLLM process
    KV_ALLOCATION = "KV allocation"  # in a worker, when its KV cache is made on kvcached pages
    ENGINE_BUILD = "engine build"  # in the engine core, when kvcached is put under a scheduler
    BUSY_LOOP = "busy loop start"  # in the engine core, when ``EngineCoreProc.run_busy_loop`` starts


class How(enum.Enum):
    WRAPPED = "wrapped"  # a module's or class's function, replaced by one that calls it
    SHADOWED = "shadowed"  # a bound method of one object, shadowed by an instance attribute
    ADDED = "added"  # an attribute vLLM does not have
    # Overridden in a subclass of kvcached's that vLLM builds through a documented seam (the
    # class's module named in vLLM's config): vLLM's class and objects stay as shipped.
    SUBCLASSED = "subclassed"
    READ = "read"  # only read (``RELIED_ON``): a name kvcached uses beyond vLLM's public methods


class Patch(Target, frozen=True, kw_only=True):
    """One change to vLLM (``kvcached.engine.targets.Target``): what the log and the errors call
    it, the vLLM process it runs in, how and when it is installed."""

    RELEASES: ClassVar[Releases] = VLLM

    name: str
    process: str
    how: How
    when: When
    since: str = OLDEST
    # ``module:function`` making a process-wide replacement: ``factory(original, context)``.
    factory: str | None = None

    def checked(self) -> tuple[str, ...]:
        return () if self.how is How.ADDED else self.attrs  # vLLM has no such attribute: the owner must be there


_CORE = "vllm.v1.core.sched.scheduler"
_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
_POOL = "vllm.v1.core.block_pool"

# The scheduler's methods that read or change KV state: each runs under the engine's lock and
# drains the allocator at its end (``engine_core.scheduler_calls``).
SCHEDULER_CALLS: Final = (
    "schedule",
    "update_from_output",
    "finish_requests",
    "add_request",
    "reset_prefix_cache",
    "reset_connector_cache",
    "set_pause_state",
    "update_draft_token_ids",
    "make_stats",
    "get_kv_cache_usage",
    "shutdown",
)
CONNECTOR_CALLS: Final = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "build_connector_meta",
    "update_connector_output",
    "has_pending_push_work",
)
POOL_CALLS: Final = (
    "get_num_free_blocks",
    "get_new_blocks",
    "free_blocks",
    "touch",
    "unpin_blocks",
    "evict_blocks",
    "reset_prefix_cache",
)

PATCHES: Final = (
    # --- API server --------------------------------------------------------------------------
    Patch(
        name="startup checks",
        process="API server",
        module="vllm.engine.arg_utils",
        owner="EngineArgs",
        attrs=("create_engine_config",),
        how=How.WRAPPED,
        when=When.PLUGIN_LOAD,
        why="EngineArgs.create_engine_config builds the VllmConfig every engine starts from: an unsupported "
        "setup is refused there, before an engine process exists; the API server's /metrics joins here",
        factory="kvcached.vllm.api_server.startup:wrap_create_engine_config",
    ),
    Patch(
        name="kvcached's series on a multiprocess /metrics",
        process="API server",
        module="prometheus_client.multiprocess",
        owner="MultiProcessCollector",
        attrs=("collect",),
        how=How.WRAPPED,
        when=When.PLUGIN_LOAD,
        why="under --api-server-count N (cli/serve.py's setup_multiprocess_prometheus) /metrics is "
        "prometheus_fastapi_instrumentator's expose route, which collects a new registry holding only a "
        "MultiProcessCollector per scrape; kvcached's families join what it collects",
        factory="kvcached.vllm.api_server.startup:wrap_multiprocess_collect",
    ),
    # --- worker ------------------------------------------------------------------------------
    Patch(
        name="KV cache on kvcached pages",
        process="worker",
        module="vllm.v1.worker.utils",
        owner=None,
        attrs=("allocate_kv_cache",),
        how=How.WRAPPED,
        when=When.PLUGIN_LOAD,
        until="0.34.0",
        why="allocate_kv_cache makes the worker's KV tensors (one buffer cut by create_kv_cache_views); "
        "kvcached returns the same views over its own range",
        factory="kvcached.vllm.worker.hooks:wrap_allocate_kv_cache",
    ),
    Patch(
        name="KV cache on kvcached pages (allocate=)",
        process="worker",
        module="vllm.v1.worker.utils",
        owner=None,
        attrs=("allocate_kv_cache",),
        how=How.WRAPPED,
        when=When.PLUGIN_LOAD,
        since="0.34.0",
        why="from vLLM 0.34 the V2 runner's init_kv_cache passes allocate=, the buffer maker that the "
        "extensible KV cache (vllm/v1/worker/extensible_kv_cache.py) replaces; kvcached turns that cache "
        "off at startup, so only vLLM's plain maker (None) is served and any other is refused",
        factory="kvcached.vllm.worker.hooks:wrap_allocate_kv_cache_with_allocate",
    ),
    Patch(
        name="KV cache on kvcached pages (V1 runner's import)",
        process="worker",
        module="vllm.v1.worker.gpu_model_runner",
        owner=None,
        attrs=("allocate_kv_cache",),
        how=How.WRAPPED,
        when=When.PLUGIN_LOAD,
        optional=True,
        loaded_only=True,
        until="0.34.0",
        why="GPUModelRunner imports allocate_kv_cache by name; a runner module loaded before the plugin "
        "holds vLLM's function, so its name is rebound too (the V1 runner is gone in vLLM 0.34)",
        factory="kvcached.vllm.worker.hooks:rebind_allocate_kv_cache",
    ),
    Patch(
        name="KV cache on kvcached pages (V2 runner's import)",
        process="worker",
        module="vllm.v1.worker.gpu.attn_utils",
        owner=None,
        attrs=("allocate_kv_cache",),
        how=How.WRAPPED,
        when=When.PLUGIN_LOAD,
        optional=True,
        loaded_only=True,
        why="the V2 model runner (vllm/v1/worker/gpu/) imports allocate_kv_cache by name, as the V1 one",
        factory="kvcached.vllm.worker.hooks:rebind_allocate_kv_cache",
    ),
    Patch(
        name="page decisions applied before each step",
        process="worker",
        module="vllm.v1.worker.gpu_model_runner",
        owner="GPUModelRunner",
        attrs=("execute_model",),
        how=How.WRAPPED,
        when=When.KV_ALLOCATION,
        loaded_only=True,
        until="0.34.0",
        why="GPUModelRunner.execute_model is where every executor's worker path ends (Ray's "
        "execute_model_ray included; the CPU build's CPUModelRunner subclasses it): the step's "
        "SchedulerOutput carries the scheduler's page decisions, applied before the forward",
        factory="kvcached.vllm.worker.step_receiver:wrap_execute_model",
    ),
    Patch(
        name="page decisions applied before each step (V2 runner, opt-in)",
        process="worker",
        module="vllm.v1.worker.gpu.model_runner",
        owner="GPUModelRunner",
        attrs=("execute_model",),
        how=How.WRAPPED,
        when=When.KV_ALLOCATION,
        optional=True,
        loaded_only=True,
        until="0.34.0",
        why="the V2 model runner's execute_model (VLLM_USE_V2_MODEL_RUNNER=1 before vLLM 0.34)",
        factory="kvcached.vllm.worker.step_receiver:wrap_execute_model",
    ),
    Patch(
        name="page decisions applied before each step (V2 runner)",
        process="worker",
        module="vllm.v1.worker.gpu.model_runner",
        owner="GPUModelRunner",
        attrs=("execute_model",),
        how=How.WRAPPED,
        when=When.KV_ALLOCATION,
        loaded_only=True,
        since="0.34.0",
        why="vLLM 0.34 removed the V1 runner: the V2 runner's execute_model is every worker's step "
        "(the CPU build's CPUModelRunner in vllm/v1/worker/cpu/ subclasses it)",
        factory="kvcached.vllm.worker.step_receiver:wrap_execute_model",
    ),
    # --- engine core: process-wide -----------------------------------------------------------
    Patch(
        name="kvcached under the scheduler",
        process="engine core",
        module=_CORE,
        owner="Scheduler",
        attrs=("__init__",),
        how=How.WRAPPED,
        when=When.PLUGIN_LOAD,
        why="Scheduler.__init__ builds the KVCacheManager, its BlockPool and the scheduler-side connector; "
        "right after it, before the first request, kvcached's engine is built under them (AsyncScheduler "
        "inherits it)",
        factory="kvcached.vllm.engine_core.served:wrap_scheduler_init",
    ),
    Patch(
        name="idle engine sends decisions; kvctl wakes it",
        process="engine core",
        module="vllm.v1.engine.core",
        owner="EngineCoreProc",
        attrs=("run_busy_loop",),
        how=How.WRAPPED,
        when=When.PLUGIN_LOAD,
        why="EngineCoreProc.run_busy_loop starts after EngineCore.__init__, in which a spawned engine core "
        "loads the plugins (too late to wrap that constructor); from there has_work is shadowed",
        factory="kvcached.vllm.engine_core.step_sender:wrap_run_busy_loop",
    ),
    # --- engine core: the objects of one engine ----------------------------------------------
    Patch(
        name="the engine's lock and drain around each KV call",
        process="engine core",
        module=_CORE,
        owner="Scheduler",
        attrs=SCHEDULER_CALLS,
        how=How.SHADOWED,
        when=When.ENGINE_BUILD,
        why="kvctl's limit and status arrive on the ledger service's thread and must fall between two "
        "scheduler calls; the allocator drains once at the end of each call, as Scheduler.schedule drains "
        "BlockPool.take_events once a step; shutdown closes the ledger service",
    ),
    Patch(
        name="the engine, found by kvcached",
        process="engine core",
        module=_CORE,
        owner="Scheduler",
        attrs=("kvcached_engine",),
        how=How.ADDED,
        when=When.ENGINE_BUILD,
        why="the one place kvcached's state for a scheduler hangs (engine_core.engine.engine_of)",
    ),
    Patch(
        name="offloading bridge",
        process="engine core",
        module=_CONNECTOR,
        owner="OffloadingConnector",
        attrs=CONNECTOR_CALLS,
        how=How.SUBCLASSED,
        when=When.ENGINE_BUILD,
        why="the scheduler-side OffloadingConnector's calls say which blocks a store or load job copies "
        "and when every worker reported it (kvcached PR #598's freed-block copies); vLLM builds kvcached's "
        "subclass (engine_core.connector) because KVConnectorFactory.get_connector_class takes the class from "
        "kv_transfer_config.kv_connector_module_path, which the startup patch sets",
    ),
    Patch(
        name="prefix-cache reset and fresh blocks, recorded",
        process="engine core",
        module=_POOL,
        owner="BlockPool",
        attrs=("reset_prefix_cache", "get_new_blocks"),
        how=How.SHADOWED,
        when=When.ENGINE_BUILD,
        why="BlockPool.reset_prefix_cache frees every cached block (recorded before those frees); "
        "get_new_blocks tells a request's fresh blocks from its prefix hits (the ledger's I5)",
    ),
    Patch(
        name="page-aware block pool",
        process="engine core",
        module=_POOL,
        owner="BlockPool",
        attrs=POOL_CALLS,
        how=How.SHADOWED,
        when=When.ENGINE_BUILD,
        why="BlockPool hands out the head of one LRU queue, blind to pages; kvcached chooses the blocks "
        "(partly used pages first) and lets vLLM's get_new_blocks hand them out (engine_core.pool_seam)",
    ),
    Patch(
        name="page decisions ride the step",
        process="engine core",
        module="vllm.v1.core.sched.output",
        owner="SchedulerOutput",
        attrs=("kvcached_page_ops",),
        how=How.ADDED,
        when=When.ENGINE_BUILD,
        why="vLLM sends each SchedulerOutput whole to every worker (shm_broadcast.MessageQueue.enqueue "
        "pickles its __dict__; Ray's compiled graph; the uni executor hands the object)",
    ),
    Patch(
        name="idle engine flushes decisions",
        process="engine core",
        module="vllm.v1.engine.core",
        owner="EngineCoreProc",
        attrs=("has_work",),
        how=How.SHADOWED,
        when=When.BUSY_LOOP,
        why="EngineCoreProc._process_input_queue blocks on its input queue while has_work() is false: an "
        "idle engine first sends pending page decisions through collective_rpc",
    ),
)

# Names kvcached reads on vLLM's objects without changing them, beyond their public methods:
# checked like the patches' targets (``engine_core.pool_seam`` says why each is needed).
RELIED_ON: Final = (
    Patch(
        name="pool seam",
        process="engine core",
        module=_POOL,
        owner="BlockPool",
        attrs=("_reuse_watchers", "_notify_reuse", "free_block_queue", "blocks", "null_block", "evict_blocks"),
        how=How.READ,
        when=When.ENGINE_BUILD,
        why="BlockPool.get_new_blocks hands out the head of free_block_queue; _notify_reuse tells "
        "unpin_blocks' watchers (vLLM 0.32 and 0.33, vllm/v1/core/block_pool.py)",
    ),
    Patch(
        name="free queue seam",
        process="engine core",
        module="vllm.v1.core.kv_cache_utils",
        owner="FreeKVCacheBlockQueue",
        attrs=("remove", "prepend_n", "popleft_n", "num_free_blocks"),
        how=How.READ,
        when=When.ENGINE_BUILD,
        why="the page-aware pool moves its choice to the queue's head before vLLM pops it",
    ),
    # Read with a fallback (``getattr``): a vLLM without them is not refused, only slower.
    Patch(
        name="free queue head",
        process="engine core",
        module="vllm.v1.core.kv_cache_utils",
        owner="FreeKVCacheBlockQueue",
        attrs=("fake_free_list_head",),
        how=How.READ,
        when=When.ENGINE_BUILD,
        optional=True,
        why="pool_seam._to_move walks the queue from its sentinel head to skip moving blocks already at "
        "its head; without it they are moved (vLLM 0.32 and 0.33, vllm/v1/core/kv_cache_utils.py)",
    ),
    Patch(
        name="free queue links",
        process="engine core",
        module="vllm.v1.core.kv_cache_utils",
        owner="KVCacheBlock",
        attrs=("next_free_block",),
        how=How.READ,
        when=When.ENGINE_BUILD,
        optional=True,
        why="the walk's next link, KVCacheBlock's slot (vLLM 0.32 and 0.33, vllm/v1/core/kv_cache_utils.py)",
    ),
    Patch(
        name="block hash field",
        process="engine core",
        module="vllm.v1.core.kv_cache_utils",
        owner="KVCacheBlock",
        attrs=("_block_hash",),
        how=How.READ,
        when=When.ENGINE_BUILD,
        until="0.34.0",
        why="the page-aware pool's free_blocks reads the field that KVCacheBlock.block_hash returns, for "
        "each block a step frees, without the property's call (vllm/v1/core/kv_cache_utils.py)",
    ),
    Patch(
        name="block hash field (0.34)",
        process="engine core",
        module="vllm.v1.core.kv_cache_utils",
        owner="KVCacheBlock",
        attrs=("block_hash",),
        how=How.READ,
        when=When.ENGINE_BUILD,
        since="0.34.0",
        why="vLLM 0.34 made block_hash the dataclass field itself (beside block_hash_num_tokens): the "
        "page-aware pool's free_blocks reads it",
    ),
)


class PatchError(ConfigError):
    """vLLM lacks an attribute kvcached patches or relies on: this vLLM is not one kvcached knows."""


def by_name(name: str) -> Patch:
    for p in (*PATCHES, *RELIED_ON):
        if p.name == name:
            return p
    raise KeyError(name)


def holding(*names: str) -> Patch:
    """Of the rows ``names`` (one target's forms over the releases), the one for this vLLM."""
    version = vllm_version()
    for name in names:
        p = by_name(name)
        if p.holds_for(version):
            return p
    raise PatchError(f"kvcached does not know this vLLM ({version}): none of {', '.join(names)} holds for it")


def on_cpu() -> bool:
    """Whether this is vLLM's CPU build (its platform), where the host backend serves."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # a stand-in object in a test, or a broken install: the target says enough
        return "unknown"


def _refusal(patch: Patch, target: str) -> PatchError:
    return PatchError(
        f"kvcached does not know this vLLM ({vllm_version()}): {target} is missing ({patch.name}; known for "
        f"vLLM {patch.range}, tested on {', '.join(TESTED)}); install one of those or disable kvcached "
        "(ENABLE_KVCACHED=0)"
    )


def check(patches: Iterable[Patch]) -> list[tuple[Patch, Any]]:
    """Every target of ``patches`` (process-wide ones) that holds for this vLLM, found or
    refused; returns (patch, owner) for those present, in order. Changes nothing.

    NOTE: each installer first checks every target of what it is about to install, so that a
    vLLM which moved one refuses in one line naming the target and the version found, before
    anything has changed."""
    return present(patches, vllm_version(), _refusal)


def _factory(patch: Patch) -> Callable[..., Any]:
    assert patch.factory is not None, patch.name
    module, _, fn = patch.factory.partition(":")
    return getattr(importlib.import_module(module), fn)  # type: ignore[no-any-return]


_INSTALLED: list[str] = []  # what this process changed, in order, for the active line


def install(when: When, context: Any) -> None:
    """Install the process-wide patches of ``when``: every target checked first, then each
    wrapped (``factory(original, context)``) unless a wrapper of kvcached's is already there."""
    for p, owner in check(q for q in PATCHES if q.when is when and q.how is How.WRAPPED):
        (attr,) = p.attrs
        original = getattr(owner, attr)
        if getattr(original, SENTINEL, None) is not None:
            continue
        replacement = _factory(p)(original, context)
        if replacement is None:  # the factory found nothing to change (a rebinding of a name not held)
            continue
        if getattr(replacement, SENTINEL, None) is None:  # a rebinding reuses a wrapper already named
            setattr(replacement, SENTINEL, p.name)
        setattr(owner, attr, replacement)
        _INSTALLED.append(p.targets()[0].removeprefix("vllm."))


def check_object(obj: Any, patch: Patch) -> None:
    """Refuse an object that lacks an attribute ``patch`` shadows or relies on, or that carries it."""
    if installed_on(obj, patch):
        raise ConfigError(f"kvcached's {patch.name} is already installed on this {type(obj).__name__}")
    if patch.how is How.ADDED:
        return
    for attr, target in zip(patch.attrs, patch.targets(), strict=True):
        if not hasattr(obj, attr):
            raise _refusal(patch, target)


def shadow(obj: Any, patch: Patch, replacements: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """Shadow ``obj``'s bound methods named by ``patch`` with ``replacements`` (checked with
    ``check_object`` beforehand) and return the originals; marks ``obj`` with the sentinel."""
    assert set(replacements) <= set(patch.attrs), (patch.name, set(replacements) - set(patch.attrs))
    originals = {name: getattr(obj, name) for name in replacements}
    for name, fn in replacements.items():
        setattr(obj, name, fn)
    mark(obj, patch)
    return originals


def installed_on(obj: Any, patch: Patch) -> bool:
    """Whether ``patch`` is installed on ``obj`` (``shadow`` or ``mark`` noted it)."""
    return patch.name in getattr(obj, SENTINEL, ())


def mark(obj: Any, patch: Patch) -> None:
    """Note on ``obj`` that ``patch`` is installed on it (``shadow`` does it; an ``ADDED`` patch too)."""
    setattr(obj, SENTINEL, (*getattr(obj, SENTINEL, ()), patch.name))


def installed() -> list[str]:
    """The process-wide patches this process installed (``module.Class.attr``, vLLM's prefix off)."""
    return list(_INSTALLED)


def engine_patches() -> list[Patch]:
    """The patches on the objects of one engine (installed at engine build and busy-loop start)."""
    return [p for p in PATCHES if p.when in (When.ENGINE_BUILD, When.BUSY_LOOP)]
