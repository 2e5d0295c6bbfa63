"""Model kinds beyond the llama, served on vLLM's CPU build.

First, that the tiny models of ``kvcached.testing.tiny_kinds`` are witnesses at all: each kind,
built with transformers' own config class, must give different greedy next tokens for the
validation prompts (with transformers' default init every prompt got the same token, so a wrong
KV block could not show). Then the seed's served protocol on every kind vLLM's CPU build serves
(kvcached PR #598's GPU matrix, at toy size): native vLLM and kvcached under ``ledger`` launched
with the same flags give the same greedy tokens, top-5 logprobs and cached-token counts over two
passes with a prefix-cache reset between, and the ledger's journal replays clean; under
``legacy`` (the bug planted: a page unmapped while a store still reads it) the journal of the
same load shows the freed-block copy where the kind has it. Pages hold 128 tokens of a layer
(one block, or eight of MLA's), so that a freed block's page really goes; Mamba2's state does not
divide 2 MiB and no page size is set for it: kvcached chooses one, which the server's log must
say. Where a kind's cached-token counts depend on the GPU prefix cache that the seed's
``KVCACHED_MAX_CACHED_TOKENS=0`` empties (Qwen3-Next: see ``SERVED``), they are compared with
native vLLM under that same cache state (``plants/``), tokens and logprobs with plain
native. ``KVCACHED_CAPTURE_DIR=traces`` keeps the journals as golden traces
(``serve-<kind>.<policy>.kvj``). One test per kind, its servers shared by its checks.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Served:
    """How a kind is served here and what ``legacy`` shows for it (measured; the comments below say why)."""

    page_mb: str | None  # KVCACHED_PAGE_SIZE_MB for both kvcached servers; None: kvcached chooses
    # Whether the OffloadingConnector copies anything for the kind: vLLM turns prefix caching off
    # for a Mamba2-only model, so nothing is stored or loaded and legacy has no copy to break; the
    # test checks that no job was built rather than assume it.
    offloads: bool = True
    # Whether the kind's cached-token counts depend on the GPU prefix cache kvcached's
    # KVCACHED_MAX_CACHED_TOKENS=0 empties: then they are compared with native vLLM under that same
    # cache state (plants/sitecustomize.py, evict-on-free), and tokens and logprobs with plain native.
    counts_need_cache_state: bool = False
    # What shows that the served comparison sees the bug for this kind: "legacy" (legacy's own
    # completions differ from native's) or, where legacy's lost pages were never read back into a
    # token that changed, "zero-loads" (native with every loaded block zeroed: plants/).
    witness: str = "legacy"


# Pages of 128 tokens of one layer: 128 x 2 KV heads x 64 x (K, V) x 2 B = 64 KiB for the attention
# kinds (one block at vLLM's CPU block size; Qwen3-Next's hybrid alignment makes its block 256
# tokens, 128 KiB). MLA's latent block is 18432 B at the block 16 of vLLM's reference CPU MLA
# backend (147456 B at 128 where the CPU has AMX): 0.140625 MiB fits either, and 18432 B alone is
# no multiple of the host's 4 KiB granularity. Mamba2's 134912 B state does not divide 2 MiB, and
# no page is set for it: kvcached chooses one, which the server's log must say.
SERVED: dict[str, Served] = {
    "qwen2": Served("0.0625"),
    "gemma3": Served("0.0625"),
    "gpt_oss": Served("0.0625"),
    "mistral": Served("0.0625"),
    # vLLM's served scheduler splits a hybrid prefill at its cache_config.block_size (128), not at
    # the groups' 256 (Scheduler._mamba_block_aligned_split), so a Mamba "align" state lands on a
    # 256-token boundary only where a GPU prefix-cache hit makes a shared-prefix junction there
    # (kv_cache_manager's shared_prefix_boundary): with the cache emptied no state at 256 is saved,
    # and request 2 reports 0 cached tokens where plain native reports 256. Native with the same
    # cache state reports the same 0.
    "qwen3_next": Served("0.125", counts_need_cache_state=True, witness="zero-loads"),
    "deepseek_v2": Served("0.140625", witness="zero-loads"),
    "mamba2": Served(None, offloads=False, witness="none: no block is stored or loaded"),
}


PLANTS = Path(__file__).parent / "plants"


def _serve(
    model: str, policy: str | None, out: Path, page_mb: str | None, *, plant: str = ""
) -> tuple[Server, list[Completion], float]:
    """The server, once stopped; its completions of the validation passes; the tokens its GPU
    prefix cache served (vLLM's own ``vllm:prefix_cache_hits``)."""
    journal = out / f"{policy}.kvj" if policy else None
    cfg = validation_config(model, policy, journal)
    if plant:
        cfg.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLANTS), os.environ.get("PYTHONPATH")) if p)
        cfg.env["KVTEST_PLANTS"] = plant
    if policy:
        if page_mb is None:
            cfg.env.pop("KVCACHED_PAGE_SIZE_MB", None)
        else:
            cfg.env["KVCACHED_PAGE_SIZE_MB"] = page_mb
        cfg.env["KVCACHED_DUMP_DIR"] = str(out / f"dumps-{policy}")
    server = Server(cfg, out / f"{policy or 'native'}{'-' + plant if plant else ''}.log").start()
    try:
        assert server.wait_ready(), server.log()[-3000:]
        outputs, resets = validation_passes(server)
        assert resets == [True, True]
        hits = server.metric("vllm:prefix_cache_hits_total")
    finally:
        server.stop()
    return server, outputs, hits


def _same(a: Completion, b: Completion) -> bool:
    return a.tokens == b.tokens and a.max_logprob_diff(b) == 0.0


@pytest.mark.parametrize("kind", sorted(SERVED))
def test_kind_served_like_native(kind: str, tmp_path: Path) -> None:
    how = SERVED[kind]
    started = time.monotonic()
    model = str(build(tmp_path / kind, kind))
    _, native, native_hits = _serve(model, None, tmp_path, how.page_mb)
    server, ours, _ = _serve(model, "ledger", tmp_path, how.page_mb)
    _, legacy, _ = _serve(model, "legacy", tmp_path, how.page_mb)
    counted, counted_hits = native, native_hits
    if how.counts_need_cache_state:
        _, counted, counted_hits = _serve(model, None, tmp_path, how.page_mb, plant="evict-on-free")
    assert len({c.tokens for c in native[:10]}) > 5, f"{kind}: the model answers prompts alike"
    cached = [c.cached_tokens or 0 for c in native]
    for i, (a, b, n) in enumerate(zip(native, ours, counted, strict=True)):
        assert a.ok and b.ok and n.ok, (a.status, b.status, n.status)
        assert b.tokens == a.tokens, f"{kind} request {i}: {b.text!r} != native {a.text!r}"
        assert b.max_logprob_diff(a) == 0.0, f"{kind} request {i}: top-5 logprobs differ"
        assert b.cached_tokens == n.cached_tokens, f"{kind} request {i}: cached {b.cached_tokens} != {n.cached_tokens}"
    if how.counts_need_cache_state:
        # The cache state is what differs: native under it answers as native does.
        assert [c.tokens for c in counted] == [c.tokens for c in native]
        # ... and the hook is a witness: plain native's GPU prefix cache served tokens, the emptied
        # one none. (The counts alone need not differ: on a loaded machine, with tests/serve on two
        # workers, both runs reported the same counts, the CPU tier loading those prefixes.)
        assert native_hits > 0 and counted_hits == 0, (
            f"GPU prefix-cache hits: native {native_hits}, emptied {counted_hits}"
        )
        print(f"\n{kind}: native with kvcached's empty prefix cache: cached {[c.cached_tokens or 0 for c in counted]}")
    log = server.log()
    assert "policy=ledger" in log
    if how.page_mb is None:
        assert "[kvcached] page size: a KV block takes" in log and "chose" in log, log[-3000:]
    rc, report = replay_check(tmp_path / "ledger.kvj", timeout=300)
    assert rc == 0 and "clean" in report, report
    rc, legacy_report = replay_check(tmp_path / "legacy.kvj", timeout=300)
    differ = [i for i, (a, b) in enumerate(zip(native, legacy, strict=True)) if a.tokens != b.tokens]
    verdict = [line for line in legacy_report.splitlines() if "violation" in line or "clean" in line]
    page = re.search(r"active: backend=\w+, page=([0-9.]+ MiB)", log)
    print(
        f"\n{kind}: page {page.group(1) if page else '?'}; native cached {cached}; ledger equal; "
        f"legacy: {len(differ)} of 20 outputs differ {differ}; "
        f"{verdict[-1] if verdict else legacy_report[-300:]}; {time.monotonic() - started:.0f} s"
    )
    if how.offloads:
        assert rc == 1 and "I1 unmap-under-job" in legacy_report, legacy_report
        planted = legacy
        if how.witness == "zero-loads":
            planted = _serve(model, None, tmp_path, how.page_mb, plant="zero-loads")[1]
        seen = [i for i, (a, b) in enumerate(zip(native, planted, strict=True)) if not _same(a, b)]
        print(f"{kind}: the comparison sees the {how.witness} plant in {len(seen)} of 20 completions {seen}")
        assert seen, f"{kind}: {how.witness} changed no completion: the comparison cannot see the bug"
    else:
        assert rc == 0 and re.search(r"\b0 jobs\b", report) and re.search(r"\b0 jobs\b", legacy_report), report
    keep_trace(tmp_path / "ledger.kvj", f"serve-{kind.replace('_', '-')}.ledger.kvj")
    if how.offloads:  # a legacy golden trace is a witness of the bug (tests/test_operate.py replays its first)
        keep_trace(tmp_path / "legacy.kvj", f"serve-{kind.replace('_', '-')}.legacy.kvj")
