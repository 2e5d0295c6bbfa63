"""Drive one real vLLM Scheduler with the real OffloadingConnector on CPU, moving real bytes.

The freed-block copy bug only shows as wrong *bytes*: a store submitted after its request freed
its blocks reads whatever the allocator left there, and the later load restores that. So this
harness runs vLLM's own ``Scheduler`` and ``OffloadingConnector`` in the engine's order
(``Harness.step``), a model stand-in writes bytes that identify each token, and each load is
checked byte for byte at the moment its copy runs (``Harness._on_copy``).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, resolve_kv_cache_block_sizes
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvcached.errors import ConfigError
from kvcached.testing.stand_in import ModelStandIn, Row
from kvcached.vllm.offload.cpu import KvcachedCPUOffloadingWorker, TransferPlan
from kvcached.vllm.patches import CONNECTOR_MODULE
from kvcached.vllm.testing.kv_specs import KINDS, kind_block_size, layer_specs, plan_kv_cache
from kvcached.vllm.testing.records import FreedBlockCopy, HarnessConfig, LoadCheck, LoadMismatch, StepRecord

__all__ = ["FreedBlockCopy", "Harness", "HarnessConfig", "KVMemory", "LoadCheck", "LoadMismatch", "StepRecord"]

KVMemory = Callable[[int, int], torch.Tensor]
# vLLM 0.34 dropped ModelRunnerOutput.req_id_to_index (the positions follow req_ids).
_INDEXED = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
"""``kv_memory(num_blocks, block_bytes)`` -> uint8 tensor of shape (num_blocks, block_bytes)."""


@dataclass
class _Batch:
    so: SchedulerOutput
    meta: OffloadingConnectorMetadata
    record: StepRecord
    rows: list[Row]
    output: ModelRunnerOutput | None = None  # once its worker side ran


def _write_model_dir(cfg: HarnessConfig, num_layers: int) -> str:
    path = tempfile.mkdtemp(prefix="kvcached-harness-")
    total_kv_heads = cfg.num_kv_heads * cfg.tp  # the spec's num_kv_heads is per TP rank
    hidden = cfg.head_size * 2 * total_kv_heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_attention_heads": hidden // cfg.head_size,
        "num_key_value_heads": total_kv_heads,
        "head_dim": cfg.head_size,
        "num_hidden_layers": num_layers,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_model_len,
        "torch_dtype": "float16",
        "rms_norm_eps": 1e-5,
    }
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    return path


class Harness:
    """One scheduler, ``config.tp`` worker connectors, and the byte-level check of every load.

    Construction order (the engine's): per rank, ``kv_memory(num_blocks, block_bytes)`` then that
    rank's worker connector registers views of it; then the Scheduler (whose constructor builds the
    scheduler-role connector); then ``on_scheduler_built(scheduler)``.

    NOTE: it runs vLLM's own ``Scheduler`` (with its scheduler-role ``OffloadingConnector``) and
    one worker-role ``OffloadingConnector`` per tensor-parallel rank, each over its own KV memory
    and ``KvcachedCPUOffloadingSpec``'s byte-copying worker. The KV memory comes from a provider
    callable, so kvcached can serve it from elastic pages, and ``on_scheduler_built`` lets
    kvcached install its bridge before the first request.

    NOTE: the KV cache is that of a model kind (``kv_specs``: full attention, Gemma3's and
    gpt-oss's windows, Mistral's sliding layers, MLA, Qwen3-Next's Gated DeltaNet state groups),
    grouped and laid out by vLLM's own planner.
    """

    def __init__(
        self,
        config: HarnessConfig | None = None,
        *,
        kv_memory: KVMemory | None = None,
        on_scheduler_built: Callable[[Scheduler], None] | None = None,
    ) -> None:
        self.config = cfg = config or HarnessConfig()
        if cfg.tp < 1:
            raise ConfigError(f"harness: tp must be >= 1, got {cfg.tp}")
        if cfg.sliding_window is not None and cfg.sliding_window < 1:
            raise ConfigError(f"harness: sliding_window must be >= 1 token, got {cfg.sliding_window}")
        if cfg.kind not in KINDS:
            raise ConfigError(f"harness: unknown model kind {cfg.kind!r}; choose from {', '.join(KINDS)}")
        self.block_size = kind_block_size(cfg.kind, cfg.tp, cfg.block_size, cfg.num_kv_heads, cfg.head_size)
        self.layer_specs = layer_specs(
            cfg.kind,
            tp=cfg.tp,
            block_size=self.block_size,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_size=cfg.head_size,
            sliding_window=cfg.sliding_window,
            mamba_cache_mode=cfg.mamba_cache_mode,
        )
        self._model_dir = _write_model_dir(cfg, len(self.layer_specs))
        ours = cfg.kvcached_connector if cfg.kvcached_connector is not None else on_scheduler_built is not None
        self.vllm_config = self._build_vllm_config(kvcached_connector=ours)
        self.kv_cache_config = self._build_kv_cache_config()
        bs, hash_bs = resolve_kv_cache_block_sizes(self.kv_cache_config, self.vllm_config)
        self.kv_cache_config.hash_block_size = hash_bs
        self.model = ModelStandIn(self.block_size, self.real_bytes, cfg.vocab_size, state_groups=self.state_groups)
        self.step_index = 0
        self.history: list[StepRecord] = []
        self.load_checks: list[LoadCheck] = []
        self._mismatches: list[LoadMismatch] = []
        self.freed_block_copies: list[FreedBlockCopy] = []
        self._requests: dict[str, Request] = {}
        self._job_req: dict[int, str] = {}
        # Store job -> (KV group, block position in the request, GPU block id) of each block it
        # copies, in the spec's order: which position's KV each block is stored as.
        self.store_positions: dict[int, tuple[tuple[int, int, int], ...]] = {}
        self._next_req = 0
        self._in_flight: collections.deque[_Batch] = collections.deque()
        self._executing = 0  # the step whose worker side runs now

        # Workers first: the engine allocates KV memory before it builds the scheduler.
        provider = kv_memory or (lambda n, b: torch.zeros((n, b), dtype=torch.uint8))
        self.kv_memory: list[torch.Tensor] = []
        self.workers: list[Any] = []  # worker-role OffloadingConnector per rank
        self.transfer_workers: list[KvcachedCPUOffloadingWorker] = []
        self._layer_views: list[list[list[torch.Tensor]]] = []  # [rank][group][layer]
        for rank in range(cfg.tp):
            self._build_worker(rank, provider)

        # vLLM's CPU platform turns async scheduling off, as its own CPU worker runs each step
        # to the end; the harness runs the engine order of a GPU server (whose scheduler and
        # connector are these same classes), so it asks again after the platform's say.
        self.vllm_config.scheduler_config.async_scheduling = cfg.async_scheduling
        self._queue_size = int(self.vllm_config.max_concurrent_batches)  # the engine core's batch queue
        if self._queue_size != (2 if cfg.async_scheduling else 1):
            raise ConfigError(f"harness: vLLM wants {self._queue_size} batches in flight; only 1 or 2 are modelled")
        scheduler_cls = cast(type[Scheduler], self.vllm_config.scheduler_config.get_scheduler_cls())
        self.scheduler = scheduler_cls(
            vllm_config=self.vllm_config,
            kv_cache_config=copy.deepcopy(self.kv_cache_config),
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=bs,
            hash_block_size=hash_bs,
        )
        assert self.scheduler.connector is not None
        self.aggregator = KVOutputAggregator.from_connector(self.scheduler.connector, cfg.tp)
        init_none_hash(sha256)
        self._block_hasher = get_request_block_hasher(hash_bs, sha256)
        if on_scheduler_built is not None:
            on_scheduler_built(self.scheduler)

    # --- construction -------------------------------------------------------------------------

    def _build_vllm_config(self, *, kvcached_connector: bool) -> VllmConfig:
        cfg = self.config
        model = ModelConfig(
            model=self._model_dir, skip_tokenizer_init=True, max_model_len=cfg.max_model_len, dtype="float16"
        )
        hybrid: dict[str, Any] = {}
        if any(isinstance(s, MambaSpec) for s in self.layer_specs.values()):
            # What vLLM's platform sets for a hybrid model (Platform._align_hybrid_block_size):
            # the mode (validated by CacheConfig: "align" or "none"), the state block (the
            # attention block in "align" mode) and the state page padded to the attention page.
            hybrid = {
                "mamba_cache_mode": cfg.mamba_cache_mode,
                "mamba_block_size": self.block_size,
                "mamba_page_size_padded": max(s.page_size_bytes for s in self.layer_specs.values()),
            }
        cache = CacheConfig(block_size=self.block_size, enable_prefix_caching=True, **hybrid)
        cache.num_gpu_blocks = cfg.num_gpu_blocks
        extra = {
            "spec_name": "KvcachedCPUOffloadingSpec",
            "spec_module_path": "kvcached.vllm.offload.cpu",
            "cpu_bytes_to_use": cfg.cpu_bytes_to_use,
            "blocks_per_chunk": cfg.blocks_per_chunk,
            "offload_prompt_only": False,
            **cfg.extra_config,
        }
        config = VllmConfig(
            model_config=model,
            cache_config=cache,
            device_config=DeviceConfig("cpu"),
            scheduler_config=SchedulerConfig(
                max_model_len=cfg.max_model_len,
                is_encoder_decoder=False,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs,
                async_scheduling=cfg.async_scheduling,
            ),
            parallel_config=ParallelConfig(tensor_parallel_size=cfg.tp),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
                kv_connector_module_path=CONNECTOR_MODULE if kvcached_connector else None,
            ),
        )
        # vLLM turns its hybrid KV cache manager off where the platform does not support it
        # (``current_platform.support_hybrid_kv_cache()``: not on this CPU box) and keeps it on
        # a GPU with the OffloadingConnector (which supports HMA); the harness models the GPU
        # server, so each kind keeps its groups as a GPU engine plans them.
        config.scheduler_config.disable_hybrid_kv_cache_manager = False
        return config

    def _build_kv_cache_config(self) -> KVCacheConfig:
        # vLLM's own grouping and block-outermost layout of the kind's layers (kv_specs): block b
        # is one row of the KV memory holding every layer slot's page; groups overlay the same
        # slots (a block id belongs to one group at a time), as vLLM's hybrid allocator lays them out.
        plan = plan_kv_cache(self.vllm_config, self.layer_specs, self.config.num_gpu_blocks)
        self.page_bytes = plan.page_bytes
        self.block_bytes = plan.block_bytes
        self.group_layer_names = plan.group_layer_names
        self.group_offsets = plan.group_offsets
        self.real_bytes = plan.real_bytes
        self.state_groups = plan.state_groups
        return plan.kv_cache_config

    def _build_worker(self, rank: int, provider: KVMemory) -> None:
        cfg = self.config
        mem = provider(cfg.num_gpu_blocks, self.block_bytes)
        if mem.dtype not in (torch.uint8, torch.int8) or tuple(mem.shape) != (cfg.num_gpu_blocks, self.block_bytes):
            raise ConfigError(
                f"harness: kv_memory must return a uint8 tensor of shape ({cfg.num_gpu_blocks}, {self.block_bytes}), "
                f"got {mem.dtype} {tuple(mem.shape)}"
            )
        if mem.stride() != (self.block_bytes, 1) or mem.storage_offset() != 0:
            # vLLM's worker connector re-derives a packed block from storage offset 0.
            raise ConfigError("harness: kv_memory must return a contiguous tensor that starts its storage")
        mem8 = mem.view(torch.int8)
        page = self.page_bytes
        views = [[mem8[:, off : off + page] for off in offsets] for offsets in self.group_offsets]
        kv_caches = {
            name: views[g][i] for g, names in enumerate(self.group_layer_names) for i, name in enumerate(names)
        }
        # Each rank reads its own rank from the shared config while it builds and registers.
        self.vllm_config.parallel_config.rank = rank
        try:
            conn = KVConnectorFactory.create_connector(
                self.vllm_config, KVConnectorRole.WORKER, copy.deepcopy(self.kv_cache_config)
            )
            conn.register_kv_caches(kv_caches)
        finally:
            self.vllm_config.parallel_config.rank = 0
        worker = cast(Any, conn).connector_worker.worker
        if not isinstance(worker, KvcachedCPUOffloadingWorker):
            raise ConfigError(f"harness: rank {rank} got a {type(worker).__name__}, not kvcached's CPU worker")
        worker.observers.append(functools.partial(self._on_copy, rank))
        self.kv_memory.append(mem)
        self.workers.append(conn)
        self.transfer_workers.append(worker)
        self._layer_views.append(views)

    # --- requests ------------------------------------------------------------------------------

    def make_prompt(self, length: int, seed: int) -> list[int]:
        return self.model.prompt(length, seed)

    def add_request(
        self,
        prompt_len: int | None = None,
        max_tokens: int = 1,
        prompt: Sequence[int] | None = None,
        request_id: str | None = None,
        stop_token_ids: Sequence[int] = (),
    ) -> str:
        """Queue a request; its prompt is ``prompt`` or ``prompt_len`` tokens seeded by its number.
        It ends at ``max_tokens`` or at a token of ``stop_token_ids`` (which the scheduler cannot
        foresee: under async scheduling the request is in the step after, as with an EOS)."""
        req_id = request_id or f"req-{self._next_req}"
        if prompt is None:
            if prompt_len is None:
                raise ValueError("add_request: give prompt_len or prompt")
            prompt = self.make_prompt(prompt_len, self._next_req)
        self._next_req += 1
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, stop_token_ids=list(stop_token_ids) or None
            ),
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        self._requests[req_id] = request
        self.model.add(req_id, prompt)
        self.scheduler.add_request(request)
        return req_id

    def request(self, req_id: str) -> Request:
        return self._requests[req_id]

    def output_tokens(self, req_id: str) -> list[int]:
        return list(self._requests[req_id].output_token_ids)

    # --- stepping ------------------------------------------------------------------------------

    # What a simulator's checks read (kvsim, tools/kvsim/on_vllm): views, never the state itself.
    @property
    def executing_step(self) -> int:
        """The step whose worker side runs now."""
        return self._executing

    def job_request(self, job_id: int) -> str | None:
        """The request a transfer job was built for, or None for a job this harness never saw."""
        return self._job_req.get(job_id)

    def jobs(self) -> Mapping[int, str]:
        """Every transfer job seen so far, with its request."""
        return MappingProxyType(self._job_req)

    def layer_views(self, rank: int, group: int) -> Sequence[torch.Tensor]:
        """One rank's KV tensors of one KV cache group, a view per layer (the harness's own list,
        read-only by its type: kvsim's byte checks ask for it on every copy and forward)."""
        return self._layer_views[rank][group]

    def busy(self) -> bool:
        return bool(self.scheduler.has_requests()) or bool(self._in_flight)

    def step(self) -> StepRecord | None:
        """One call of the engine core's step, in its order. Synchronous: schedule, execute,
        update. Async scheduling (vLLM's batch queue of two): schedule step N+1, then execute
        step N and update from its output, so a request finishes, and frees its blocks, after the
        step that follows its last was already scheduled. Step N's worker side runs as late as
        the engine allows (after update N-1, after N+1 was scheduled), where a copy submitted in
        step N may run after the frees of N-1, or with ``worker_at_schedule`` right after its
        schedule. Returns the step it scheduled, or None when the call only finished an earlier
        step.

        NOTE: one synchronous step is, in the engine's order: schedule (which builds the connector
        metadata); per worker (``_run_worker``): handle_preemptions, bind, forward, start_load_kv,
        wait_for_save, get_finished, build_connector_worker_meta, clear; vLLM's
        ``KVOutputAggregator``; ``update_from_output``. With async scheduling the order is that of
        the engine core's batch queue (vLLM's ``AsyncScheduler``): step N+1 is scheduled before
        step N's output is processed."""
        assert len(self._in_flight) < self._queue_size
        record: StepRecord | None = None
        if self.scheduler.has_requests():
            batch = self._schedule()
            record = batch.record
            if self.config.worker_at_schedule:
                batch.output = self._execute(batch)
            self._in_flight.appendleft(batch)
            if len(self._in_flight) < self._queue_size and (
                batch.so.total_num_scheduled_tokens > 0 or self.scheduler.has_requests()
            ):
                return record
        elif not self._in_flight:
            return None
        batch = self._in_flight.pop()
        self.scheduler.update_from_output(batch.so, batch.output if batch.output is not None else self._execute(batch))
        return record

    def _schedule(self) -> _Batch:
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        if not isinstance(meta, OffloadingConnectorMetadata):
            raise RuntimeError(f"harness: expected OffloadingConnectorMetadata, got {type(meta).__name__}")
        record = StepRecord(
            step=self.step_index,
            num_scheduled_tokens=dict(so.num_scheduled_tokens),
            finished_req_ids=frozenset(so.finished_req_ids),
            preempted_req_ids=frozenset(so.preempted_req_ids or ()),
            load_jobs={j: t.req_id for j, t in meta.load_jobs.items()},
            store_jobs={j: (t.req_id, tuple(int(b) for b in t.src_spec.block_ids)) for j, t in meta.store_jobs.items()},
            jobs_to_flush=frozenset(meta.jobs_to_flush or ()),
        )
        for j, (_, ids) in record.store_jobs.items():
            if free := self._free_in_pool(ids):
                record.stores_of_free_blocks[j] = free
        for j, job in meta.store_jobs.items():
            if (pos := self._store_positions(j, job)) is not None:
                self.store_positions[j] = pos
        self._job_req.update(record.load_jobs)
        self._job_req.update({j: r for j, (r, _) in record.store_jobs.items()})
        # What the model runner is told at schedule time: each request's token range and block
        # table, and whether the step samples (the end reaches the tokens the scheduler knows of;
        # under async scheduling those lag, so every decode samples).
        rows = []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            end = req.num_computed_tokens  # already advanced by schedule()
            table = tuple(list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(req_id))
            rows.append(Row(req_id, end - n, end, table, end >= req.num_tokens))
        self.history.append(record)
        self.step_index += 1
        return _Batch(so, meta, record, rows)

    def _execute(self, batch: _Batch) -> ModelRunnerOutput:
        self._executing = batch.record.step
        sampled = self.model.sample(batch.rows)
        outputs = [self._run_worker(rank, batch, sampled) for rank in range(len(self.workers))]
        aggregated = self.aggregator.aggregate(outputs)
        assert aggregated is not None
        kvo = aggregated.kv_connector_output
        worker_meta = kvo.kv_connector_worker_meta if kvo is not None else None
        batch.record.completed_jobs = dict(getattr(worker_meta, "completed_jobs", None) or {})
        return aggregated

    def run_until_idle(self, max_steps: int = 200) -> int:
        """Step while the scheduler has requests, the connector has jobs out or a step's output
        is still to be processed; returns the steps."""
        n = 0
        while self.busy():
            if n >= max_steps:
                raise RuntimeError(f"harness: still busy after {max_steps} steps")
            self.step()
            n += 1
        return n

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Reset the GPU prefix cache only; the CPU tier keeps what it stored."""
        return bool(
            self.scheduler.reset_prefix_cache(reset_running_requests=reset_running_requests, reset_connector=False)
        )

    def delay_worker(self, rank: int, steps: int, copy_at_completion: bool = True) -> None:
        """Rank ``rank`` reports each job ``steps`` steps after it submits it (and by default copies
        only then, the latest a real asynchronous copy may touch the memory)."""
        w = self.transfer_workers[rank]
        w.delay_steps = steps
        w.copy_at_completion = copy_at_completion

    def _run_worker(self, rank: int, batch: _Batch, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
        conn = self.workers[rank]
        so = batch.so
        # Each real worker deserializes its own copy; handle_preemptions pops from store_jobs.
        meta = copy.deepcopy(batch.meta)
        conn.handle_preemptions(meta)
        conn.bind_connector_metadata(meta)
        # vLLM 0.33 starts loads before the forward only when some load is synchronous.
        if so.has_sync_kv_loads:
            conn.start_load_kv(None)
        self.model.forward(batch.rows, self._layer_views[rank], rank)
        if not so.has_sync_kv_loads:
            conn.start_load_kv(None)
        conn.wait_for_save()
        results = conn.get_transfer_results(so.finished_req_ids)
        kvo = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=conn.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=conn.build_connector_worker_meta(),
        )
        conn.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        extra: dict[str, Any] = {}
        if _INDEXED:  # vLLM before 0.34 also took the request ids' positions
            extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            kv_connector_output=kvo,
            **extra,
        )

    def _store_positions(self, job_id: int, job: Any) -> tuple[tuple[int, int, int], ...] | None:
        """The request position each block of a store job is stored as, from the connector's own
        state right after the build: the chunks whose offload keys the job stores, in chunk order,
        and the non-null blocks of each. A store's blocks are not always contiguous from the
        spec's ``block_indices`` (as ``GPULoadStoreSpec``'s docstring says they are): when the CPU
        tier already holds a middle chunk's key, ``prepare_store`` leaves it out and the build
        skips that chunk's blocks, and the copy (which uses ``block_indices`` only modulo the
        chunk size) stores each block under its own chunk's key. None when the connector's state
        does not reproduce the spec's block list (then the spec's contiguous reading is used)."""
        cs = getattr(self.scheduler.connector, "connector_scheduler", None)
        status = getattr(cs, "_req_status", {}).get(job.req_id)
        keys = getattr(getattr(cs, "_jobs", {}).get(job_id), "keys", None)
        if cs is None or status is None or keys is None:
            return None
        bpc = int(cs.config.blocks_per_chunk)
        out: list[tuple[int, int, int]] = []
        sizes: list[int] = []
        for g, state in enumerate(status.group_states):
            n = 0
            for c, key in enumerate(state.offload_keys):
                if key not in keys:
                    continue
                for k in range(c * bpc, min((c + 1) * bpc, len(state.block_ids))):
                    if state.block_ids[k] != 0:
                        out.append((g, k, int(state.block_ids[k])))
                        n += 1
            sizes.append(n)
        spec = job.src_spec
        if [b for _, _, b in out] != [int(b) for b in spec.block_ids] or sizes != [int(n) for n in spec.group_sizes]:
            return None
        return tuple(out)

    # --- load verification ---------------------------------------------------------------------

    def _free_in_pool(self, block_ids: Sequence[int]) -> tuple[int, ...]:
        blocks = getattr(self.scheduler.kv_cache_manager.block_pool, "blocks", None)
        if blocks is None:  # a replaced pool that does not expose vLLM's block list
            return ()
        return tuple(b for b in block_ids if getattr(blocks[b], "ref_cnt", 1) == 0)

    def _on_copy(self, rank: int, plan: TransferPlan) -> None:
        """Each copy as it runs: a store of a freed block is noted, a load is checked byte for byte.

        NOTE: the model stand-in (``stand_in.py``) writes, for every token the step computes,
        bytes that identify the token's prefix, KV group, layer and TP rank; each load is checked
        against them at the moment its copy runs."""
        req_id = self._job_req.get(plan.job_id, "?")
        if plan.is_store:
            if free := self._free_in_pool([int(b) for b in plan.device_spec.block_ids]):
                self.freed_block_copies.append(FreedBlockCopy(self._executing, rank, plan.job_id, req_id, free))
            return
        if req_id not in self._requests:
            raise RuntimeError(f"harness: load job {plan.job_id} was never seen in a step's metadata")
        spec = plan.device_spec
        ids = [int(b) for b in spec.block_ids]
        off = 0
        for g, (n, first) in enumerate(zip(spec.group_sizes, spec.block_indices, strict=True)):
            for i in range(n):
                block_id, k = ids[off + i], int(first) + i
                ok = True
                for layer, view in enumerate(self._layer_views[rank][g]):
                    got = view[block_id].cpu().numpy().tobytes()
                    bad = self.model.bad_positions(got, req_id, k, self.block_size, g, layer, rank)
                    if bad:
                        ok = False
                        self._mismatches.append(
                            LoadMismatch(
                                self._executing, rank, plan.job_id, req_id, g, layer, k, block_id, bad, not any(got)
                            )
                        )
                self.load_checks.append(LoadCheck(self._executing, rank, plan.job_id, req_id, g, k, block_id, ok))
            off += n

    def verify_loads(self) -> list[LoadMismatch]:
        """Every restored block whose bytes differ from what the stand-in wrote for its tokens."""
        return list(self._mismatches)

    # --- test helpers --------------------------------------------------------------------------

    def zero_blocks(self, block_ids: Sequence[int], ranks: Sequence[int] | None = None) -> None:
        """Zero whole blocks (every layer slot) in the KV memory, as an unmapped page reads."""
        idx = torch.tensor(list(block_ids), dtype=torch.long)
        for r in ranks if ranks is not None else range(len(self.kv_memory)):
            self.kv_memory[r][idx] = 0

    def close(self) -> None:
        for conn in self.workers:
            conn.shutdown()
        shutil.rmtree(self._model_dir, ignore_errors=True)

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
