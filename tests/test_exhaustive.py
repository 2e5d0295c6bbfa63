"""Every legal event sequence up to length k over a tiny model, against the naive reference model.

The Hypothesis test (``test_ledger_model.py``) samples long histories; this one leaves nothing
out within a small scope, in the spirit of the small-scope hypothesis (most protocol bugs show
on tiny instances): one pool of 4 blocks on 2 pages, 2 requests, 1 or 2 workers, and every legal
next event from a fixed alphabet (map or unmap a page, alloc or free one block, build a store or
a load of one block for either request, report a job once, hold a block in a request's window,
release or finish a request, close the build), under both policies. After every event the
ledger's answers (releasable and pinned pages, ``why`` of every page, the legacy policy's I1
reports) must equal the model's, which replays the whole history from the specification.
The ledger of each prefix is shared by all its extensions (restored from a snapshot), so the
search costs one event per node, and a snapshot round trip is checked on the way.

Scope reached (``python tests/test_exhaustive.py K``, this 2-core machine): see docs/kvsim.md.
CI runs k = 4 (a few seconds); ``KVCACHED_EXHAUSTIVE_K`` raises it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator

import pytest
from test_ledger_model import Expected, NaiveModel, assert_agrees, round_trip

from kvcached.ledger import ledger as ledger_module
from kvcached.ledger.events import (
    BlockAlloc,
    BlockFree,
    BuildBoundary,
    Event,
    Header,
    JobBuilt,
    JobKind,
    JobReported,
    PageMapped,
    PageUnmapped,
    Policy,
    PoolGeometry,
    RequestFinished,
    WindowHold,
    WindowRelease,
)
from kvcached.ledger.findings import plural
from kvcached.ledger.ledger import Ledger

REQS = (0, 1)
CI_K = int(os.environ.get("KVCACHED_EXHAUSTIVE_K", "4"))


def tiny_header(policy: Policy, workers: int) -> Header:
    # 4 blocks of 2 KiB on 4 KiB pages: 2 pages of 2 blocks each.
    return Header(page_bytes=4096, pools=(PoolGeometry(2048, 4),), workers=workers, policy=policy)


def legal_moves(m: NaiveModel, workers: int) -> Iterator[Event]:
    f = m.facts()
    pages = range(m.num_pages)
    for p in pages:
        if p not in f.mapped:
            yield PageMapped(p)
    for p in sorted(m.releasable_in(f)):
        yield PageUnmapped(p)
    allocated = sorted(b for _, b in f.allocated)
    for b in range(4):
        if b not in allocated and m.page(0, b) in f.mapped:
            yield BlockAlloc(0, (b,))
    for b in allocated:
        yield BlockFree(0, (b,))
    active = [r for r in REQS if r not in f.finished_reqs]
    job = len(f.seen_jobs)
    for b in allocated:
        for r in active:
            for kind in JobKind:
                yield JobBuilt(job, kind, r, ((b,),), workers)
            yield WindowHold(r, 0, (b,))
    for j in sorted(f.jobs):
        yield JobReported(j, 1)
    for r in active:
        if r in f.seen_reqs:
            yield WindowRelease(r)
            yield RequestFinished(r)
    yield BuildBoundary(f.open_build)


def explore(policy: Policy, workers: int, k: int) -> int:
    """Depth-first over every legal sequence of length <= k; returns the sequences checked."""
    header = tiny_header(policy, workers)
    count = 0

    def visit(model: NaiveModel, ledger: Ledger, depth: int) -> None:
        nonlocal count
        if depth == k:
            return
        for ev in legal_moves(model, workers):
            child = NaiveModel(header, policy)
            child.events = [*model.events, ev]
            led = Ledger.restore(ledger.snapshot())
            led.apply(ev)
            want = Expected.of(child)
            try:
                assert_agrees(led, want)
            except AssertionError as e:
                raise AssertionError(f"{policy.value}, {plural(workers, 'worker')}, after {child.events}: {e}") from e
            count += 1
            visit(child, led, depth + 1)

    root = Ledger(header, liveness_builds=10**6)
    visit(NaiveModel(header, policy), root, 0)
    return count


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("policy", [Policy.LEDGER, Policy.LEGACY])
def test_every_legal_sequence_up_to_k_agrees_with_the_model(policy: Policy, workers: int) -> None:
    assert explore(policy, workers, CI_K) > 0


@pytest.mark.skipif(
    ledger_module.__file__.endswith((".so", ".pyd")),
    reason="plants the bug by replacing a Ledger method, which a mypyc-compiled class refuses; the pure pass runs it",
)
def test_the_search_finds_a_planted_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    # The ledger forgetting that a job pins its pages (the freed-block copy's cause) must show
    # within k = 4: alloc, store job, free, then the page is releasable too early.
    monkeypatch.setattr(Ledger, "_job_built", lambda self, ev: None)
    with pytest.raises(AssertionError):
        explore(Policy.LEDGER, 1, 4)


def test_a_snapshot_round_trip_keeps_the_answers() -> None:
    header = tiny_header(Policy.LEDGER, 2)
    m = NaiveModel(header, Policy.LEDGER)
    led = Ledger(header, liveness_builds=10**6)
    for ev in (PageMapped(0), BlockAlloc(0, (0,)), JobBuilt(0, JobKind.STORE, 0, ((0,),), 2), BlockFree(0, (0,))):
        m.apply(ev)
        led.apply(ev)
    back = Ledger.restore(round_trip(led.snapshot()))
    assert_agrees(back, Expected.of(m))


if __name__ == "__main__":  # the scope a minute reaches: python tests/test_exhaustive.py [K]
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    for k in range(1, top + 1):
        t0 = time.process_time()  # CPU seconds: the machine may be shared
        n = sum(explore(p, w, k) for p in (Policy.LEDGER, Policy.LEGACY) for w in (1, 2))
        print(f"k={k}: {n:,} sequences in {time.process_time() - t0:.1f} CPU s", flush=True)
