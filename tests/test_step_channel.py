"""The step channel without vLLM: the scheduler's decisions as a batch, applied by a worker's range.

The scheduler side is the real chain (``DecisionBackend`` per rank under a ``KVCacheManager``,
the ``PageLog``); the worker side is ``WorkerPages`` over a host range made as the served
worker makes it (``kv_memory.worker_backend``). The batches are pickled on their way, as vLLM
pickles ``SchedulerOutput`` to its workers. What vLLM does with them (every rank, before the
step, idle engines through ``collective_rpc``) is tests/serve/test_tp_e2e.py's.
"""

from __future__ import annotations

import pickle
import threading
import time
import types
import uuid

import pytest

torch = pytest.importorskip("torch")

from kvcached.budget import Budget, budget_usage  # noqa: E402
from kvcached.errors import BackendError, ConfigError  # noqa: E402
from kvcached.kv_cache_manager import KVCacheManager  # noqa: E402
from kvcached.vllm import kv_layout, step_channel  # noqa: E402
from kvcached.vllm.engine_core import control, step_sender  # noqa: E402
from kvcached.vllm.worker import kv_memory, step_receiver  # noqa: E402

PAGE = 1 << 20
PLAN = kv_layout.KVPlan(num_blocks=30, block_bytes=128 << 10, page_bytes=PAGE, regions=3, vllm_size=30 * (128 << 10))


@pytest.fixture
def ranks() -> list[step_receiver.WorkerPages]:
    out = []
    keys = [f"test-step-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    for key in keys:
        b = kv_memory.worker_backend(PLAN, device=torch.device("cpu"), backend="auto", key=key)
        b.tensor(torch.uint8).fill_(3)  # vLLM's warm-up writes the whole cache
        out.append(step_receiver.WorkerPages(b, PLAN))
    yield out
    for key in keys:
        kv_memory.release(key)


def _engine(
    policy: str = "legacy", budget: Budget | None = None
) -> tuple[KVCacheManager, step_channel.PageLog, step_channel.DeferredRelease | None]:
    g = PLAN.geometry
    log = step_channel.PageLog(g.blocks_per_page)
    backends = [step_sender.DecisionBackend(PAGE, "host", g.num_pages, log if r == 0 else None) for r in range(2)]
    for b in backends:
        b.reserve(g.backend_pages)
    deferred = None if budget is None else step_channel.DeferredRelease(budget, log)
    manager = KVCacheManager.standalone(
        g,
        backends[0],
        replicas=backends[1:],
        workers=2,
        policy=policy,
        budget=deferred,  # type: ignore[arg-type]
    )
    return manager, log, deferred


def _send(log: step_channel.PageLog, ranks: list[step_receiver.WorkerPages]) -> tuple[int, ...]:
    message = pickle.loads(pickle.dumps(log.take()))
    for r in ranks:
        r.apply(message)
    return message  # type: ignore[no-any-return]


def test_decisions_reach_every_rank_in_every_region(ranks: list[step_receiver.WorkerPages]) -> None:
    manager, log, _ = _engine()
    g = PLAN.geometry
    assert manager.page_cost == PAGE * g.regions * 2  # a page costs its bytes on both ranks
    warm = ranks[0].backend.resident_bytes()
    assert warm >= g.backend_pages * PAGE  # the warm-up's writes are resident
    blocks = manager.alloc(17)  # 8 blocks a page: pages 0, 1, 2
    assert not any(r.backend.mapped_count for r in ranks)  # nothing applied before the step
    message = _send(log, ranks)
    assert message == (1, g.blocks_per_page, 0, 1, 2)
    for r in ranks:
        b = r.backend
        assert b.mapped_pages() == [reg * g.num_pages + p for reg in range(g.regions) for p in range(3)]
        assert b.resident_bytes() <= 3 * g.regions * PAGE  # batch 1 dropped what warm-up wrote
    manager.free(blocks)
    assert ranks[0].backend.mapped_count == 3 * g.regions  # decided, not yet applied
    message = _send(log, ranks)
    assert message == (2, g.blocks_per_page, ~0, ~1, ~2)
    assert all(r.backend.mapped_count == 0 and r.backend.resident_bytes() == 0 for r in ranks)
    assert _send(log, ranks) == (3, g.blocks_per_page)  # a step with no decisions still counts


def test_an_unmaps_budget_bytes_go_back_once_every_rank_applied_it(
    ranks: list[step_receiver.WorkerPages], tmp_path
) -> None:
    """The scheduler decides an unmap; the workers' memory goes when their batch is applied. A
    budget given the bytes back at the decision let a neighbour map them while both ranks still
    held the page: the sum of the workers' memory over the budget (and on a GPU, a neighbour's
    ``cuMemCreate`` failing)."""
    g = PLAN.geometry
    cost = PAGE * g.regions * 2
    mine = Budget.open("steps", 3 * cost, directory=str(tmp_path))
    neighbour = Budget.open("steps", directory=str(tmp_path))
    manager, log, deferred = _engine(budget=mine)
    assert deferred is not None
    try:
        blocks = manager.alloc(17)  # pages 0, 1, 2: the whole budget
        manager.drain_releasable()  # the end of the scheduler call: an unspent lease goes back
        _send(log, ranks)
        assert budget_usage("steps", directory=str(tmp_path)).used == 3 * cost

        def resident() -> int:
            return sum(r.backend.resident_bytes() for r in ranks)

        for r in ranks:  # the step writes its KV: the pages' memory is resident
            for slot in r.backend.mapped_pages():
                r.backend.tensor(torch.uint8)[slot * PAGE : (slot + 1) * PAGE].fill_(1)
        assert resident() == 3 * cost
        manager.free(blocks)  # legacy: the three pages are unmapped, as decisions
        assert neighbour.acquire_up_to(cost, cost) == 0, "the budget gave back memory both ranks still hold"
        message = _send(log, ranks)  # the step carries the batch; the workers unmap before their forward
        assert message[2:] == (~0, ~1, ~2) and resident() == 0
        assert log.held_bytes == 3 * cost and neighbour.acquire_up_to(cost, cost) == 0
        assert deferred.release_applied(message[0] - 1) == 0  # an earlier batch's output: not these pages
        assert deferred.release_applied(message[0]) == 3 * cost  # this step's output: they are gone
        assert neighbour.acquire_up_to(3 * cost, cost) == 3 * cost and log.held_bytes == 0
    finally:
        neighbour.close()
        mine.close()


def test_a_lost_batch_or_another_layout_is_refused(ranks: list[step_receiver.WorkerPages]) -> None:
    _manager, log, _ = _engine()
    _send(log, ranks)
    log.take()  # an executor that dropped this one
    with pytest.raises(step_channel.ChannelError, match="batch 3 reached this worker after batch 1"):
        ranks[0].apply(log.take())
    with pytest.raises(step_channel.ChannelError, match="puts 4 blocks on a page, this worker's KV layout 8"):
        ranks[1].apply((2, 4))


def test_the_unmap_waits_for_every_rank_under_ledger(ranks: list[step_receiver.WorkerPages]) -> None:
    """Under ``ledger`` a freed page waits for its grace build; the decision, and only it, rides."""
    from kvcached.ledger.events import BuildBoundary

    manager, log, _ = _engine("ledger")
    blocks = manager.alloc(8)
    _send(log, ranks)
    manager.free(blocks)
    assert _send(log, ranks)[2:] == ()  # pinned: no unmap decided yet
    assert all(r.backend.mapped_count == PLAN.regions for r in ranks)
    for n in range(2):
        manager.recorder.emit(BuildBoundary(n))
        manager.drain_releasable()
    assert _send(log, ranks)[2:] == (~0,)
    assert all(r.backend.mapped_count == 0 for r in ranks)


def test_decision_backends_hold_no_bytes() -> None:
    b = step_sender.DecisionBackend(PAGE, "host", 4, None)
    b.reserve(4)
    b.map_page(0)
    with pytest.raises(BackendError, match="already mapped"):
        b.map_page(0)  # the backend contract holds on the scheduler's side too
    with pytest.raises(ConfigError, match="the scheduler holds no KV bytes"):
        b.tensor()
    assert b.resident_bytes() == 0


def test_after_warm_up_a_worker_holds_what_was_decided_and_says_so(ranks, caplog) -> None:
    """The first batch's pages and nothing more are mapped once warm-up's are dropped; a range
    holding more (a runner that allocated around kvcached: the whole cache backed, the server
    healthy) is refused in one line rather than served as if elastic."""
    import logging

    manager, log, _ = _engine()
    manager.alloc(9)  # pages 0 and 1
    good, bad = ranks
    bad.backend.map_page(PLAN.geometry.num_pages - 1)  # backed outside the scheduler's decisions
    message = pickle.loads(pickle.dumps(log.take()))
    with caplog.at_level(logging.INFO, logger="vllm.kvcached"):
        good.apply(message)
    (line,) = [r.getMessage() for r in caplog.records if "after warm-up" in r.getMessage()]
    assert f"after warm-up 2 of {PLAN.geometry.num_pages} pages mapped (6 MiB), as decided" in line, line
    with pytest.raises(step_channel.ChannelError) as e:
        bad.apply(message)
    msg = str(e.value)
    assert "\n" not in msg and "has 7 page slots mapped, the scheduler decided 6" in msg, msg


def test_a_batch_is_due_for_kept_bytes_alone_and_goes_with_the_next_take() -> None:
    """Budget bytes kept for unmaps make a batch due even with no decision left to send (an
    idle engine's flush asks ``pending``), so they are never kept past the next take."""
    log = step_channel.PageLog(8)
    assert not log.pending and log.due_for(time.monotonic()) == 0.0
    log.hold(3 * PAGE)
    t0 = time.monotonic()
    assert log.pending and log.due_for(t0 + 5) >= 5
    log.record(~1)
    assert log.due_for(t0 + 5) >= 5  # due since the first, not the latest
    assert log.take() == (1, 8, ~1) and not log.pending and log.held_bytes == 3 * PAGE
    log.hold(PAGE)
    assert log.take() == (2, 8) and log.applied(2) == 4 * PAGE and not log.pending


def test_the_tick_wakes_an_engine_core_whose_decisions_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine core blocked on its input queue sends its decisions only when woken; the
    ledger service's tick wakes it once they have waited ``STALE_BATCH_S``, and not before."""
    woken: list[bool] = []

    class Engine:  # what LiveControl.tick reads of engine_core.engine.Engine
        lock = threading.RLock()
        page_log = step_channel.PageLog(8)
        budget = None
        manager = None

        def wake(self) -> None:
            woken.append(True)

    engine = Engine()
    live = control.LiveControl(engine, None, PAGE)  # type: ignore[arg-type]
    live.tick()
    engine.page_log.record(~0)
    live.tick()
    assert not woken  # just decided: on its way with a step or a flush
    later = time.monotonic() + control.STALE_BATCH_S + 1
    monkeypatch.setattr(control, "time", types.SimpleNamespace(monotonic=lambda: later))
    live.tick()
    assert woken == [True]
    engine.page_log.take()
    live.tick()
    assert woken == [True]


def test_kvctl_status_shows_the_engines_share_and_its_unapplied_unmaps(tmp_path, status_reply) -> None:
    """What an engine holds of a shared budget, as the budget's file says, and how much of it
    waits for its workers to apply unmaps: the row an operator reads when a neighbour cannot
    grow into what this engine gave up."""
    from kvcached.engine.control import with_budget
    from kvcached.service.messages import MemoryStatus
    from kvctl import render

    mine = Budget.open("status", 64 * PAGE, directory=str(tmp_path))
    neighbour = Budget.open("status", directory=str(tmp_path))
    try:
        assert mine.acquire_up_to(24 * PAGE, PAGE) == 24 * PAGE and neighbour.acquire_up_to(8 * PAGE, PAGE)
        bare = MemoryStatus(
            page_bytes=PAGE,
            num_pages=64,
            mapped_pages=8,
            in_use_pages=8,
            reserved_pages=0,
            limit_pages=8,
            shrink_pending=False,
            waiting_on={},
            reason="within the limit",
        )
        m = with_budget(bare, mine, unapplied=16 * PAGE)
        assert m.budget is not None and (m.budget.used, m.budget.share, m.budget.unapplied) == (
            32 * PAGE,
            24 * PAGE,
            16 * PAGE,
        )
        row = dict(render.status_rows(status_reply(memory=m)))["budget"]
        assert row == (
            "status: 32 MiB used of 64 MiB, 24 MiB by this engine (16 MiB of unmaps its workers have not applied yet)"
        )
    finally:
        neighbour.close()
        mine.close()
