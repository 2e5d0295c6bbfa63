"""A CPU offloading spec whose worker moves real bytes with torch indexing, on any device.

vLLM's own ``CPUOffloadingSpec`` refuses to build its worker without CUDA (its worker needs CUDA
streams, events and a copy kernel), so on a CPU-only machine the OffloadingConnector can plan
transfers but nothing ever copies a byte, and a freed-block copy cannot be observed. This spec
keeps vLLM's scheduler-side manager and sizing (it subclasses ``CPUOffloadingSpec``) and swaps in
``KvcachedCPUOffloadingWorker``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from ...errors import ConfigError

__all__ = [
    "BlockCopy",
    "CopyFn",
    "KvcachedCPUOffloadingSpec",
    "KvcachedCPUOffloadingWorker",
    "TransferPlan",
    "torch_index_copy",
]


@dataclass(frozen=True)
class BlockCopy:
    """The copies of one KV tensor in one job: device row ``device_blocks[i]`` <-> host row
    ``host_rows[i]``, ``num_bytes`` bytes from the start of each row."""

    group: int
    tensor_idx: int
    device_blocks: torch.Tensor  # int64, GPU block ids
    host_rows: torch.Tensor  # int64, rows of the host tensor (chunk * blocks_per_chunk + sub-block)
    num_bytes: int


@dataclass(frozen=True)
class TransferPlan:
    """Everything a copy function needs for one job, resolved from vLLM's specs at submit time."""

    job_id: int
    is_store: bool
    expedited: bool
    device_spec: GPULoadStoreSpec
    host_spec: BlockIDsLoadStoreSpec
    copies: tuple[BlockCopy, ...]

    @property
    def total_bytes(self) -> int:
        return sum(c.num_bytes * int(c.device_blocks.numel()) for c in self.copies)


CopyFn = Callable[[TransferPlan, Sequence[torch.Tensor], Sequence[torch.Tensor]], None]


def torch_index_copy(
    plan: TransferPlan, device_tensors: Sequence[torch.Tensor], host_tensors: Sequence[torch.Tensor]
) -> None:
    """The default copy: gather rows with advanced indexing, move them across devices, scatter."""
    for c in plan.copies:
        dev = device_tensors[c.tensor_idx]
        host = host_tensors[c.tensor_idx]
        n = c.num_bytes
        dev_idx = c.device_blocks.to(dev.device)
        if plan.is_store:
            host[c.host_rows, :n] = dev[dev_idx, :n].to(host.device)
        else:
            dev[dev_idx, :n] = host[c.host_rows, :n].to(dev.device)


@dataclass
class _Pending:
    plan: TransferPlan
    due_tick: int
    copied: bool = False
    seconds: float = 0.0
    failed: bool = False


@dataclass
class _Counters:
    stores: int = 0
    loads: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    waits: list[frozenset[int]] = field(default_factory=list)


class KvcachedCPUOffloadingWorker(OffloadingWorker):  # type: ignore[misc,unused-ignore]
    """Copies blocks between the registered KV tensors and host tensors with torch indexing.

    ``tick`` counts ``get_finished`` calls: the worker connector makes exactly one per engine
    step, so a job submitted in step N with ``delay_steps = d`` is reported in step N + d.

    NOTE: it copies blocks between the KV tensors that the worker connector registers and
    private host tensors by advanced indexing. The timing follows vLLM's worker contract, not our
    convenience: a store's bytes are read when ``submit_store`` is called (the worker connector
    defers that to the start of the next engine step), a load's bytes are written when
    ``submit_load`` is called. Completion is reported only through ``get_finished``, which the
    worker connector turns into ``OffloadingWorkerMetadata.completed_jobs``.

    NOTE: a worker can be told to report ``delay_steps`` steps late (one ``get_finished`` call
    per engine step), and then by default also to copy only when it reports
    (``copy_at_completion``), the latest moment a real asynchronous DMA may touch the memory.
    ``wait`` forces pending copies, as vLLM's flush of reallocated blocks does. The copy function
    and post-copy observers are attributes (``copy_fn``, ``observers``), so a harness can watch
    or replace them.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int) -> None:
        if blocks_per_chunk < 1:
            raise ConfigError(f"kv offloading: blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        if num_chunks < 1:
            raise ConfigError(
                "kv offloading: the CPU tier holds no chunk; raise cpu_bytes_to_use in kv_connector_extra_config"
            )
        if not kv_caches.tensors:
            raise ConfigError("kv offloading: the worker connector registered no KV tensor")
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = num_chunks
        self.device_tensors: list[torch.Tensor] = []
        self.host_tensors: list[torch.Tensor] = []
        for i, entry in enumerate(kv_caches.tensors):
            t = entry.tensor
            if t.ndim != 2 or t.element_size() != 1 or t.stride(1) != 1:
                raise ConfigError(
                    f"kv offloading: KV tensor {i} must be (num_blocks, bytes) with 1-byte elements and unit "
                    f"inner stride, got shape {tuple(t.shape)} stride {t.stride()} dtype {t.dtype}"
                )
            if t.shape[1] < entry.page_size_bytes:
                raise ConfigError(
                    f"kv offloading: KV tensor {i} rows hold {t.shape[1]} bytes, less than its page "
                    f"({entry.page_size_bytes} bytes)"
                )
            self.device_tensors.append(t)
            # One host row per device-sized page: chunk c is rows [c * bpc, (c + 1) * bpc).
            self.host_tensors.append(
                torch.zeros((num_chunks * blocks_per_chunk, entry.page_size_bytes), dtype=t.dtype, device="cpu")
            )
        self.group_refs = kv_caches.group_data_refs
        for g, refs in enumerate(self.group_refs):
            for ref in refs:
                if not 0 <= ref.tensor_idx < len(self.device_tensors):
                    raise ConfigError(
                        f"kv offloading: group {g} names KV tensor {ref.tensor_idx}, which does not exist"
                    )
                if ref.page_size_bytes > kv_caches.tensors[ref.tensor_idx].page_size_bytes:
                    raise ConfigError(
                        f"kv offloading: group {g} copies {ref.page_size_bytes} bytes per block from KV tensor "
                        f"{ref.tensor_idx}, whose page is {kv_caches.tensors[ref.tensor_idx].page_size_bytes} bytes"
                    )
        # What a harness may change between steps.
        self.copy_fn: CopyFn = torch_index_copy
        self.observers: list[Callable[[TransferPlan], None]] = []
        # A job this names is not copied and is reported failed (TransferResult.success False,
        # which vLLM 0.34's worker connector passes on as OffloadingWorkerMetadata.failed_jobs):
        # a transfer error, for the tests of what a failed job leaves behind.
        self.fails: Callable[[TransferPlan], bool] | None = None
        self.delay_steps = 0
        self.copy_at_completion = True
        self.tick = 0
        self.counters = _Counters()
        self._pending: deque[_Pending] = deque()

    # --- planning ------------------------------------------------------------------------------

    def plan(
        self,
        job_id: int,
        device_spec: LoadStoreSpec,
        host_spec: LoadStoreSpec,
        *,
        is_store: bool,
        expedited: bool = False,
    ) -> TransferPlan:
        """Resolve vLLM's specs into per-tensor row pairs; raises ValueError on a malformed pair."""
        if not isinstance(device_spec, GPULoadStoreSpec):
            device_spec = self._spec_of_pointers(job_id, device_spec)
        if not isinstance(host_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"job {job_id}: host side must be a block-id spec, got {type(host_spec).__name__}")
        sizes = list(device_spec.group_sizes)
        starts = list(device_spec.block_indices)
        if len(sizes) != len(self.group_refs):
            raise ValueError(f"job {job_id}: spec has {len(sizes)} KV groups, the worker has {len(self.group_refs)}")
        bpc = self.blocks_per_chunk
        dev_ids = np.asarray(device_spec.block_ids, dtype=np.int64)
        chunk_ids = np.asarray(host_spec.block_ids, dtype=np.int64)
        dev_off = chunk_off = 0
        copies: list[BlockCopy] = []
        for g, (n, first) in enumerate(zip(sizes, starts, strict=True)):
            if n == 0:
                continue
            # The first device block may sit in the middle of its chunk: skip that many sub-blocks.
            skip = int(first) % bpc
            num_group_chunks = -(-(skip + n) // bpc)
            if dev_off + n > len(dev_ids) or chunk_off + num_group_chunks > len(chunk_ids):
                raise ValueError(f"job {job_id}: group {g} runs past the spec's block lists")
            logical = np.arange(skip, skip + n, dtype=np.int64)
            rows = chunk_ids[chunk_off + logical // bpc] * bpc + logical % bpc
            if rows.size and (rows.min() < 0 or rows.max() >= self.num_chunks * bpc):
                raise ValueError(f"job {job_id}: group {g} names a chunk outside the CPU tier")
            dev = torch.from_numpy(dev_ids[dev_off : dev_off + n].copy())
            host = torch.from_numpy(rows)
            for ref in self.group_refs[g]:
                copies.append(BlockCopy(g, ref.tensor_idx, dev, host, ref.page_size_bytes))
            dev_off += n
            chunk_off += num_group_chunks
        if dev_off != len(dev_ids) or chunk_off != len(chunk_ids):
            raise ValueError(
                f"job {job_id}: spec lists {len(dev_ids)} device blocks and {len(chunk_ids)} chunks, "
                f"groups cover {dev_off} and {chunk_off}"
            )
        return TransferPlan(job_id, is_store, expedited, device_spec, host_spec, tuple(copies))

    def _spec_of_pointers(self, job_id: int, ptrs: Any) -> GPULoadStoreSpec:
        """The block-id spec that vLLM 0.34 resolved into ``DevicePointers`` before submitting
        (``pointer_utils.resolve_device_pointers``: ``base + block_id * row_stride``, per group
        and data ref, groups without blocks left out): read back from each group's first data
        ref, so that a plan, its observers and the harness name blocks, not addresses."""
        if not hasattr(ptrs, "ptrs") or not hasattr(ptrs, "group_block_counts"):
            raise TypeError(
                f"job {job_id}: device side must be a GPULoadStoreSpec or DevicePointers, got {type(ptrs).__name__}"
            )
        counts = [int(n) for n in ptrs.group_block_counts]
        if len(counts) != len(self.group_refs):
            raise ValueError(f"job {job_id}: spec has {len(counts)} KV groups, the worker has {len(self.group_refs)}")
        addresses = np.asarray(ptrs.ptrs, dtype=np.uint64)
        ids: list[np.ndarray] = []
        at = 0
        for g, n in enumerate(counts):
            if n == 0:
                continue
            t = self.device_tensors[self.group_refs[g][0].tensor_idx]
            first = addresses[at : at + n].astype(np.int64) - t.data_ptr()
            stride = int(t.stride(0))  # bytes: the tensor has 1-byte elements (checked at __init__)
            if first.size != n or (first % stride).any() or first.min() < 0 or first.max() >= t.shape[0] * stride:
                raise ValueError(f"job {job_id}: group {g}'s device pointers are not rows of its KV tensor")
            ids.append(first // stride)
            at += n * int(ptrs.group_data_ref_counts[g])
        block_ids = np.concatenate(ids).tolist() if ids else []
        return GPULoadStoreSpec(block_ids, counts, [int(i) for i in ptrs.block_indices])

    # --- OffloadingWorker ----------------------------------------------------------------------

    # NOTE: from vLLM 0.34 the device side arrives as DevicePointers (resolved by the worker
    # connector at submit time, still after the step that freed the blocks): ``plan`` reads the
    # block ids back. Before, it was the GPULoadStoreSpec itself.
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        self._submit(self.plan(job_id, src_spec, dst_spec, is_store=True))
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, expedited: bool = False) -> bool:
        self._submit(self.plan(job_id, dst_spec, src_spec, is_store=False, expedited=expedited))
        return True

    def get_finished(self) -> list[TransferResult]:
        results: list[TransferResult] = []
        # In submission order, like vLLM's chained streams: a job never reports before an older one.
        while self._pending and self._pending[0].due_tick <= self.tick:
            p = self._pending.popleft()
            self._execute(p)
            results.append(TransferResult(p.plan.job_id, not p.failed, p.plan.total_bytes, p.seconds))
        self.tick += 1
        return results

    def wait(self, job_ids: set[int]) -> None:
        # Waiting on a job completes it and everything submitted before it (ordered streams).
        self.counters.waits.append(frozenset(job_ids))
        last = max((i for i, p in enumerate(self._pending) if p.plan.job_id in job_ids), default=-1)
        for i in range(last + 1):
            p = self._pending[i]
            self._execute(p)
            p.due_tick = min(p.due_tick, self.tick)

    def shutdown(self) -> None:
        for p in self._pending:
            self._execute(p)
        self._pending.clear()

    # --- internals ----------------------------------------------------------------------------

    @property
    def pending_job_ids(self) -> list[int]:
        return [p.plan.job_id for p in self._pending]

    def _submit(self, plan: TransferPlan) -> None:
        p = _Pending(plan, self.tick + max(0, self.delay_steps))
        self._pending.append(p)
        if self.delay_steps <= 0 or not self.copy_at_completion:
            self._execute(p)

    def _execute(self, p: _Pending) -> None:
        if p.copied:
            return
        if self.fails is not None and self.fails(p.plan):
            p.copied = p.failed = True  # nothing moved: the copy failed
            return
        t0 = time.perf_counter()
        self.copy_fn(p.plan, self.device_tensors, self.host_tensors)
        p.seconds = time.perf_counter() - t0
        p.copied = True
        if p.plan.is_store:
            self.counters.stores += 1
            self.counters.bytes_stored += p.plan.total_bytes
        else:
            self.counters.loads += 1
            self.counters.bytes_loaded += p.plan.total_bytes
        for observer in self.observers:
            observer(p.plan)


class KvcachedCPUOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc,unused-ignore]
    """vLLM's CPU spec (manager, sizing, metrics) with a worker that needs no CUDA.

    Select it with ``kv_connector_extra_config={"spec_name": "KvcachedCPUOffloadingSpec",
    "spec_module_path": "kvcached.vllm.offload.cpu", "cpu_bytes_to_use": ...}``.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        if not config.extra_config.get("cpu_bytes_to_use"):
            raise ConfigError("kv offloading: set cpu_bytes_to_use in kv_connector_extra_config")
        if config.canonical_layout:
            raise ConfigError(
                "kv offloading: the canonical host layout (canonical_layout) is not supported by kvcached's CPU "
                "worker; remove canonical_layout from kv_connector_extra_config"
            )
        super().__init__(config)
        self._kv_worker: KvcachedCPUOffloadingWorker | None = None

    def _uses_shared_region(self) -> bool:
        # Host tensors are private to each worker, so vLLM's replicated (single-copy) layout,
        # which needs the shared mmap region, never applies.
        return False

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._kv_worker is None:
            if self.replicated_layout:
                raise ConfigError("kv offloading: the replicated (MLA single-copy) host layout is not supported")
            self._kv_worker = KvcachedCPUOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._kv_worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> Any:
        return self.get_worker(kv_caches)
