"""``kvreplay demo``: the freed-block-copy cases of kvcached PR #598, replayed under both policies.

This is what a newcomer runs first: four short event sequences taken from the order in which
vLLM's scheduler and OffloadingConnector act, each replayed with an eager allocator under
``legacy`` (unmap a page as soon as it is empty) and under ``ledger`` (the pins). The first
finds the freed-block copy and prints its witness; the second finds nothing.
"""

from __future__ import annotations

import io

import msgspec
from kvcli import plural

from kvcached.ledger.findings import Violation
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.simulate import derive
from kvcached.testing.seed_cases import SCENARIOS, Scenario


def _run(sc: Scenario, policy: str) -> tuple[Ledger, int]:
    ledger = Ledger(sc.header, policy)
    unmaps = 0
    for ev in derive(ledger, sc.events):
        unmaps += type(ev).__name__ == "PageUnmapped"
    return ledger, unmaps


def _witness(v: Violation) -> list[str]:
    lines = [f"    {v.invariant} {v.code}: {v.message}"]
    for c in v.chain:
        lines.append(f"      {c.step:>9}  event {c.index:>3}, build {c.build}: {c.what}")
    return lines


def results(names: list[str] | None = None) -> str:
    """What ``render`` says, as one JSON object per scenario and policy (``demo --json``)."""
    rows = []
    for name in names or list(SCENARIOS):
        sc = SCENARIOS[name]()
        for policy in ("legacy", "ledger"):
            ledger, unmaps = _run(sc, policy)
            rows.append(
                {
                    "scenario": sc.name,
                    "policy": policy,
                    "unmaps": unmaps,
                    "peak_pinned_pages": ledger.peak_pinned_pages,
                    "violations": [f"{v.invariant} {v.code}: {v.message}" for v in ledger.violations],
                }
            )
    return msgspec.json.encode(rows).decode() + "\n"


def render(names: list[str] | None = None) -> str:
    out = io.StringIO()
    chosen = names or list(SCENARIOS)
    found = clean = 0
    for name in chosen:
        sc = SCENARIOS[name]()
        print(f"{sc.name}: {sc.title}", file=out)
        print(f"  {sc.story}", file=out)
        for policy in ("legacy", "ledger"):
            ledger, unmaps = _run(sc, policy)
            i1 = [v for v in ledger.violations if v.invariant == "I1"]
            if ledger.violations:
                print(
                    f"  {policy:>6}: {plural(len(ledger.violations), 'violation')}, "
                    f"{plural(len(i1), 'freed-block copy', 'freed-block copies')}; "
                    f"{plural(unmaps, 'unmap')}, peak {plural(ledger.peak_pinned_pages, 'pinned page')}",
                    file=out,
                )
                for line in _witness(ledger.violations[0]):
                    print(line, file=out)
                found += policy == "legacy" and bool(i1)
            else:
                print(
                    f"  {policy:>6}: clean; {plural(unmaps, 'unmap')}, "
                    f"peak {plural(ledger.peak_pinned_pages, 'pinned page')}, "
                    f"{plural(ledger.outstanding_jobs(), 'job')} left",
                    file=out,
                )
                clean += policy == "ledger"
        print(file=out)
    print(
        f"freed-block copy found under legacy in {found} of {len(chosen)} scenarios; "
        f"ledger clean in {clean} of {len(chosen)}",
        file=out,
    )
    return out.getvalue()
