"""Two real ``vllm serve`` engines on one memory budget (vLLM's CPU build), steered with kvctl.

The scenario is ``kvcached.vllm.testing.elastic`` (the main job shows the same run): engines A and B
name one budget of 80 MiB, less than their two 64 MiB KV caches, at kvcached's default reserve and
prefix-cache cap. A is loaded until it holds most of the budget; B bursts while A idles and grows
into what A gives back toward its ask; A is limited while idle with a full prefix cache (``kvctl
limit A 8M --force``, which wakes the idle engine core itself; the scenario's fallback poke must
not be needed), B is loaded far beyond what was left, A's limit is lifted and A serves again;
then B is limited, A fills the budget, and A is killed with SIGKILL while it holds its pages: B,
loaded again, must map A's share within ``KILL_BOUND_S``. A sampler reads the budget every 0.2 s
throughout. Every completion but the burst's is compared with a native server's (same flags) on
the same prompts: greedy tokens and top-5 logprobs. The prompts of each phase are distinct, so
no prefix is shared.

What each check trips on: the burst check fails with B's ask removed (``PageAllocator._ask``
never called): B's share stays within what was its own or free, and its requests wait for each
other. The kill check stalls (B's request waits for blocks, B's share never
grows) with a zombie taken for a live engine (``budget_files._start_time`` without its state check:
this container's pid 1 reaps no orphan, so the killed engine core stays a zombie; the unit test
``test_a_sigkilled_engine_left_a_zombie_is_reclaimed`` shows the same without a server).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcached.testing.tiny_model import build
from kvcached.vllm.testing import elastic
from kvcached.vllm.testing.e2e import ERROR_SIGNATURES, Server

pytestmark = pytest.mark.vllm

MiB = 1 << 20


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = str(build(tmp_path_factory.mktemp("tiny-llama-budget")))
    out = tmp_path_factory.mktemp("budget")
    runtime = tmp_path_factory.mktemp("rt")  # XDG_RUNTIME_DIR of the servers and kvctl: no other engine seen
    cfg = elastic.server_config(model, kvcached=False, runtime=runtime, budget="e2e", dump_dir=out)
    native = Server(cfg, out / "native.log").start()  # starts while A and B do
    try:
        run = elastic.run_elastic(model, out, runtime, budget="e2e")
        assert native.wait_ready(timeout=elastic.STARTUP_S), native.log()[-3000:]
        ref = elastic.native_completions(native)
    finally:
        native.stop()
    rows = elastic.timeline_rows(run.samples)
    for name, t, ra, rb, both, used, size in rows:
        print(
            f"{name:>13} t={t:6.1f}s  A {ra // MiB:3d} MiB  B {rb // MiB:3d} MiB  A+B {both // MiB:3d} MiB  "
            f"budget {used // MiB}/{size // MiB} MiB"
        )
    return {"run": run, "native": ref}


def test_the_budget_is_never_exceeded(served: dict[str, Any]) -> None:
    run: elastic.ElasticRun = served["run"]
    assert not run.sampler_errors, run.sampler_errors[:3]
    assert len(run.samples) > 50, "the sampler hardly ran"
    over = [(s.t, s.phase, s.used, s.size) for s in run.samples if s.size is None or s.used > s.size]
    assert not over, over[:5]
    # The workers' own memory too, not only the engines' account of it (a page is 2 MiB in all),
    # read under the budget's lock (Sampler.sample): each worker within its engine's share, so
    # that no bytes went back to the budget before the worker had unmapped them, and the sum
    # within the budget.
    ahead = [
        (s.t, s.phase, n, r, s.share.get(n, 0))
        for s in run.samples
        for n, r in s.resident.items()
        if n not in s.dead and r > s.share.get(n, 0)
    ]
    assert not ahead, f"a worker held more than its engine's share (t, phase, engine, resident, share): {ahead[:5]}"
    worst = max(sum(s.resident.values()) for s in run.samples)
    assert worst <= elastic.BUDGET_BYTES, f"{worst // MiB} MiB resident in the two workers"


def test_what_a_gives_back_b_maps(served: dict[str, Any]) -> None:
    run: elastic.ElasticRun = served["run"]
    seen = run.seen
    assert seen["a_loaded"].share["A"] >= 0.75 * elastic.BUDGET_BYTES, "A did not hold most of the budget"
    left = seen["headroom_before_giveback"]
    assert seen["b_loaded"].share["B"] > left + 16 * MiB, (seen["b_loaded"], left)
    assert seen["b_loaded"].resident["B"] > left + 16 * MiB  # its worker's memory, not only its share
    for name, outs in run.completions.items():
        assert outs and all(c.ok for c in outs), (name, [c.status for c in outs])


def test_an_idle_neighbour_gives_a_bursting_engine_what_it_is_short_of(served: dict[str, Any]) -> None:
    """At default settings (each engine keeps a reserve of 5..10 pages and a prefix cache), B's
    burst is served on what idle A gives back, with no request preempted."""
    run: elastic.ElasticRun = served["run"]
    seen = run.seen
    before = seen["a_loaded"]
    had = before.share["B"] + seen["headroom_before_giveback"]  # B's own and what was free
    assert seen["b_burst_peak"] > had + 16 * MiB, (seen["b_burst_peak"] // MiB, had // MiB)
    assert seen["b_burst"].share["A"] < before.share["A"] - 16 * MiB, (before, seen["b_burst"])
    assert seen["b_burst_preemptions"] == 0
    assert [c.ok for c in run.completions["B bursts"]] == [True] * len(elastic.BURST)


def test_every_completion_equals_native_vllms(served: dict[str, Any]) -> None:
    run: elastic.ElasticRun = served["run"]
    rows = elastic.compare(run.completions, served["native"])
    assert len(rows) == sum(len(p) for p in elastic.PHASES.values())
    bad = [r for r in rows if not r[2] or r[3] != 0.0]
    assert not bad, bad


def test_an_idle_engine_with_a_full_prefix_cache_reaches_a_lowered_limit(served: dict[str, Any]) -> None:
    """Once its engine core steps (kvctl's wake-up, or a utility call that touches no request
    and no cache: see the next test), every page over the limit goes: the limit's eviction by
    page emptied them, and their grace ends at the step's build."""
    seen = served["run"].seen
    assert seen["a_loaded"].resident["A"] >= 48 * MiB, "A's prefix cache was not full before the limit"
    idle = seen["a_status_limited_idle"]["memory"]
    assert idle["in_use_pages"] <= elastic.A_IDLE_LIMIT // idle["page_bytes"], (
        "the limit did not evict the cached blocks of the pages over it",
        idle,
    )
    mem = seen["a_status_limited"]["memory"]
    assert not mem["shrink_pending"] and mem["mapped_bytes"] <= elastic.A_IDLE_LIMIT, mem
    assert seen["a_limited"].share["A"] <= elastic.A_IDLE_LIMIT
    assert seen["a_limited"].resident["A"] <= elastic.A_IDLE_LIMIT, "A's worker did not follow the limit"
    assert seen["a_raise_reply"]["limit_bytes"] >= elastic.KV_BYTES - mem["page_bytes"]
    b = seen["b_status_limited"]["memory"]
    assert not b["shrink_pending"] and b["mapped_bytes"] <= elastic.B_IDLE_LIMIT, b


def test_kvctls_own_wakeup_lets_an_idle_engine_reach_its_limit(served: dict[str, Any]) -> None:
    seen = served["run"].seen
    assert not seen["a_status_limited_poked"], seen["a_status_limited_idle"]["memory"]
    assert not seen["b_status_limited_poked"], seen["b_status_limited_idle"]["memory"]


def test_a_limited_engines_unmaps_go_back_to_the_budget(served: dict[str, Any]) -> None:
    """B's share falls to its limit once its workers applied the unmaps (``DeferredRelease``),
    idle as it is: no later step carries them."""
    seen = served["run"].seen
    b = seen["b_status_share_back"]["memory"]
    assert seen["b_share_back_after_s"] is not None, ("B's share stayed over its limit", b)
    print(f"B's share was back within its limit {seen['b_share_back_after_s']:.2f} s after it was reached")
    assert b["budget"]["unapplied"] == 0, b


def test_a_sigkilled_engines_share_is_mapped_by_the_other(served: dict[str, Any]) -> None:
    run: elastic.ElasticRun = served["run"]
    seen = run.seen
    before = seen["before_kill"]
    # A held pages when it was killed (what both held then, for a failure: their budget rows)
    states = {n: seen[f"{n}_status_a_filled"]["memory"]["budget"] for n in "ab"}
    assert before.share["A"] >= 48 * MiB, (before, states)
    assert seen["b_mapped_dead_share_after_s"] is not None, (
        f"B did not map beyond {seen['b_share_wanted'] // MiB} MiB within {elastic.KILL_BOUND_S} s of A's SIGKILL"
    )
    print(f"B mapped A's share {seen['b_mapped_dead_share_after_s']:.2f} s after the SIGKILL")
    assert seen["end"].share["B"] > seen["b_share_wanted"] and "A" not in {k for k, v in seen["end"].share.items() if v}


def test_no_error_in_the_engines_logs(served: dict[str, Any]) -> None:
    for name, log in served["run"].logs.items():
        lines = log.splitlines()
        bad = [i for i, line in enumerate(lines) if ERROR_SIGNATURES.search(line)]
        assert not bad, (name, "\n".join(lines[bad[0] : bad[0] + 25]))  # the first error, with its traceback
