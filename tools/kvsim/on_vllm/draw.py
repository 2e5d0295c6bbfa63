"""What one kvsim seed is: a configuration and a workload, drawn from the seed alone.

A seed must repeat exactly, on any machine, in any process: so everything is drawn from one
``random.Random(seed)`` in a fixed order, nothing reads the wall clock, and no draw iterates a
set or a dict whose order depends on the hash seed. The result is plain data (frozen msgspec
Structs, ``Case``) rather than code, because the shrinker must take a failing case apart and a
test case must be written to disk and read back. What a seed varies is listed at ``draw``.
"""

from __future__ import annotations

import random
from typing import Final, NamedTuple, TypeAlias

import msgspec

BLOCK_SIZE = 16  # tokens per vLLM block (the harness's default)
MAX_MODEL_LEN = 1024


class Kind(NamedTuple):
    """A model kind as the harness builds it (``kv_specs``; ``test_kvsim`` checks they agree)."""

    block_size: int  # tokens per block (Qwen3-Next: vLLM's hybrid alignment of a 7,680-byte state)
    groups: int  # KV cache groups (a sliding window adds one to "full")
    group_block_bytes: int  # one block of one group: its layers' pages
    layers: int  # the harness's num_layers: repeats of the kind's layer pattern
    state_groups: int  # Mamba groups: a few blocks each, however long the request


KINDS: Final[dict[str, Kind]] = {
    "full": Kind(BLOCK_SIZE, 1, 4096, 2, 0),
    "gemma3": Kind(BLOCK_SIZE, 6, 4096, 2, 0),
    "gpt-oss": Kind(BLOCK_SIZE, 2, 4096, 2, 0),
    "sliding": Kind(BLOCK_SIZE, 1, 4096, 2, 0),
    "mla": Kind(BLOCK_SIZE, 1, 2 * 18432, 2, 0),  # 16 tokens x 576 x fp16 per layer: no power of two
    "qwen3-next": Kind(64, 4, 8192, 1, 3),
}


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    kind: str = "full"  # KINDS; a case written before kinds were drawn reads as "full"
    async_scheduling: bool = False
    worker_at_schedule: bool = False  # async only: each step's worker side right after its schedule
    tp: int = 1
    late_steps: int = 0  # the last rank reports (and copies) its jobs this many steps late
    sliding_window: int | None = None  # tokens; "full": set adds a sliding-window group; window kinds: their window
    blocks_per_chunk: int = 1
    num_gpu_blocks: int = 64
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 8
    cpu_blocks: int = 256  # the CPU tier, in GPU blocks
    eviction_policy: str = "lru"
    page_blocks: int = 4  # kvcached: blocks per page
    min_reserved_pages: int = 0
    max_reserved_pages: int = 0
    max_cached_blocks: int | None = 0  # kvcached's prefix-cache cap in blocks; None: no cap


class Add(msgspec.Struct, frozen=True, tag="add"):
    """A request: ``shared_len`` tokens of shared prefix ``shared`` (-1: none), then ``length``
    tokens drawn from ``prompt_seed``; a follow-up (``follow_up`` >= 0) sends that earlier
    request's prompt and output first. ``stop_at`` > 0: the request's ``stop_at``-th output
    token is a stop token (it may come earlier in the output, then the request ends there)."""

    prompt_seed: int
    length: int
    max_tokens: int
    shared: int = -1
    shared_len: int = 0
    stop_at: int = 0
    follow_up: int = -1


class Step(msgspec.Struct, frozen=True, tag="step"):
    n: int


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    target: int  # ordinal of the Add


class Reset(msgspec.Struct, frozen=True, tag="reset"):
    running: bool = False  # reset_running_requests: preempts every running request
    connector: bool = False  # reset_connector: the CPU tier's cache too


class Limit(msgspec.Struct, frozen=True, tag="limit"):
    permille: int  # of the geometry's pages; 1000 and more: no limit


Action: TypeAlias = Add | Step | Abort | Reset | Limit


class Case(msgspec.Struct, frozen=True, kw_only=True):
    """A seed's configuration and workload, as plain data.

    NOTE: the shrinker takes a failing case apart (drop a request, halve a prompt, remove a fault,
    turn async scheduling off). The actions refer to earlier requests by their ordinal among the
    ``Add`` actions, so removing one is a renumbering, not a search."""

    seed: int
    config: SimConfig
    actions: tuple[Action, ...]

    @property
    def adds(self) -> list[Add]:
        return [a for a in self.actions if isinstance(a, Add)]

    def faults(self) -> int:
        return sum(isinstance(a, Abort | Reset | Limit) for a in self.actions)

    def describe(self) -> str:
        c = self.config
        sched = "sync"
        if c.async_scheduling:
            sched = "async/worker-at-schedule" if c.worker_at_schedule else "async/worker-late"
        window = f"window {c.sliding_window}" if c.sliding_window else "no window"
        if c.kind != "full":
            window = f"{c.kind} {groups(c)} groups{f', {window}' if c.sliding_window else ''}"
        cap = "no cap" if c.max_cached_blocks is None else f"cap {c.max_cached_blocks}"
        return (
            f"{sched}, tp {c.tp}{f' (rank {c.tp - 1} {c.late_steps} late)' if c.late_steps else ''}, {window}, "
            f"{c.num_gpu_blocks} GPU blocks, {c.max_num_batched_tokens} batched tokens, CPU {c.cpu_blocks} blocks "
            f"{c.eviction_policy} chunk {c.blocks_per_chunk}, page {c.page_blocks} blocks, reserve "
            f"{c.min_reserved_pages}..{c.max_reserved_pages}, {cap}; {len(self.adds)} requests, {self.faults()} faults"
        )


def groups(config: SimConfig) -> int:
    k = KINDS[config.kind]
    return k.groups + (1 if config.kind == "full" and config.sliding_window else 0)


def max_request_tokens(config: SimConfig) -> int:
    """Prompt plus output a request may have so that it fits the GPU blocks alone (with room):
    vLLM gives every attention group a block per token position of a prefill (a window's are
    freed after), a state group a few blocks at most."""
    k = KINDS[config.kind]
    bs = k.block_size
    attention = groups(config) - k.state_groups
    blocks = (config.num_gpu_blocks - 3 * k.state_groups) // attention - 3
    return min(MAX_MODEL_LEN - 8, max(bs, blocks * bs))


# How often each kind is drawn, and the GPU blocks it draws from (Gemma3's six groups need more,
# Qwen3-Next's 64-token blocks fewer, for vLLM to preempt).
_KIND_WEIGHTS: Final = (("full", 8), ("gemma3", 2), ("gpt-oss", 2), ("sliding", 2), ("mla", 2), ("qwen3-next", 2))
_GPU_BLOCKS: Final = {"gemma3": (72, 96, 144, 192, 288), "qwen3-next": (16, 20, 24, 32, 48)}
_WINDOWS: Final = {"full": (None, None, 16, 32), "gemma3": (16, 32), "gpt-oss": (128,), "sliding": (16, 32)}


def draw_config(rng: random.Random) -> SimConfig:
    kind = rng.choices([k for k, _ in _KIND_WEIGHTS], [w for _, w in _KIND_WEIGHTS])[0]
    async_scheduling = rng.random() < 0.5
    tp = 2 if rng.random() < 0.2 else 1
    late = rng.choice((1, 2, 3)) if (tp == 2 and rng.random() < 0.7) or rng.random() < 0.15 else 0
    bpc = rng.choice((1, 1, 2, 4))
    lo, hi = rng.choice(((0, 0), (0, 0), (0, 2), (1, 4)))
    return SimConfig(
        kind=kind,
        async_scheduling=async_scheduling,
        worker_at_schedule=async_scheduling and rng.random() < 0.5,
        tp=tp,
        late_steps=late,
        sliding_window=rng.choice(_WINDOWS.get(kind, (None,))),
        blocks_per_chunk=bpc,
        num_gpu_blocks=rng.choice(_GPU_BLOCKS.get(kind, (24, 32, 48, 64, 96))),
        max_num_batched_tokens=rng.choice((32, 64, 128, 512)),
        max_num_seqs=rng.choice((2, 4, 8)),
        cpu_blocks=max(2 * bpc, rng.choice((8, 16, 64, 256))),
        eviction_policy=rng.choice(("lru", "arc")),
        page_blocks=rng.choice((1, 2, 4, 8)),
        min_reserved_pages=lo,
        max_reserved_pages=hi,
        max_cached_blocks=rng.choice((None, 0, 0, 4, 16)),
    )


def draw(seed: int) -> Case:
    """The case of ``seed``.

    NOTE: what a seed varies:

    * the model kind, its KV cache groups: full attention, with or without a sliding window;
      Gemma3's five sliding groups and one full; gpt-oss's 128-token window beside full;
      Mistral's sliding window alone; DeepSeek-V2's MLA latent; Qwen3-Next's three Gated
      DeltaNet state groups beside full attention, 64-token blocks;
    * sync or async scheduling, the worker side at schedule or late;
    * tensor parallel 1 or 2 with a rank that reports late; a sliding window;
    * blocks per CPU chunk; GPU blocks few enough that vLLM preempts; a batch-token budget small
      enough to chunk prefills; the CPU tier's size and eviction policy;
    * kvcached's page size in blocks, reserve bounds and prefix-cache cap;
    * shared prefixes, duplicate prompts, stop tokens against ``max_tokens``, follow-up turns
      (prompt + output);
    * aborts (between steps, and under async scheduling while a step's output is still to be
      processed, with jobs in flight); prefix-cache resets (plain, with running requests, with
      the connector); memory-limit shrinks and raises.
    """
    rng = random.Random(seed)
    config = draw_config(rng)
    cap = max_request_tokens(config)
    scale = KINDS[config.kind].block_size // BLOCK_SIZE  # lengths in blocks, whatever a block holds
    prefixes = [rng.randint(8, 64) * scale for _ in range(2)]
    actions: list[Action] = []
    adds: list[Add] = []
    for i in range(rng.randint(2, 10)):
        r = rng.random()
        max_tokens = rng.choice((1, 1, 2, 5, 17, 30))
        if adds and r < 0.1:  # a duplicate prompt
            a = adds[rng.randrange(len(adds))]
            add = Add(a.prompt_seed, a.length, max_tokens, a.shared, a.shared_len, follow_up=a.follow_up)
        elif adds and r < 0.3:  # a follow-up turn: an earlier request's prompt and output, then more
            j = rng.randrange(len(adds))
            add = Add(seed * 1000 + i, rng.randint(1, 24 * scale), max_tokens, follow_up=j)
        else:
            shared = rng.randrange(2) if rng.random() < 0.4 else -1
            add = Add(
                seed * 1000 + i,
                rng.randint(1, 120 * scale),
                max_tokens,
                shared,
                prefixes[shared] if shared >= 0 else 0,
                stop_at=rng.randint(1, max_tokens) if max_tokens > 1 and rng.random() < 0.25 else 0,
            )
        add = _fit(add, adds, cap)
        adds.append(add)
        actions.append(add)
        if rng.random() < 0.7:
            actions.append(Step(rng.randint(1, 3)))
        f = rng.random()
        if f < 0.08:
            actions.append(Abort(rng.randrange(len(adds))))
        elif f < 0.16:
            # With a sliding window, the connector reset is what vLLM 0.33 gets wrong (stale
            # window block ids stored after it): drawn more often there.
            connector = rng.random() < (0.6 if config.sliding_window or config.kind == "qwen3-next" else 0.3)
            actions.append(Reset(running=rng.random() < 0.4, connector=connector))
        elif f < 0.24:
            actions.append(Limit(rng.choice((0, 250, 500, 750))))
        elif f < 0.28:
            actions.append(Limit(1000))
    limits = [a for a in actions if isinstance(a, Limit)]
    if limits and limits[-1].permille < 1000:
        # The memory comes back in the end (another model finished): a limit that stays below
        # what the requests need would stop the engine by design, which is no hang.
        actions.append(Limit(1000))
    return Case(seed=seed, config=config, actions=tuple(actions))


def request_tokens(add: Add, adds: list[Add]) -> int:
    """An upper bound of the request's prompt plus output."""
    own = add.shared_len + add.length + add.max_tokens
    return own + (request_tokens(adds[add.follow_up], adds) if add.follow_up >= 0 else 0)


def _fit(add: Add, adds: list[Add], cap: int) -> Add:
    """Shorten the request (then drop its follow-up) until it fits the GPU blocks alone."""
    while request_tokens(add, adds) > cap:
        if add.length > 1:
            add = msgspec.structs.replace(add, length=max(1, add.length // 2))
        elif add.follow_up >= 0:
            add = msgspec.structs.replace(add, follow_up=-1)
        elif add.shared >= 0:
            add = msgspec.structs.replace(add, shared=-1, shared_len=0)
        elif add.max_tokens > 1:
            add = msgspec.structs.replace(add, max_tokens=max(1, add.max_tokens // 2), stop_at=0)
        else:
            break
    return add
