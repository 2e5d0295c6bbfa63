"""What the ledger reports: invariant violations as short witnesses, and pin reasons.

These are plain frozen Structs so that the same values flow to a test assertion, a
``kvreplay check --json`` report and a ``kvctl pins`` table without conversion. A witness is
deliberately short (the few events that matter, in order: pin -> free -> unmap -> late copy)
because a maintainer reading a replay of ten million events needs the chain, not a dump.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec


def plural(n: int, noun: str, many: str | None = None) -> str:
    """``1 page``, ``2 pages``, ``1,024 pages``; ``many`` for the irregular ones. The one spelling of
    a count in every message kvcached writes (witnesses, kvreplay, kvctl, kvsim: ``kvcli`` uses it)."""
    word = noun if n == 1 else (many if many is not None else noun + "s")
    return f"{n:,} {word}"


InvariantId = Literal["I1", "I2", "I3", "I4", "I5"]

INVARIANTS: Final[dict[str, str]] = {
    "I1": "no freed-block copy: a job's pages stay mapped from its build until fully reported",
    "I2": "no page with an allocated block is unmapped; no block is used on an unmapped page",
    "I3": "accounting: no double alloc/free, no unknown job, no over-report, no negative pin",
    "I4": "liveness: pins end within a bounded number of builds; pending shrinks finish",
    "I5": "a store job copies only blocks its request holds, or held (window included), since they were last written",
}


class ChainLink(msgspec.Struct, frozen=True):
    """One step of a witness: which event, in which build, and what it did."""

    step: Literal["alloc", "pin", "free", "unmap", "late copy", "hold", "preempt", "limit"]
    index: int
    build: int
    what: str


class Violation(msgspec.Struct, frozen=True, kw_only=True):
    invariant: InvariantId
    code: str  # stable machine name, e.g. "unmap-under-job"
    index: int  # event index at which the violation became certain
    build: int
    message: str
    page: int | None = None
    job: int | None = None
    request: str | None = None
    chain: tuple[ChainLink, ...] = ()

    def one_line(self) -> str:
        where = [f"event {self.index}", f"build {self.build}"]
        if self.page is not None:
            where.append(f"page {self.page}")
        if self.job is not None:
            where.append(f"job {self.job}")
        if self.request is not None:
            where.append(f"request {self.request}")
        return f"{self.invariant} {self.code} ({', '.join(where)}): {self.message}"


class PinReason(msgspec.Struct, frozen=True, kw_only=True):
    """Why a page is pinned. ``kind`` is one of the three pins of the design."""

    kind: Literal["job", "grace", "window"]
    since_build: int
    job: int | None = None
    job_kind: Literal["store", "load"] | None = None
    request: str | None = None
    waiting_workers: int | None = None
    until_build: int | None = None

    def describe(self) -> str:
        if self.kind == "job":
            return (
                f"{self.job_kind} job {self.job} of request {self.request} since build "
                f"{self.since_build}, waiting on {plural(self.waiting_workers or 0, 'worker')}"
            )
        if self.kind == "grace":
            return f"grace after a free in build {self.since_build}, until build {self.until_build} is built"
        return f"window hold of request {self.request} since build {self.since_build}"


class PageStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the ledger knows about one page, and the verdict under its policy."""

    page: int
    mapped: bool
    allocated_blocks: int
    releasable: bool
    policy: str
    pins: tuple[PinReason, ...]

    def describe(self) -> str:
        state = "mapped" if self.mapped else "unmapped"
        head = f"page {self.page}: {state}, {plural(self.allocated_blocks, 'block')} allocated"
        if self.releasable:
            return f"{head}; may be unmapped ({self.policy})"
        reasons = []
        if not self.mapped:
            reasons.append("not mapped")
        if self.allocated_blocks:
            reasons.append("blocks allocated")
        if self.policy == "ledger":
            reasons += [p.describe() for p in self.pins]
        return f"{head}; kept: " + "; ".join(reasons)
