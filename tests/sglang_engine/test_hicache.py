"""HiCache's copies over kvcached pages, on SGLang's real pool, allocator, host pool and controller.

The hazard (``kvcached.sglang.bridge``): ``Scheduler.flush_cache`` runs when no request is left,
but a write-through backup may still be copying; ``HiCacheController.reset`` drops its
acknowledgement and the allocator's ``clear`` frees its slots. Under ``legacy`` (unmap a page
once it is empty) the pages go at once and the copy, when it runs, reads zeros: the host tier gets
wrong bytes and the ledger records I1. Under ``ledger`` the copy's pin keeps them mapped until it
finishes; the step after, they go.
"""

from __future__ import annotations

import pytest
import torch

from kvcached.ledger.events import Policy
from kvcached.ledger.journal import read_journal
from kvcached.ledger.ledger import Ledger
from kvcached.sglang.testing.scenarios import config, flush_under_backup
from kvcached.sglang.testing.stack import HiCacheStack, same
from kvcached.testing.plants import planted


@pytest.fixture
def make(tmp_path):
    stacks: list[HiCacheStack] = []

    def build(policy: Policy) -> HiCacheStack:
        journal = str(tmp_path / f"{policy.value}-{len(stacks)}.kvj")
        s = HiCacheStack(config(policy, journal))
        stacks.append(s)
        return s

    yield build
    for s in stacks:
        s.close()


def _invariants(stack: HiCacheStack) -> set[str]:
    return {v.invariant for v in stack.engine.ledger.violations}


def test_legacy_unmaps_under_the_copy(make):
    stack = make(Policy.LEGACY)
    written, copied = flush_under_backup(stack)
    assert not same(written, copied)
    assert all(torch.count_nonzero(t) == 0 for t in copied.values()), "the copy read the unmapped pages' zeros"
    assert "I1" in _invariants(stack)


def test_ledger_keeps_the_pages_until_the_copy_is_done(make):
    stack = make(Policy.LEDGER)
    stack.step()
    slots = stack.allocator.alloc(128)
    written = stack.fill(slots, seed=1)
    host_slots = stack.controller.write(slots)
    stack.step()
    before = stack.mapped_pages
    stack.flush()
    stack.step()
    assert stack.mapped_pages == before, "pinned by the copy in flight"
    stack.copies.run()
    stack.step()  # the bridge polls the copy whose ack the reset dropped
    assert same(written, stack.host_bytes(host_slots))
    assert stack.mapped_pages == 1, "only the padding slot's page is left"
    assert _invariants(stack) == set()
    assert stack.engine.bridge.outstanding == {}


def test_without_the_poll_the_pin_never_ends(make):
    """The planted bug: the bridge forgets copies whose ack the reset dropped."""
    stack = make(Policy.LEDGER)
    with planted("no-poll"):
        written, copied = flush_under_backup(stack)
        assert same(written, copied)
        for _ in range(20):
            stack.step()
    assert stack.mapped_pages == 3
    assert "I4" in _invariants(stack)


@pytest.mark.parametrize("policy", [Policy.LEGACY, Policy.LEDGER])
def test_backup_evict_load_back(make, policy):
    """The ordinary path is safe under both policies: SGLang frees a node's slots only after its
    backup's ack, and loads into slots it has just allocated. Pages come and go with the slots."""
    stack = make(policy)
    stack.step()
    slots = stack.allocator.alloc(128)
    written = stack.fill(slots, seed=2)
    host_slots = stack.controller.write(slots)
    stack.step()
    assert stack.drain_acks() == 0, "the copy has not run"
    stack.copies.run()
    assert stack.drain_acks() == 1
    stack.step()
    # The tree evicts the node from the device (UnifiedRadixCache's FullComponent, FreeDeviceKV).
    stack.allocator.free_segment(slots, start_pos=0)
    stack.step()
    stack.step()
    assert stack.mapped_pages == 1
    device = stack.controller.load(host_slots)
    assert device is not None and stack.mapped_pages == 3
    stack.controller.start_loading()
    stack.copies.run()
    assert stack.drain_acks() == 1
    stack.step()
    assert same(written, stack.device_bytes(device))
    assert _invariants(stack) == set()


@pytest.mark.parametrize("policy", [Policy.LEGACY, Policy.LEDGER])
def test_the_journal_replays_to_the_same_findings(make, policy):
    """The journal has the vLLM engine's format; replayed, it gives what the live ledger found."""
    stack = make(policy)
    flush_under_backup(stack)
    live = [(v.invariant, v.code, v.index) for v in stack.engine.ledger.violations]
    stack.engine.recorder.close()
    contents = read_journal(stack.engine.config.journal_path)
    assert set(contents.header.producer) == {"sglang", "kvcached"}
    ledger = Ledger(contents.header)
    for ev in contents.events:
        ledger.apply(ev)
    assert [(v.invariant, v.code, v.index) for v in ledger.violations] == live
    assert ("I1" in {v[0] for v in live}) == (policy is Policy.LEGACY)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_freed_page_outlives_the_forward_that_may_read_it(make, overlap):
    """Without overlap, step k's results (and frees) come after its forward: the page may go at
    the next boundary. With overlap, step k + 1's forward is already running and may read the
    slots, so the page stays one boundary more (``Bridge.hold_frees``); the slots are free at once."""
    stack = make(Policy.LEDGER)
    stack.engine.bridge.hold_frees = overlap
    stack.step()
    slots = stack.allocator.alloc(128)
    stack.step()
    assert stack.mapped_pages == 3
    stack.allocator.free(slots)  # process_batch_result of the step the requests finished in
    assert stack.engine.manager.num_allocated == 1, "the slots are free at once (SGLang evicts, then allocates)"
    again = stack.allocator.alloc(64)  # and can be handed out again in the same step
    assert again is not None
    stack.allocator.free(again)
    stack.step()  # the next step: its forward may read them under overlap
    assert stack.mapped_pages == (3 if overlap else 1)
    stack.step()
    assert stack.mapped_pages == 1
    assert _invariants(stack) == set()


def test_an_idle_engine_records_no_boundary(make):
    """SGLang's loop steps while idle; once the ledger is settled a step records nothing (the
    planted no-poll bug above shows boundaries go on while a copy is outstanding, for I4)."""
    stack = make(Policy.LEDGER)
    ledger = stack.engine.ledger
    stack.step()
    slots = stack.allocator.alloc(64)
    assert slots is not None
    stack.step()
    stack.allocator.free(slots)
    stack.step()  # the free's grace ends here; the page goes
    stack.step()  # the boundary after the unmap, the last event
    assert stack.mapped_pages == 1 and ledger.settled
    builds, index = ledger.builds, ledger.index
    for _ in range(50):
        stack.step()
    assert (ledger.builds, ledger.index) == (builds, index), "idle steps recorded boundaries"
    assert stack.allocator.alloc(1) is not None
    stack.step()
    assert ledger.builds == builds + 1, "a step after an allocation records its boundary"
