"""kvvalidate's limit and elastic cases as a user runs them, on this CPU (tests/serve runs it).

The seed's limit case on each engine: a fill, a lowered limit reached while idle and held under
load, lifted and regrown, probes unchanged. The seed's elastic case for SGLang + SGLang (a vLLM
and an SGLang server on one budget are ``test_mixed_budget_e2e.py``'s, two vLLM engines
``test_budget_e2e.py``'s): A fills, gives back on its reset, B maps what A held, both loads at
once succeed, the budget never over its size. Every check of the seed, by name, must pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from validate_run import kvvalidate, rows

pytestmark = pytest.mark.vllm


LIMIT_CASES = ("limit-vllm-tiny_llama", "limit-sglang-tiny_llama")
LIMIT_CHECKS = (
    "server_ready",
    "limit_cache_filled",
    "limit_released_idle",
    "limit_requests_ok",
    "limit_held_under_load",
    "limit_set",
    "limit_raised_regrows",
    "probe_unchanged",
    "server_alive",
    "clean_exit_on_signal",
    "no_error_signatures",
    "no_process_left",
    "kvcached_active",
    "journal_clean",
)


def test_the_limit_case_on_both_engines(tmp_path: Path) -> None:
    done = kvvalidate(tmp_path / "limit", *LIMIT_CASES)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    table = rows(done.stdout)
    assert set(table) == {(case, check) for case in LIMIT_CASES for check in LIMIT_CHECKS}
    for case in LIMIT_CASES:
        # the usage went down to the limit, and back up past it once it was lifted
        assert " MiB of a " in table[case, "limit_released_idle"][1]
        summary = json.loads((tmp_path / "limit" / "summary.json").read_text())
        seen = {p["case"]["name"]: p["bytes"] for p in summary["cases"]}[case]
        assert seen["idle"] < seen["limit"] < seen["filled"] and seen["peak"] <= seen["limit"] < seen["regrown"], seen


# SGLang + SGLang alone: two vLLM engines on one budget are test_budget_e2e.py's (kvvalidate's
# vLLM + vLLM case passes too, docs/validate.md), and CI's served stage is near its time.
ELASTIC_CASES = ("elastic-sglang-tiny_llama+sglang-tiny_llama",)
ELASTIC_CHECKS = (
    "a_ready",
    "b_ready",
    "a_requests_ok",
    "b_requests_ok",
    "a_filled_memory",
    "a_released_memory",
    "b_reused_a_memory",
    "contended_requests_ok",
    "a_probe_unchanged",
    "b_probe_unchanged",
    "budget_never_over",
    *(
        f"{n}_{c}"
        for n in "ab"
        for c in (
            "alive",
            "clean_exit_on_signal",
            "no_error_signatures",
            "no_process_left",
            "kvcached_active",
            "journal_clean",
        )
    ),
)


def test_the_elastic_case_of_two_sglang_servers(tmp_path: Path) -> None:
    done = kvvalidate(tmp_path / "elastic", *ELASTIC_CASES)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    table = rows(done.stdout)
    assert set(table) == {(case, check) for case in ELASTIC_CASES for check in ELASTIC_CHECKS}, set(table) ^ {
        (case, check) for case in ELASTIC_CASES for check in ELASTIC_CHECKS
    }
