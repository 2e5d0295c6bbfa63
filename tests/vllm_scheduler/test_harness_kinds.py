"""Every model kind of the harness (``kv_specs.KINDS``) on vLLM 0.33's real scheduler and
OffloadingConnector, with kvcached's pages underneath, under both policies.

Each kind is planned by vLLM's own ``get_kv_cache_groups`` (Gemma3's 5:1 pattern is six groups,
Qwen3-Next's three Gated DeltaNet layers and one full layer four, with vLLM's hybrid block size
and state padding); a prompt is stored, the prefix cache reset, and the prompt with its output
sent again, so every group's blocks load back from the CPU tier and are checked byte for byte.
Under ``ledger`` every byte is right and nothing is violated; under ``legacy`` (a page unmapped
as soon as it is empty) the sliding-window kinds lose a window block a store still had to copy
(case 3 of kvcached PR #598: wrong bytes restored and I1), which shows these checks can fail.
vLLM's refusals of the Mamba cache modes it does not run with prefix caching are pinned too.
"""

from __future__ import annotations

import pytest

from kvcached.vllm.patches import VLLM
from kvcached.vllm.testing import scenarios
from kvcached.vllm.testing.harness import Harness, HarnessConfig
from kvcached.vllm.testing.kv_specs import KINDS
from kvsim.on_vllm.draw import KINDS as SIM_KINDS

pytestmark = pytest.mark.vllm

# What each kind is made of, as vLLM plans it: (group spec classes, tokens per block).
PLANNED = {
    "full": (["FullAttentionSpec"], 16),
    "gemma3": (["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"], 16),
    "gpt-oss": (["SlidingWindowSpec", "FullAttentionSpec"], 16),
    "sliding": (["SlidingWindowSpec"], 16),
    "mla": (["MLAAttentionSpec"], 16),
    "qwen3-next": (["MambaSpec"] * 3 + ["FullAttentionSpec"], 64),
}


def _config(kind: str) -> HarnessConfig:
    # Chunked prefills (64 tokens a step) so that window blocks leave the window while the
    # request still runs, and its stores are still to be copied.
    return HarnessConfig(kind=kind, num_layers=SIM_KINDS[kind].layers, num_gpu_blocks=160, max_num_batched_tokens=64)


def _run(kind: str, policy: str) -> scenarios.Outcome:
    body = scenarios._twice(300 if kind != "qwen3-next" else 600, 3, with_output=True)
    return scenarios._run(kind, policy, _config(kind), body, None)


@pytest.mark.parametrize("kind", KINDS)
def test_vllm_plans_the_kind_as_the_simulation_assumes(kind: str) -> None:
    with Harness(_config(kind)) as h:
        groups = h.kv_cache_config.kv_cache_groups
        assert ([type(g.kv_cache_spec).__name__ for g in groups], h.block_size) == PLANNED[kind]
        sim = SIM_KINDS[kind]
        assert (sim.block_size, sim.groups, sim.group_block_bytes) == (h.block_size, len(groups), h.block_bytes)
        assert len(h.state_groups) == sim.state_groups
        if kind == "mla":  # one 576-wide latent per token, no V: 18 KiB a block, no power of two
            assert h.page_bytes == 16 * 576 * 2 and h.page_bytes & (h.page_bytes - 1)
        if kind == "qwen3-next":
            # vLLM's hybrid alignment: the 64-token attention page holds the 7,680-byte state,
            # padded to it; the worker copies the state's real bytes only.
            assert h.page_bytes == 8192 and h.real_bytes == [7680, 7680, 7680, 8192]
            assert all(g.kv_cache_spec.mamba_cache_mode == "align" for g in groups[:3])


@pytest.mark.parametrize("kind", KINDS)
def test_the_ledger_restores_every_group_byte_for_byte(kind: str) -> None:
    out = _run(kind, "ledger")
    assert out.loads_checked > 0, "nothing was loaded back: the check checked nothing"
    assert scenarios.as_expected(out), out.line()


@pytest.mark.parametrize("kind", ["gemma3", "gpt-oss"])
def test_legacy_loses_a_window_block_a_store_still_copies(kind: str) -> None:
    # The sliding-window scenario's request (one output, finished in its last prefill step):
    # a window block leaves the window, is freed and its page unmapped while its store waits.
    out = scenarios._run(kind, "legacy", _config(kind), scenarios._twice(300, 1), None)
    assert out.wrong_blocks > 0 and any(v.startswith("I1") for v in out.violations), out.line()
    assert scenarios.as_expected(scenarios._run(kind, "ledger", _config(kind), scenarios._twice(300, 1), None))


def test_a_wrong_state_block_is_caught() -> None:
    # Planted: the CPU tier's copies are zeroed between the passes, so the second pass restores
    # zeros; the state groups' loads (a state, not token slots) must say so as the full group's do.
    with Harness(_config("qwen3-next")) as h:
        prompt = h.make_prompt(600, seed=1)
        h.add_request(prompt=prompt, max_tokens=3)
        h.run_until_idle(100)
        for w in h.transfer_workers:
            for t in w.host_tensors:
                t.zero_()
        assert h.reset_prefix_cache()
        h.add_request(prompt=prompt, max_tokens=1)
        h.run_until_idle(100)
        bad = h.verify_loads()
        assert {m.group for m in bad} == {0, 1, 2, 3} and all(m.all_zero for m in bad)
        # A state block is one state: its position is the block's last token.
        states = [m for m in bad if m.group == 0]
        assert {m.bad_positions for m in states} == {(m.block_index * 64 + 63,) for m in states}


@pytest.mark.parametrize(
    ("mode", "refusal"),
    [
        ("none", "Mamba prefix caching requires mamba_cache_mode='align'"),
        ("all", "Input should be 'align' or 'none'"),
    ],
)
def test_vllm_refuses_other_mamba_cache_modes_with_prefix_caching(mode: str, refusal: str) -> None:
    import vllm

    release = VLLM.parse(vllm.__version__)
    if mode == "none" and release < VLLM.parse("0.33.0"):
        # 0.33's MambaManager.__init__ asserts this; earlier ones have no such assert and build
        # the scheduler with prefix caching on and mamba_cache_mode='none' (kvsim draws align only).
        pytest.skip(f"vLLM {vllm.__version__}'s MambaManager accepts mamba_cache_mode='none' with prefix caching")
    if mode == "all" and release < VLLM.parse("0.32.0"):
        pytest.skip(f"vLLM {vllm.__version__} still has mamba_cache_mode='all' (0.32 removed it)")
    with pytest.raises(Exception, match=refusal):
        Harness(HarnessConfig(kind="qwen3-next", num_layers=1, mamba_cache_mode=mode))


def test_legacy_loses_a_mistral_window_block_while_the_request_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # Sliding layers only (one SlidingWindowSpec group, window 16): the store built in step 1
    # holds a window block that step 2's schedule drops from the window (frees) before the
    # worker copies it, 19 steps before the request finishes: case 3 without a full-attention
    # group. Pages of one block, so the freed block's page empties at once.
    monkeypatch.setattr(scenarios, "PAGE_BLOCKS", 1)
    cfg = HarnessConfig(kind="sliding", sliding_window=16, max_num_batched_tokens=64)
    seen: dict[str, object] = {}

    def body(h: Harness, kvc: scenarios.Kvcached) -> None:
        prompt = h.make_prompt(111, seed=1)
        first = h.add_request(prompt=prompt, max_tokens=20)
        h.run_until_idle()
        seen["copies"] = [(c.step, c.req_id) for c in h.freed_block_copies]
        seen["finished"] = next(r.step for r in h.history if first in r.finished_req_ids)
        assert h.reset_prefix_cache()
        h.add_request(prompt=prompt + h.output_tokens(first)[:5], max_tokens=1)

    legacy = scenarios._run("sliding", "legacy", cfg, body, None)
    assert legacy.wrong_blocks > 0 and any(v.startswith("I1") for v in legacy.violations), legacy.line()
    assert seen["copies"] == [(2, "req-0")] and seen["finished"] > 2
    ledger = scenarios._run("sliding", "ledger", cfg, body, None)
    assert scenarios.as_expected(ledger) and ledger.loads_checked > 0, ledger.line()
