"""Model kinds beyond the llama (issue 28), on vLLM's CPU build.

First, that the tiny models of ``kvcached.testing.tiny_kinds`` are witnesses at all: each kind,
built with transformers' own config class, must give different greedy next tokens for the
validation prompts (with transformers' default init every prompt got the same token, so a wrong
KV block could not show). Then the seed's served protocol on a sliding-window kind (Gemma3-style,
window 32 alternating with full attention: two KV cache groups, the kind where kvcached PR #598's
case 3 lives): native vLLM and kvcached under ``ledger`` launched with the same flags give the
same greedy tokens, top-5 logprobs and cached-token counts over two passes with a prefix-cache
reset between, and the ledger's journal replays clean; under ``legacy``, with the same pages, the
journal of the same load shows the freed-block copy (I1: a page unmapped under a store job).
``KVCACHED_CAPTURE_DIR=traces`` keeps both journals as golden traces (serve-gemma3.*.kvj).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcached.testing.tiny_kinds import KINDS, build
from kvcached.vllm.testing.e2e import (
    Completion,
    Server,
    keep_trace,
    replay_check,
    validation_config,
    validation_passes,
    validation_prompts,
)

pytestmark = pytest.mark.vllm


def _first_tokens(path: Path) -> list[int]:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for prompt, _ in validation_prompts():
            ids = tok(prompt, return_tensors="pt").input_ids
            out.append(int(model(ids).logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_answers_prompts_differently(kind: str, tmp_path: Path) -> None:
    firsts = _first_tokens(build(tmp_path / kind, kind))
    # Measured at seed 0: 5 to 10 distinct tokens of 10 per kind; one would mean a useless witness.
    assert len(set(firsts)) >= 4, f"{kind}: greedy first tokens {firsts}"


def _serve(model: str, policy: str | None, out: Path, env: dict[str, str]) -> tuple[Server, list[Completion]]:
    journal = out / f"{policy}.kvj" if policy else None
    cfg = validation_config(model, policy, journal)
    if policy:
        cfg.env.update(env)
    server = Server(cfg, out / f"{policy or 'native'}.log").start()
    try:
        assert server.wait_ready(), server.log()[-3000:]
        outputs, resets = validation_passes(server)
        assert resets == [True, True]
    finally:
        server.stop()
    return server, outputs


def test_sliding_window_kind_served_like_native(tmp_path: Path) -> None:
    model = str(build(tmp_path / "gemma3", "gemma3"))
    _, native = _serve(model, None, tmp_path, {})
    # Pages of one 64 KiB block (per layer region), so that a freed block's page really goes.
    pages = {"KVCACHED_PAGE_SIZE_MB": "0.0625"}
    server, ours = _serve(model, "ledger", tmp_path, pages)
    _, legacy = _serve(model, "legacy", tmp_path, pages)
    assert sum(c.cached_tokens or 0 for c in native[10:]) > 0, "native never loaded from the CPU tier"
    assert len({c.tokens for c in native[:10]}) > 5, "the model answers prompts alike"
    for i, (a, b) in enumerate(zip(native, ours, strict=True)):
        assert a.ok and b.ok, (a.status, b.status)
        assert b.tokens == a.tokens, f"request {i}: {b.text!r} != native {a.text!r}"
        assert b.max_logprob_diff(a) == 0.0, f"request {i}: top-5 logprobs differ"
        assert b.cached_tokens == a.cached_tokens, f"request {i}: cached {b.cached_tokens} != {a.cached_tokens}"
    assert "policy=ledger" in server.log()
    rc, report = replay_check(tmp_path / "ledger.kvj", timeout=300)
    assert rc == 0 and "clean" in report, report
    rc, report = replay_check(tmp_path / "legacy.kvj", timeout=300)
    assert rc == 1 and "I1 unmap-under-job" in report, report
    differ = [i for i, (a, b) in enumerate(zip(native, legacy, strict=True)) if a.tokens != b.tokens]
    print(f"gemma3 legacy: {len(differ)} of 20 outputs differ from native ({differ}); {report.splitlines()[-2]}")
    keep_trace(tmp_path / "ledger.kvj", "serve-gemma3.ledger.kvj")
    keep_trace(tmp_path / "legacy.kvj", "serve-gemma3.legacy.kvj")
