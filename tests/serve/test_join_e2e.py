"""A second ``vllm serve`` starts on a budget the first has filled, at default settings.

Engine A (vLLM's CPU build, kvcached's default reserve and prefix-cache cap) is loaded until its
prefix cache holds its whole KV cache, which is the whole 64 MiB budget, and then sits idle.
Engine B starts naming the same budget: its start waits in ``Budget.join`` with its floor (one
request of ``max_model_len``, 32 MiB) claimed; A's ledger service sees the claim on its next tick
and gives back, reserve first, then cached blocks by page, down to what B needs; B starts and
serves; A serves again. A sampler reads the budget and both workers' KV memory (under the
budget's lock) throughout.

What trips: without A's tick (``LiveControl.tick`` returning at once) B's start is refused after
its ``KVCACHED_JOIN_WAIT_S`` in one line ("budget join-e2e has 0 B free for this engine's 32
MiB"), before upstream kvcached's users' "can't start two models", as an OutOfBlocksError
traceback.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcached.testing.tiny_model import build
from kvcached.vllm.testing import elastic
from kvcached.vllm.testing.e2e import ERROR_SIGNATURES, Server, ServerConfig

pytestmark = pytest.mark.vllm

MiB = 1 << 20
BUDGET = 64 * MiB  # A's whole KV cache
FLOOR = 32 * MiB  # one request of max_model_len 2,048: 16 blocks of 128 tokens, 2 MiB each
JOIN_WAIT_S = 300  # a bound on a condition, for a loaded machine


def _config(model: str, runtime: Any, out: Any) -> ServerConfig:
    env = {
        "XDG_RUNTIME_DIR": str(runtime),
        "KVCACHED_PAGE_SIZE_MB": elastic.PAGE_MB,  # a page of one block per layer
        "KVCACHED_BUDGET": "join-e2e",
        "KVCACHED_BUDGET_BYTES": str(BUDGET),
        "KVCACHED_JOIN_WAIT_S": str(JOIN_WAIT_S),
        "KVCACHED_DUMP_DIR": str(out),
    }
    return ServerConfig(model=model, kvcached=True, env=env, kv_cache_bytes=elastic.KV_BYTES)


@pytest.fixture(scope="module")
def joined(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    model = str(build(tmp_path_factory.mktemp("tiny-llama-join")))
    out = tmp_path_factory.mktemp("join")
    runtime = tmp_path_factory.mktemp("rt")
    a = Server(_config(model, runtime, out), out / "join-A.log")
    b = Server(_config(model, runtime, out), out / "join-B.log")
    seen: dict[str, Any] = {}
    sampler = None
    try:
        a.start()
        assert a.wait_ready(timeout=elastic.STARTUP_S), a.log()[-3000:]
        sampler = elastic.Sampler("join-e2e", str(runtime / "kvcached"), {"A": a.worker_pid()})
        sampler.engines = {elastic.engine_pid(runtime, a): "A"}
        sampler.start()
        loads = elastic.prompts("join A", 4, 6500)  # 8 blocks each: 32 blocks, A's whole cache
        seen["a_first"] = [a.complete(p, k) for p, k in loads]
        # The first prompt again, now from A's prefix cache: what A serves after the join is
        # compared with the one of these two that took the same path (as many cached tokens);
        # a cached and an uncached prefill of one prompt differ in the last bits on a CPU.
        seen["a_warm"] = a.complete(*loads[0])
        seen["a_full"] = sampler.wait_for(lambda s: s.used >= BUDGET - 2 * MiB, 60.0)
        sampler.phase = "B joins"
        b.start()
        seen["b_ready"] = b.wait_ready(timeout=elastic.STARTUP_S + JOIN_WAIT_S)
        if seen["b_ready"]:
            sampler.workers = {**sampler.workers, "B": b.worker_pid()}  # a new dict: the sampler iterates it
            sampler.engines = {**sampler.engines, elastic.engine_pid(runtime, b): "B"}
            sampler.phase = "both serve"
            seen["b_served"] = [b.complete(p, k) for p, k in elastic.prompts("join B", 2, 6500)]
            seen["a_again"] = [a.complete(p, k) for p, k in loads[:1]]
            seen["end"] = sampler.sample()
    finally:
        if sampler is not None:
            sampler.stop()
        for s in (b, a):
            s.stop()
    seen["samples"] = sampler.samples if sampler is not None else []
    seen["logs"] = {"A": a.log(before_stop=True), "B": b.log(before_stop=True) if b.log_path.exists() else ""}
    return seen


def test_a_second_engine_starts_on_a_budget_the_first_filled(joined: dict[str, Any]) -> None:
    assert joined["a_full"] is not None, "A never filled the budget: the scenario shows nothing"
    assert joined["b_ready"], joined["logs"]["B"][-3000:]
    waited = [line for line in joined["logs"]["B"].splitlines() if "waited" in line and "give back" in line]
    assert waited, "B started without waiting: the budget was not full when it joined"
    print(waited[0])
    assert all(c.ok for c in joined["b_served"]), [c.status for c in joined["b_served"]]


def test_the_idle_engine_gave_back_down_to_what_the_joiner_needs(joined: dict[str, Any]) -> None:
    end = joined["end"]
    assert end.share["A"] <= BUDGET - FLOOR, end
    assert end.share["A"] >= 2 * MiB, "A gave back more than was asked"  # not everything


def test_the_idle_engine_serves_again_as_it_did(joined: dict[str, Any]) -> None:
    after = joined["a_again"][0]
    served = {c.cached_tokens: c for c in (joined["a_first"][0], joined["a_warm"])}
    assert after.ok and after.cached_tokens in served, (after.cached_tokens, sorted(served))
    before = served[after.cached_tokens]
    assert after.tokens == before.tokens and after.max_logprob_diff(before) == 0.0


def test_the_budget_and_each_workers_share_held_throughout(joined: dict[str, Any]) -> None:
    samples = joined["samples"]
    assert len(samples) > 20, "the sampler hardly ran"
    assert not [s for s in samples if s.size is None or s.used > s.size]
    ahead = [
        (s.t, s.phase, n, r, s.share.get(n, 0))
        for s in samples
        for n, r in s.resident.items()
        if n not in s.dead and r > s.share.get(n, 0)
    ]
    assert not ahead, ahead[:5]


def test_no_error_in_either_log(joined: dict[str, Any]) -> None:
    for name, log in joined["logs"].items():
        bad = [line for line in log.splitlines() if ERROR_SIGNATURES.search(line)]
        assert not bad, (name, bad[:5])
