"""What the scheduler harness is configured with and what it records, apart from vLLM.

These are plain frozen dataclasses that import nothing of vLLM, so that a test or tool can read
a harness's configuration and findings (a ``StepRecord``, a ``LoadMismatch``: the wrong bytes a
load restored) without loading vLLM, and so that ``harness.py``, which drives vLLM's scheduler
and connectors, stays about the driving. ``harness`` re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FreedBlockCopy", "HarnessConfig", "LoadCheck", "LoadMismatch", "StepRecord"]


@dataclass(frozen=True)
class HarnessConfig:
    tp: int = 1
    block_size: int = 16
    num_gpu_blocks: int = 64
    num_layers: int = 2  # per KV group
    num_kv_heads: int = 1
    head_size: int = 32
    sliding_window: int | None = None  # tokens; kind "full": groups are [full attention, sliding window]
    # The model kind (kv_specs.KINDS): "full" (llama), "gemma3" (5 sliding : 1 full), "gpt-oss" (sliding
    # and full alternating, window 128), "sliding" (Mistral), "mla" (DeepSeek-V2's 576-wide latent),
    # "qwen3-next" (3 Gated DeltaNet state layers : 1 full, a 64-token block). The window kinds take
    # ``sliding_window`` as their window, else their model's.
    kind: str = "full"
    mamba_cache_mode: str = "align"  # qwen3-next: vLLM 0.33's CacheConfig knows "align" and "none"
    blocks_per_chunk: int = 1
    cpu_bytes_to_use: int = 8 << 20
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 8
    max_model_len: int = 1024
    vocab_size: int = 1000
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    # vLLM's AsyncScheduler and the engine core's batch queue of two: step N+1 is scheduled
    # before step N's output is processed (vLLM's default where the executor supports it).
    async_scheduling: bool = False
    # When a step's worker side (forward, copies) runs under async scheduling: False, as late as
    # the engine allows (after the previous step's update: a worker process, or copies on a CUDA
    # stream, lagging the scheduler); True, at once after its schedule (the uni executor's
    # Python, with copies that finish before the scheduler moves on).
    worker_at_schedule: bool = False
    # Which OffloadingConnector the scheduler gets: kvcached's (vLLM's, reporting its calls to a
    # bridge, as a served engine with ENABLE_KVCACHED=1 builds it), vLLM's own, or None: kvcached's
    # when something is put under the scheduler (``on_scheduler_built``), else vLLM's.
    kvcached_connector: bool | None = None


@dataclass(frozen=True)
class LoadCheck:
    """One block a load wrote, checked at the moment the copy ran."""

    step: int
    worker: int
    job_id: int
    req_id: str
    group: int
    block_index: int  # position of the block in the request, in blocks
    block_id: int
    ok: bool


@dataclass(frozen=True)
class LoadMismatch:
    step: int
    worker: int
    job_id: int
    req_id: str
    group: int
    layer: int
    block_index: int
    block_id: int
    bad_positions: tuple[int, ...]
    all_zero: bool  # what an unmapped (zero-page) block reads as


@dataclass
class StepRecord:
    step: int
    num_scheduled_tokens: dict[str, int]
    finished_req_ids: frozenset[str]
    preempted_req_ids: frozenset[str]
    load_jobs: dict[int, str]
    store_jobs: dict[int, tuple[str, tuple[int, ...]]]  # job -> (request, GPU block ids)
    jobs_to_flush: frozenset[int]
    # Store jobs whose source blocks are already free in the scheduler's pool when built.
    stores_of_free_blocks: dict[int, tuple[int, ...]] = field(default_factory=dict)
    completed_jobs: dict[int, int] = field(default_factory=dict)  # summed over workers


@dataclass(frozen=True)
class FreedBlockCopy:
    """A store that read blocks the scheduler's pool held as free when the copy ran."""

    step: int
    worker: int
    job_id: int
    req_id: str
    block_ids: tuple[int, ...]
