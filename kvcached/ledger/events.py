"""The ledger's vocabulary: every fact that decides whether a KV page may be unmapped.

Events are frozen msgspec Structs, encoded as msgpack arrays whose first element is a small
integer tag. Arrays and integer tags keep a journal near 10 bytes per event, which matters
because the journal sees every block alloc and free of a serving engine. Request ids are
interned: a request is named once (``RequestAdded``) and referred to by a small integer
afterwards, because vLLM's request ids are 30-50 byte strings.

The events are split into *inputs* (what the engine did: builds, allocs, frees, jobs, reports,
holds, request lifecycle, limits) and *decisions* (what the page allocator did: map, unmap).
Replay can keep the recorded decisions or re-derive them under another policy from the inputs.

The header is not part of the tagged union: it is a map-encoded struct so that fields can be
added without a format bump, and it always travels first.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final, TypeAlias

import msgspec

FORMAT_VERSION: Final = 1

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
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
    """What a reader must know before the first event: geometry, workers, policy, producers."""

    format_version: Positive = FORMAT_VERSION
    page_bytes: Positive
    pools: tuple[PoolGeometry, ...]
    workers: Positive = 1
    policy: Policy = Policy.LEDGER
    producer: dict[str, str] = {}
    created_unix: float = 0.0
    # Extra, free-form facts a producer wants to keep with the trace (scenario name, seed, ...).
    meta: dict[str, str] = {}


class _Event(msgspec.Struct, frozen=True, array_like=True, gc=False, tag_field="t"):
    """Base of every journaled event; ``t`` is the integer tag (the first array element)."""


# --- inputs ---------------------------------------------------------------------------------


class BuildBoundary(_Event, frozen=True, tag=0):
    """Build ``build`` (one ``build_connector_meta`` call) has returned; its jobs precede this."""

    build: NonNeg


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


class WindowHold(_Event, frozen=True, tag=5):
    """Sliding-window (or non-align Mamba) blocks of ``req``: their pages stay until released."""

    req: NonNeg
    pool: NonNeg
    blocks: BlockIds


class WindowRelease(_Event, frozen=True, tag=6):
    """Native matching dropped ``req``'s old block lists: its window holds end."""

    req: NonNeg


class RequestAdded(_Event, frozen=True, tag=7):
    """Interns the engine's request id ``name`` as the small integer ``req``."""

    req: NonNeg
    name: str


class RequestFinished(_Event, frozen=True, tag=8):
    """``req``'s last build has been built: its window holds end, its jobs still pin."""

    req: NonNeg


class RequestPreempted(_Event, frozen=True, tag=9):
    req: NonNeg


class PrefixCacheReset(_Event, frozen=True, tag=10):
    pass


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
    | WindowHold
    | WindowRelease
    | RequestAdded
    | RequestFinished
    | RequestPreempted
    | PrefixCacheReset
    | MemoryLimit
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
)


def blocks_per_page(header: Header, pool: int) -> int:
    """Whole blocks of ``pool`` that fit on one page; the tail of a page stays unused."""
    return header.page_bytes // header.pools[pool].block_bytes


def describe(event: Event) -> str:
    """A short, human-readable rendering used in witnesses and timelines."""
    name = type(event).__name__
    fields = ", ".join(
        f"{f}={_short(getattr(event, f))}" for f in event.__struct_fields__
    )
    return f"{name}({fields})"


def _short(value: object) -> str:
    if isinstance(value, enum.Enum):
        return value.name.lower()
    if isinstance(value, tuple) and len(value) > 8:
        return f"({', '.join(map(str, value[:6]))}, ... {len(value)} ids)"
    return str(value)
