"""Planted bugs, one named registry: the checks of kvsim and of the served tests are trusted once
they have caught a bug put there on purpose.

Each plant changes one class of an engine or of kvcached when its module is imported, and says
which check must trip. kvsim's variants and the tests select plants by name: in-process with
``planted(...)`` (undone on exit), or in a served engine's processes with ``KVTEST_PLANTS``
through ``install_on_import`` (``tests/serve/plants/sitecustomize.py``), which patches a module
as it is first imported, so a process that never imports it pays nothing. No production class
carries a switch for any of them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any, Final

import msgspec

Undo = Callable[[], None]


class Plant(msgspec.Struct, frozen=True):
    name: str
    target: str  # the module it changes, when that module is imported
    bug: str  # what it breaks, and the check that must see it
    patch: Callable[[ModuleType], Undo]


def _replace(cls: Any, name: str, new: Any) -> Undo:
    old = cls.__dict__[name]
    setattr(cls, name, new)
    return lambda: setattr(cls, name, old)


def _no_poll(module: ModuleType) -> Undo:
    cls = module.Bridge
    reset = cls.cache_reset

    def forget_then_reset(self: Any) -> None:
        self.outstanding.clear()  # trusts the reset's dropping of the acknowledgements, as SGLang does
        reset(self)

    return _replace(cls, "cache_reset", forget_then_reset)


def _no_hold(module: ModuleType) -> Undo:
    cls = module.Bridge
    free = cls.free

    def free_at_once(self: Any, slots: list[int]) -> None:
        held, self.hold_frees = self.hold_frees, False
        try:
            free(self, slots)
        finally:
            self.hold_frees = held

    return _replace(cls, "free", free_at_once)


def _evict_on_free(module: ModuleType) -> Undo:
    cls = module.BlockPool
    free_blocks = cls.free_blocks

    def free_and_evict(self: Any, ordered_blocks: Any) -> None:
        blocks = list(ordered_blocks)
        free_blocks(self, blocks)
        gone = {
            b.block_id
            for b in blocks
            if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None and b.pool in (None, self)
        }
        if gone:
            self.evict_blocks(gone)

    return _replace(cls, "free_blocks", free_and_evict)


def _zero_loads(module: ModuleType) -> Undo:
    cls = module.KvcachedCPUOffloadingWorker
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        copy = self.copy_fn

        def copy_then_zero(plan: Any, device_tensors: Any, host_tensors: Any) -> None:
            copy(plan, device_tensors, host_tensors)
            if not plan.is_store:
                for c in plan.copies:
                    dev = device_tensors[c.tensor_idx]
                    dev[c.device_blocks.to(dev.device), : c.num_bytes] = 0

        self.copy_fn = copy_then_zero

    return _replace(cls, "__init__", __init__)


def _foreign_store(module: ModuleType) -> Undo:
    cls = module.KvcachedCPUOffloadingWorker
    plan = cls.plan

    def plan_block_1_first(self: Any, job_id: int, device_spec: Any, host_spec: Any, **kw: Any) -> Any:
        if not isinstance(device_spec, module.GPULoadStoreSpec):  # vLLM 0.34 passes DevicePointers
            device_spec = self._spec_of_pointers(job_id, device_spec)
        ids = [int(b) for b in device_spec.block_ids]
        if kw.get("is_store") and ids and ids[0] != 1:
            ids[0] = 1
            device_spec = type(device_spec)(ids, device_spec.group_sizes, device_spec.block_indices)
        return plan(self, job_id, device_spec, host_spec, **kw)

    return _replace(cls, "plan", plan_block_1_first)


PLANTS: Final[dict[str, Plant]] = {
    p.name: p
    for p in (
        Plant(
            "no-poll",
            "kvcached.sglang.bridge",
            "the SGLang bridge forgets the copies whose acknowledgements a flush dropped: their pages "
            "stay pinned for ever (I4; kvsim's leftover)",
            _no_poll,
        ),
        Plant(
            "no-hold",
            "kvcached.sglang.bridge",
            "under overlap scheduling the SGLang bridge records a free at once, while the forward "
            "launched before it may still read the slots (kvsim's attended-bytes, unmapped-touch)",
            _no_hold,
        ),
        Plant(
            "evict-on-free",
            "vllm.v1.core.block_pool",
            "native vLLM evicts a block's hash as its last reference goes, as KVCACHED_MAX_CACHED_TOKENS=0 "
            "does: the cache state kvcached's setting makes, for comparing cached-token counts",
            _evict_on_free,
        ),
        Plant(
            "zero-loads",
            "kvcached.vllm.offload.cpu",
            "the CPU offload worker zeroes every block it loads: a corrupted load the served "
            "comparison with native vLLM must see",
            _zero_loads,
        ),
        Plant(
            "foreign-store",
            "kvcached.vllm.offload.cpu",
            "the CPU offload worker stores block 1 in place of each store job's first block: another "
            "request's bytes under this one's key (kvsim's store-bytes)",
            _foreign_store,
        ),
    )
}


def plant(name: str) -> Plant:
    """The plant of that name, or one line naming the plants there are."""
    try:
        return PLANTS[name]
    except KeyError:
        raise ValueError(f"no planted bug {name!r}; one of {', '.join(PLANTS)}") from None


@contextmanager
def planted(*names: str) -> Iterator[None]:
    """The named plants in this process, undone on exit (in the reverse order)."""
    chosen = [plant(n) for n in names]
    undo: list[Undo] = []
    try:
        for p in chosen:
            undo.append(p.patch(importlib.import_module(p.target)))
        yield
    finally:
        for u in reversed(undo):
            u()


class _OnImport(importlib.abc.MetaPathFinder):
    def __init__(self, target: str, plants: list[Plant]) -> None:
        self.target, self.plants = target, plants

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module
        plants = self.plants

        def exec_module(module: ModuleType) -> None:
            execute(module)
            for p in plants:
                p.patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_on_import(names: Iterable[str]) -> None:
    """Plant each named bug in this process when its module is first imported (never undone)."""
    by_target: dict[str, list[Plant]] = {}
    for p in [plant(n) for n in sorted(set(names))]:
        by_target.setdefault(p.target, []).append(p)
    for target, plants in by_target.items():
        if target in sys.modules:
            for p in plants:
                p.patch(sys.modules[target])
        else:
            sys.meta_path.insert(0, _OnImport(target, plants))
