"""The ledger's vocabulary: every fact that decides whether a KV page may be unmapped.

Events are frozen msgspec Structs, encoded as msgpack arrays whose first element is a small
integer tag. They are split into *inputs* (what the engine did: builds, allocs, frees, jobs,
reports, holds, request lifecycle, limits) and *decisions* (what the page allocator did: map,
unmap). Replay can keep the recorded decisions or re-derive them under another policy from the
inputs.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final, TypeAlias

import msgspec

from ..errors import ConfigError

# Still 1 with ``BuildBoundary.at_us`` appended: a reader that predates a trailing
# field ignores it (docs/trace-format.md, "Versioning"), and this one reads a boundary without it.
FORMAT_VERSION: Final = 1

# Every integer of the format is below 2**63: the ledger keeps build numbers and event indices in
# int64 arrays (``LedgerTables.boundary_ix``), where a larger one raised OverflowError mid-replay.
# msgspec checks the bound while it decodes, at no measurable cost (benchmarks/bench_decode.py).
INT64_MAX: Final = 2**63 - 1
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)]

# What a header may declare. The ledger allocates its per-block tables up front (72 to 122 bytes
# a block, by blocks per page), so a forged 171-byte header declaring 2**26 blocks took 7.5 GB and
# 20 s. The bound is what a real GPU can hold, refused before anything is allocated. vLLM gives
# the KV cache at most ~90% of a GPU (gpu_memory_utilization's default is 0.9): an H200's 141 GB
# gives 127 GB. A block is 16 tokens (vLLM's default block size) over every layer of its KV cache
# group, on one tensor-parallel rank: for the smallest models served (SmolLM2-135M, Qwen2.5-0.5B:
# 24-30 layers of 64-wide heads) with one KV head per rank and an fp8 cache, 48 KiB or more. Even
# at 8 KiB (one 64-wide head, K and V, fp8, over just four layers) an H200 holds 15.5 million
# blocks; the bound is the power of two above, 2**24 blocks over all pools (tables of 1 to 2 GB,
# what replaying a real trace of that size costs anyway). The larger GPUs (B200 192 GB, B300
# 288 GB) hold at most 5.3 million blocks of 48 KiB, well under it.
MAX_BLOCKS: Final = 1 << 24
# A pool is a vLLM KV cache group: one per kind of attention layer (full, sliding window, Mamba),
# so a handful; even one pool per layer stays under 256 (the largest models have ~126 layers).
MAX_POOLS: Final = 256
# Block ids of one pool; vLLM block ids are int32.
BlockIds = tuple[Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)], ...]


class JobKind(enum.IntEnum):
    """Direction of a connector transfer job, seen from the GPU."""

    STORE = 0  # GPU -> CPU: reads the job's GPU blocks
    LOAD = 1  # CPU -> GPU: writes the job's GPU blocks


class Policy(enum.Enum):
    """How the releasable set is derived from the events."""

    LEGACY = "legacy"  # empty page = releasable (kvcached before the offloading pins)
    LEDGER = "ledger"  # empty and unpinned (job pins, grace, window holds)


class PoolGeometry(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One block pool (one vLLM KV cache group): its block size and block count."""

    block_bytes: Positive
    num_blocks: NonNeg


class Header(msgspec.Struct, frozen=True, forbid_unknown_fields=False, kw_only=True):
    """What a reader must know before the first event: geometry, workers, policy, producers.

    A header declaring more blocks or pools than the ledger tracks (``MAX_BLOCKS``,
    ``MAX_POOLS``) raises ``ConfigError``, whether it is constructed (the served path) or
    decoded (a journal or snapshot: msgspec lets the error through and the readers name the file).

    NOTE: the header is not part of the tagged union: it is a map-encoded struct so that fields
    can be added without a format bump, and it always travels first.
    """

    format_version: Positive = FORMAT_VERSION
    page_bytes: Positive
    # max_length: msgspec refuses a longer array before it decodes a single element.
    pools: Annotated[tuple[PoolGeometry, ...], msgspec.Meta(max_length=MAX_POOLS)]
    workers: Positive = 1
    policy: Policy = Policy.LEDGER
    producer: dict[str, str] = {}
    created_unix: float = 0.0
    # The wall-clock time (``time.time()``) that a build boundary's ``at_us == 0`` stands for; 0.0:
    # the boundaries carry no time. Kept by every segment, snapshot and dump of one run, unlike
    # ``created_unix``, so that one base serves the whole run.
    clock_base_unix: float = 0.0
    # Extra, free-form facts a producer wants to keep with the trace (scenario name, seed, ...).
    meta: dict[str, str] = {}

    def __post_init__(self) -> None:
        # Called on construction and on decode. Not a ValueError: msgspec would turn that into a
        # DecodeError on decode, but the served path catches KvcachedError, and so do the readers.
        if len(self.pools) > MAX_POOLS:  # constructed: decode checked it already
            raise ConfigError(f"{len(self.pools)} block pools; the ledger tracks at most {MAX_POOLS}")
        total = sum(p.num_blocks for p in self.pools)
        if total > MAX_BLOCKS:
            where = f" over {len(self.pools)} pools" if len(self.pools) > 1 else ""
            raise ConfigError(
                f"{total:,} KV blocks{where}: more than a GPU holds (the ledger tracks at most {MAX_BLOCKS:,})"
            )


class _Event(msgspec.Struct, frozen=True, array_like=True, gc=False, tag_field="t"):
    """Base of every journaled event; ``t`` is the integer tag (the first array element).

    NOTE: arrays and integer tags keep a journal near 10 bytes per event, which matters because
    the journal sees every block alloc and free of a serving engine."""


# --- inputs ---------------------------------------------------------------------------------


class BuildBoundary(_Event, frozen=True, tag=0):
    """Build ``build`` (one ``build_connector_meta`` call) has returned; its jobs precede this.

    ``at_us`` is when, on the monotonic clock, in microseconds after the header's
    ``clock_base_unix``: so that an incident seen on a dashboard at a wall-clock time can be found
    in the journal (``kvreplay show --at``) even if the wall clock was stepped while serving. It
    is a trailing optional field: a trace written before it (``[0, build]``) decodes unchanged,
    with ``at_us`` None; msgspec 0.23 encodes an absent one as nil, one byte, and a present one in
    5 to 9 bytes, once per engine step.
    """

    build: NonNeg
    at_us: NonNeg | None = None


class BlockAlloc(_Event, frozen=True, tag=1):
    pool: NonNeg
    blocks: BlockIds


class BlockFree(_Event, frozen=True, tag=2):
    pool: NonNeg
    blocks: BlockIds


class JobBuilt(_Event, frozen=True, tag=3):
    """A transfer job returned by a build. ``blocks[i]`` are its GPU block ids in pool ``i``."""

    job: NonNeg
    kind: JobKind
    req: NonNeg
    blocks: tuple[BlockIds, ...]
    workers: Positive


class JobReported(_Event, frozen=True, tag=4):
    """``count`` workers reported ``job`` complete (vLLM sums completions over workers)."""

    job: NonNeg
    count: Positive


class JobFailed(_Event, frozen=True, tag=16):
    """A worker reported ``job`` failed (vLLM 0.34's ``OffloadingWorkerMetadata.failed_jobs``):
    a failed store is not published to the CPU tier and a failed load is not read. The same
    step's ``JobReported`` counts it complete, which releases its pins as for any completion;
    this records that the copy did not happen (``kvreplay show`` marks the job failed)."""

    job: NonNeg


class WindowHold(_Event, frozen=True, tag=5):
    """Sliding-window (or non-align Mamba) blocks of ``req``: their pages stay until released."""

    req: NonNeg
    pool: NonNeg
    blocks: BlockIds


class WindowRelease(_Event, frozen=True, tag=6):
    """Native matching dropped ``req``'s old block lists: its window holds end."""

    req: NonNeg


class RequestAdded(_Event, frozen=True, tag=7):
    """Interns the engine's request id ``name`` as the small integer ``req``.

    NOTE: a request is named once, here, and referred to by a small integer afterwards, because
    vLLM's request ids are 30-50 byte strings."""

    req: NonNeg
    name: str


class RequestFinished(_Event, frozen=True, tag=8):
    """``req``'s last build has been built: its window holds end, its jobs still pin."""

    req: NonNeg


class RequestPreempted(_Event, frozen=True, tag=9):
    req: NonNeg


class PrefixCacheReset(_Event, frozen=True, tag=10):
    pass


class RequestBlocks(_Event, frozen=True, tag=15):
    """Blocks of ``pool`` that ``req`` holds from this step on, as vLLM's KV cache manager gave them.

    ``fresh``: newly allocated for ``req`` (vLLM's ``BlockPool.get_new_blocks``): ``req``'s KV is
    written into them, so they hold nobody else's from now on. ``shared``: prefix-cache hits (and
    blocks of a resumed request it got back): ``req`` reads what is there, which is its own KV too.
    Emitted before the build that may store them. The ledger uses these for I5 (a store job copies
    only blocks its request holds, or held, since they were last written); a trace without any
    ``RequestBlocks`` (every trace before this event, tag 15, was added) is not checked for I5.
    """

    req: NonNeg
    pool: NonNeg
    fresh: BlockIds
    shared: BlockIds = ()


class MemoryLimit(_Event, frozen=True, tag=11):
    """The allocator may keep at most ``pages`` pages mapped from now on."""

    pages: NonNeg


# --- decisions ------------------------------------------------------------------------------


class PageMapped(_Event, frozen=True, tag=12):
    page: NonNeg


class PageUnmapped(_Event, frozen=True, tag=13):
    page: NonNeg


# --- journal bookkeeping --------------------------------------------------------------------


class Gap(_Event, frozen=True, tag=14):
    """The producer dropped ``dropped`` events here (hand-off full or journal behind)."""

    dropped: Positive


Event: TypeAlias = (
    BuildBoundary
    | BlockAlloc
    | BlockFree
    | JobBuilt
    | JobReported
    | JobFailed
    | WindowHold
    | WindowRelease
    | RequestAdded
    | RequestFinished
    | RequestPreempted
    | PrefixCacheReset
    | MemoryLimit
    | RequestBlocks
    | PageMapped
    | PageUnmapped
    | Gap
)

DECISIONS: Final = (PageMapped, PageUnmapped)

EVENT_TYPES: Final[tuple[type[_Event], ...]] = (
    BuildBoundary,
    BlockAlloc,
    BlockFree,
    JobBuilt,
    JobReported,
    WindowHold,
    WindowRelease,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    PrefixCacheReset,
    MemoryLimit,
    PageMapped,
    PageUnmapped,
    Gap,
    RequestBlocks,
    JobFailed,
)


def misfit(header: Header) -> str | None:
    """Why ``header``'s pools cannot be laid out on its pages (a block larger than a page), in
    words about the header alone, or None. A serving process never writes such a header (its
    geometry is checked first, with advice on the settings); a reader says what is wrong with it."""
    for i, pool in enumerate(header.pools):
        if pool.block_bytes > header.page_bytes:
            return f"pool {i}'s blocks of {pool.block_bytes:,} bytes do not fit its {header.page_bytes:,}-byte pages"
    return None


def blocks_per_page(header: Header, pool: int) -> int:
    """Whole blocks of ``pool`` that fit on one page; the tail of a page stays unused."""
    return header.page_bytes // header.pools[pool].block_bytes


def describe(event: Event) -> str:
    """A short, human-readable rendering used in witnesses and timelines."""
    name = type(event).__name__
    # An optional field that is absent (a boundary's time) says nothing: it is left out, so that
    # a timeline reads as it did before the field existed.
    values = ((f, getattr(event, f)) for f in event.__struct_fields__)
    fields = ", ".join(f"{f}={short(v)}" for f, v in values if v is not None)
    return f"{name}({fields})"


def short(value: object) -> str:
    """A field as timelines print it: an enum by name, a long block list cut to its first six."""
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, tuple) and len(value) > 8:
        return f"({', '.join(map(str, value[:6]))}, ... {len(value)} ids)"
    return str(value)
