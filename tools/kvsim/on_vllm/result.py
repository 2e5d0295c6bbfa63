"""What one kvsim run found: the checks that failed (the first time each, with step and block),
and how much of the interesting ground the run covered.

A run keeps going after a failure where it safely can (a copy from an unmapped page is recorded,
then lets through as an unchecked backend would, reading zeros), so that one run can trip several
checks and a campaign can say per check how often ``legacy`` trips it: a check that never trips
on ``legacy`` is suspect. Values only, frozen Structs, so a result crosses process boundaries
(``--jobs``) and goes to JSON as is.
"""

from __future__ import annotations

from typing import Final

import msgspec

# The checks, in the order a report lists them.
CHECKS: Final[dict[str, str]] = {
    "attended-bytes": "the KV every scheduled request attends to (prefix hits and loads included) is the model's",
    "load-bytes": "a load restores the model's bytes for its request",
    "store-bytes": "a store copies its own request's KV (the bytes of the blocks it names)",
    "unmapped-touch": "no block touched (written, attended, copied) sits on an unmapped page",
    "ledger": "the ledger's invariants I1-I5 hold over the run's own events",
    "hang": "the run ends within its step bound",
    "leftover": "at the end no pin, job or shrink is left",
    "crash": "nothing raises out of vLLM or kvcached",
}
VARIANTS: Final = ("ledger", "legacy", "never-unmap", "vllm")


class Failure(msgspec.Struct, frozen=True, kw_only=True):
    check: str
    step: int
    detail: str
    block: int | None = None
    request: str | None = None
    count: int = 1  # how many times this check failed in the run

    def line(self) -> str:
        where = [f"step {self.step}"]
        if self.block is not None:
            where.append(f"block {self.block}")
        if self.request is not None:
            where.append(f"request {self.request}")
        more = f" (x{self.count})" if self.count > 1 else ""
        return f"{self.check} ({', '.join(where)}){more}: {self.detail}"


class Coverage(msgspec.Struct, frozen=True, kw_only=True):
    steps: int = 0
    requests: int = 0
    preemptions: int = 0
    aborts: int = 0
    aborts_in_flight: int = 0  # aborts of a request with a job built and not yet reported
    resets: int = 0
    shrinks: int = 0  # limits set below what was mapped
    stores: int = 0
    loads: int = 0
    bytes_checked: int = 0

    def __add__(self, other: Coverage) -> Coverage:
        return Coverage(**{f: getattr(self, f) + getattr(other, f) for f in self.__struct_fields__})


class SeedResult(msgspec.Struct, frozen=True, kw_only=True):
    seed: int
    variant: str
    failures: tuple[Failure, ...]
    coverage: Coverage
    config: str  # the case, described

    @property
    def ok(self) -> bool:
        return not self.failures

    def checks(self) -> list[str]:
        return [f.check for f in self.failures]

    def line(self) -> str:
        c = self.coverage
        what = "ok" if self.ok else "FAIL " + ", ".join(self.checks())
        return (
            f"seed {self.seed:5} {self.variant:11} {what:40} steps {c.steps:4}, preempt {c.preemptions}, "
            f"abort {c.aborts}/{c.aborts_in_flight} in flight, reset {c.resets}, shrink {c.shrinks}, "
            f"{c.stores} stores, {c.loads} loads"
        )


class Findings:
    """Collects failures during a run: the first of each check, with a count."""

    def __init__(self) -> None:
        self.first: dict[str, Failure] = {}
        self.counts: dict[str, int] = {}

    def fail(self, check: str, step: int, detail: str, *, block: int | None = None, request: str | None = None) -> None:
        self.counts[check] = self.counts.get(check, 0) + 1
        if check not in self.first:
            self.first[check] = Failure(check=check, step=step, detail=detail, block=block, request=request)

    def failures(self) -> tuple[Failure, ...]:
        return tuple(msgspec.structs.replace(self.first[c], count=self.counts[c]) for c in CHECKS if c in self.first)
