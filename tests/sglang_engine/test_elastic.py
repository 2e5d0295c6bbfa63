"""Elastic under SGLang: a memory limit, and one budget shared by engines (``kvcached.budget``).

An idle engine's emptied pages go back to the budget and a busy one maps them; the budget is the
same file-backed one vLLM engines join, so it does not care which engine is which.
"""

from __future__ import annotations

import time

import msgspec

from kvcached.ledger.events import Policy
from kvcached.page_allocator import RETRY_SHORT_LEASE
from kvcached.sglang.testing.scenarios import config
from kvcached.sglang.testing.stack import HiCacheStack

PAGE_COST = 4096 * 4  # a page in each of 2 layers' K and V regions


def test_two_sglang_engines_share_one_budget(tmp_path, stacks) -> None:
    budget = {"budget": "shared", "budget_bytes": 4 * PAGE_COST, "budget_dir": str(tmp_path)}
    busy = HiCacheStack(msgspec.structs.replace(config(Policy.LEDGER), **budget))
    stacks.append(busy)
    busy.step()
    slots = busy.allocator.alloc(128)  # the padding page and two more: 3 of the 4 pages
    assert slots is not None and busy.mapped_pages == 3
    idle = HiCacheStack(msgspec.structs.replace(config(Policy.LEDGER), **budget))
    stacks.append(idle)
    idle.step()
    assert idle.mapped_pages == 1  # its padding page: the budget is spent
    assert idle.allocator.alloc(64) is None, "no page left in the budget"
    busy.allocator.free(slots)  # its requests end; the pages go at the next step
    busy.step()
    assert busy.mapped_pages == 1
    # A count made while the budget was short is trusted this long (PageAllocator.count_key).
    time.sleep(RETRY_SHORT_LEASE)
    got = idle.allocator.alloc(128)
    assert got is not None and idle.mapped_pages == 3


def test_a_limit_bounds_what_the_allocator_hands_out(stacks) -> None:
    stack = HiCacheStack(config(Policy.LEDGER))
    stacks.append(stack)
    stack.step()
    stack.engine.manager.set_limit_pages(2)  # the padding page and one more
    assert stack.allocator.available_size() == 127
    assert stack.allocator.alloc(128) is None  # SGLang's scheduler then evicts from its tree
    slots = stack.allocator.alloc(127)
    assert slots is not None and stack.mapped_pages == 2
    stack.allocator.free(slots)
    stack.step()
    stack.engine.manager.set_limit_pages(8)
    assert stack.allocator.available_size() == 511


def test_an_engine_counting_between_steps_leases_nothing(tmp_path, stacks, monkeypatch) -> None:
    """SGLang asks ``available_size`` on every turn of its event loop, idle or not (its idle
    checks, its stats): a lease each count took and kept to the next step would hold the whole
    room of the budget an idle engine could map, so another engine could map none of it. Nor
    may a count take the room even for a moment: an idle SGLang counts hundreds of times a
    second, and a neighbour counting while the room was leased saw the budget full (in
    ``tests/serve/test_mixed_budget_e2e.py``, vLLM then reused its own cache rather than grow)."""
    budget = {"budget": "between", "budget_bytes": 4 * PAGE_COST, "budget_dir": str(tmp_path)}
    idle = HiCacheStack(msgspec.structs.replace(config(Policy.LEDGER), **budget))
    stacks.append(idle)
    idle.step()
    shared = idle.engine.budget
    assert shared is not None
    taken: list[int] = []
    acquire = shared.acquire_up_to
    monkeypatch.setattr(shared, "acquire_up_to", lambda n, unit: taken.append(n) or acquire(n, unit))
    assert idle.allocator.available_size() == 4 * 64 - 1  # what it could map: the whole budget
    assert taken == [], "a count no allocation follows took the budget's room"
    assert shared.usage().used == PAGE_COST, "the count kept its lease: only the padding page is mapped"
    other = HiCacheStack(msgspec.structs.replace(config(Policy.LEDGER), **budget))
    stacks.append(other)
    other.step()  # it maps its padding page: the idle engine's count sees the room shrink
    assert idle.allocator.available_size() == 3 * 64 - 1


def test_counts_within_a_step_hold_their_lease_until_its_end(tmp_path, stacks) -> None:
    """Within ``get_next_batch_to_run`` SGLang counts for the batch, then allocates, maybe in
    several allocs (a load-back, then the extend): what the counts promised stays leased until
    the step ends, so another engine cannot take it between them (an alloc SGLang's count
    promised and kvcached refused is SGLang's "out of memory" error, which ends the scheduler)."""
    budget = {"budget": "within", "budget_bytes": 4 * PAGE_COST, "budget_dir": str(tmp_path)}
    one = HiCacheStack(msgspec.structs.replace(config(Policy.LEDGER), **budget))
    other = HiCacheStack(msgspec.structs.replace(config(Policy.LEDGER), **budget))
    stacks.extend((one, other))
    one.step()
    other.step()
    bridge = one.engine.bridge
    bridge.step()  # a step begins: admission counts, then allocations
    # The padding pages hold 2 of the 4 pages: its own (63 free slots) and 2 more.
    assert one.allocator.available_size() == 63 + 2 * 64
    assert one.allocator.alloc(32) is not None  # the first of the batch's allocs
    assert other.allocator.available_size() == 63, "the other engine sees only its own padding page"
    assert other.allocator.alloc(64) is None
    assert one.allocator.alloc(159) is not None, "what the count promised was still leased"
    bridge.step_done()
    assert one.mapped_pages == 3
