"""kvvalidate as a user runs it, on this CPU: the seed's basic case on each engine, and its witness.

``kvvalidate run vllm-tiny_llama-kv sglang-tiny_llama-kv --exact`` starts, per case, a native
server and a kvcached one (vLLM's CPU build from this environment, SGLang 0.5.23 from
``KVCACHED_SGLANG_PYTHON``), runs the seed's phases and prints the seed's checks by name; every one
must pass, and ``summary.json`` must hold every request's tokens. The witness is the same vLLM case
with the bug planted (``--policy legacy`` at kvcached PR #598's reproduction settings: no cached
blocks, no reserve; the tiny cases' pages hold one block): the run must fail, on
``journal_clean``, with the freed page the ledger saw unmapped under a store. The limit and elastic cases are
``test_validate_cases_e2e.py`` (a module of its own, so that the two run on two workers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from validate_run import kvvalidate, rows

pytestmark = pytest.mark.vllm

CASES = ("vllm-tiny_llama-kv", "sglang-tiny_llama-kv")
REPRO = ("KVCACHED_MAX_CACHED_TOKENS=0", "KVCACHED_MIN_RESERVED_PAGES=0", "KVCACHED_MAX_RESERVED_PAGES=0")
SEED_CHECKS = (
    "server_ready",
    "gen_seq_ok",
    "gen_conc_ok",
    "apc_0_ok",
    "apc_1_ok",
    "apc_2_ok",
    "apc_conc_ok",
    "prefix_cache_reset",
    "server_alive_after_load",
    "clean_exit_on_signal",
    "no_error_signatures",
)
COMPARED = (
    "gen_seq_tokens_equal",
    *(f"apc_{n}_{what}" for n in (0, 1, 2) for what in ("tokens_equal", "cached_tokens_equal")),
)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("validate") / "run"
    done = kvvalidate(out, *CASES, "--exact")
    return {"done": done, "rows": rows(done.stdout), "out": out}


def test_every_seed_check_passes_on_both_engines(clean: dict[str, Any]) -> None:
    done = clean["done"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    rows = clean["rows"]
    for case in CASES:
        native = case.replace("-kv", "-native")
        for check in SEED_CHECKS:
            assert rows[native, check][0] == "pass" and rows[case, check][0] == "pass", (case, check)
        assert rows[native, "kvcached_inactive"][0] == "pass" and rows[case, "kvcached_active"][0] == "pass"
        for check in (*COMPARED, "apc_reload_tokens_equal", "apc_reload_cached_tokens_equal", "journal_clean"):
            assert rows[case, check][0] == "pass", (case, check, rows[case, check])
    assert done.stderr.splitlines()[-1].startswith("kvvalidate: 2 cases, ")


def test_summary_holds_every_requests_tokens_and_cached_counts(clean: dict[str, Any]) -> None:
    summary = json.loads((clean["out"] / "summary.json").read_text())
    assert [c["case"]["name"] for c in summary["cases"]] == list(CASES)
    for part in summary["cases"]:
        for name, server in part["servers"].items():
            sizes = {phase: len(done) for phase, done in server["phases"].items()}
            assert sizes == {
                "gen_seq": 9,
                "gen_conc": 9,
                "apc_0": 4,
                "apc_1": 4,
                "apc_2": 4,
                "apc_conc": 4,
                "apc_reload": 8,
            }, name
            assert all(c["tokens"] and c["cached_tokens"] is not None for d in server["phases"].values() for c in d)
            # apc_1 finds apc_0's document in the prefix cache: the counts compared are not all zero
            assert all(c["cached_tokens"] > 0 for c in server["phases"]["apc_1"]), name
        for case in (part["case"]["name"], part["case"]["name"].replace("-kv", "-native")):
            assert (clean["out"] / case / "serve.log").stat().st_size > 0 and (clean["out"] / case / "cmd.txt").exists()


def test_the_planted_bug_fails_the_run_on_its_journal(tmp_path: Path) -> None:
    sets = [arg for s in REPRO for arg in ("--set", s)]
    done = kvvalidate(tmp_path / "legacy", CASES[0], "--exact", "--policy", "legacy", *sets)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-2000:]
    failed = {k: v for k, v in rows(done.stdout).items() if v[0] == "FAIL"}
    # The journal shows the freed-block copy; what the copy read may also change tokens (the
    # host backend's unmapped page), never a server check.
    assert (CASES[0], "journal_clean") in failed, failed
    assert all(case == CASES[0] and (check.endswith("_equal") or check == "journal_clean") for case, check in failed)
    assert failed[CASES[0], "journal_clean"][1].startswith("I1 unmap-under-job"), failed
    assert "1 failed" in done.stderr.splitlines()[-1]
