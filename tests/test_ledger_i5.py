"""I5: a store job copies only blocks its request holds, or held, since they were last written.

The planted bug is vLLM 0.33.0's stale window block ids: after a connector reset with sliding
windows, ``OffloadingConnectorScheduler`` keeps a request's old window block ids, so a block that
went to another request is stored under the old request's key. The events below are what a
producer records for it (``RequestBlocks`` names who got which block); the ledger must flag the
store, and must not flag the legitimate cases next to it: prefix-cache hits shared between
requests, a finished request's last store built after its free, a block a request got back after
a preemption, and any trace written before ``RequestBlocks`` existed (the golden traces).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvcached.ledger.events import (
    BlockAlloc,
    BlockFree,
    BuildBoundary,
    Event,
    Header,
    JobBuilt,
    JobKind,
    JobReported,
    PoolGeometry,
    PrefixCacheReset,
    RequestAdded,
    RequestBlocks,
    RequestFinished,
    RequestPreempted,
    WindowHold,
)
from kvcached.ledger.journal import JournalWriter
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.simulate import derive
from kvcached.ledger.state import LedgerSnapshot
from kvreplay.cli import main

HEADER = Header(page_bytes=4 * 1024, pools=(PoolGeometry(1024, 16),))
STORE = JobKind.STORE


def _prologue() -> list[Event]:
    """Request a computes blocks 1 and 2 (window blocks) and stores them; both are reported."""
    return [
        RequestAdded(0, "a"),
        RequestAdded(1, "b"),
        BlockAlloc(0, (1, 2)),
        RequestBlocks(0, 0, (1, 2)),
        WindowHold(0, 0, (1, 2)),
        JobBuilt(0, STORE, 0, ((1, 2),), 1),
        BuildBoundary(0),
        JobReported(0, 1),
    ]


def stale_window_ids() -> list[Event]:
    """The planted bug: block 1 leaves a's window, goes fresh to b, and is stored as a's."""
    return [
        *_prologue(),
        BlockFree(0, (1,)),  # a's sliding window drops block 1
        PrefixCacheReset(),  # the connector reset; its stale ids of a survive
        BlockAlloc(0, (1,)),
        RequestBlocks(1, 0, (1,)),  # b gets block 1 fresh and writes its own KV there
        BuildBoundary(1),
        JobBuilt(1, STORE, 0, ((1,),), 1),  # a's store names block 1 again: b's KV under a's key
        BuildBoundary(2),
        JobReported(1, 1),
    ]


def ledger_of(events: list[Event], policy: str = "ledger") -> Ledger:
    led = Ledger(HEADER, policy)
    led.apply_all(derive(Ledger(HEADER, policy), events))  # with the allocator's decisions
    return led


@pytest.mark.parametrize("policy", ["ledger", "legacy"])
def test_a_store_of_a_block_another_request_was_given_fresh_is_i5(policy: str) -> None:
    led = ledger_of(stale_window_ids(), policy)
    [v] = [v for v in led.violations if v.invariant == "I5"]
    assert v.code == "store-of-foreign-block" and v.job == 1 and v.request == "a"
    assert "block 1 of pool 0, which request b was given fresh after a last held it" in v.message
    assert [c.step for c in v.chain] == ["hold", "alloc", "late copy"]


def test_legitimate_stores_are_not_i5() -> None:
    events = [
        *_prologue(),
        # b hits a's block 2 in the prefix cache: shared, not written; a may still store it.
        RequestBlocks(1, 0, (), (2,)),
        BlockAlloc(0, (3,)),
        RequestBlocks(1, 0, (3,)),
        JobBuilt(1, STORE, 1, ((2, 3),), 1),
        JobBuilt(2, STORE, 0, ((2,),), 1),
        BuildBoundary(1),
        JobReported(1, 1),
        JobReported(2, 1),
        # a finishes and frees; its last store is built in the next build (PR #598, case 1).
        BlockFree(0, (1, 2)),
        RequestFinished(0),
        BuildBoundary(2),
        JobBuilt(3, STORE, 0, ((1,),), 1),
        BuildBoundary(3),
        JobReported(3, 1),
        # b is preempted, gets block 3 back as a hit and block 4 fresh.
        BlockFree(0, (3,)),
        RequestPreempted(1),
        BuildBoundary(4),
        BlockAlloc(0, (3, 4)),
        RequestBlocks(1, 0, (4,), (3,)),
        JobBuilt(4, STORE, 1, ((3, 4),), 1),
        BuildBoundary(5),
        JobReported(4, 1),
    ]
    assert ledger_of(events).violations == []


def test_a_request_that_never_held_the_block_is_i5() -> None:
    events = [*_prologue(), BlockAlloc(0, (5,)), RequestBlocks(1, 0, (5,)), JobBuilt(1, STORE, 0, ((5,),), 1)]
    [v] = ledger_of(events).violations
    assert v.invariant == "I5" and "which request a never held" in v.message


def test_a_trace_without_request_blocks_is_not_checked_for_i5() -> None:
    # Every trace written before RequestBlocks existed, the golden ones included.
    old = [e for e in stale_window_ids() if not isinstance(e, RequestBlocks)]
    assert ledger_of(old).violations == []


def test_ownership_survives_a_snapshot_and_older_snapshots_still_decode() -> None:
    events = list(derive(Ledger(HEADER), stale_window_ids()))
    cut = events.index(BuildBoundary(1))
    first = Ledger(HEADER)
    first.apply_all(events[:cut])
    snap = msgspec.msgpack.decode(msgspec.msgpack.encode(first.snapshot()), type=LedgerSnapshot)
    rest = Ledger.restore(snap)
    rest.apply_all(events[cut:])
    assert [v.code for v in rest.violations] == ["store-of-foreign-block"]
    # A snapshot from before the fields existed: they default, and nothing is checked.
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(first.snapshot()))
    for key in ("owners_known", "owned", "written", "owned_due"):
        del raw[key]
    old = Ledger.restore(msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=LedgerSnapshot))
    assert not old.tables.owners_known and old.tables.owned == {}


def test_a_finished_requests_ownership_is_forgotten_after_its_next_build() -> None:
    led = Ledger(HEADER)
    led.apply_all([*_prologue(), BlockFree(0, (1, 2)), RequestFinished(0), BuildBoundary(1)])
    assert 0 in led.tables.owned
    led.apply(BuildBoundary(2))
    assert 0 not in led.tables.owned and led.tables.owned_due == {}


def test_kvreplay_check_finds_it_in_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "stale.kvj"
    with JournalWriter.create(path, HEADER) as w:
        w.append(list(derive(Ledger(HEADER), stale_window_ids())))
    code = main(["check", str(path)])
    out = capsys.readouterr().out
    assert code == 1
    assert "I5 store-of-foreign-block" in out and "request a" in out
