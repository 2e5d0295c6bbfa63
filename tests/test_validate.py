"""kvvalidate without servers: the matrix as data, its command line's failures, and the seed's
comparison rules (more than half of the prompts equal native's; ``--exact``: all, logprobs too)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.vllm.testing.e2e import Completion
from kvvalidate import cases, checks
from kvvalidate.cli import main


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvvalidate", *argv], capture_output=True, text=True, timeout=120)


def test_the_seeds_basic_matrix_is_both_engines_times_its_three_models() -> None:
    basic = cases.MATRICES["seed-basic"]
    assert {(c.engine, c.model.short) for c in basic} == {
        (e, m) for e in ("vllm", "sglang") for m in ("qwen05b", "qwen35_4b", "gemma4e2b")
    }
    assert all(c.gpu_only and c.tp == 1 and not c.kv_dtype for c in basic)
    # vLLM's native Qwen3.5 server takes the 1024-token blocks the seed gives it; kvcached's does not.
    qwen35 = next(c for c in basic if c.name == "vllm-qwen35_4b-kv")
    assert qwen35.native_flags == ("--block-size", "1024")
    weekly = cases.MATRICES["seed-weekly"]
    assert {c.tp for c in weekly} == {1, 2} and {c.kv_dtype for c in weekly} == {"", "fp8", "fp8_e4m3"}
    assert not any(c.gpu_only for c in cases.MATRICES["cpu"])


def test_find_takes_matrices_and_cases_in_order_each_once() -> None:
    found = cases.find(["vllm-tiny_llama-kv", "cpu"])
    assert found[0].name == "vllm-tiny_llama-kv" and len(found) == len(cases.MATRICES["cpu"])
    with pytest.raises(KeyError):
        cases.find(["vllm-nope"])


def test_list_prints_every_case_with_where_it_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list", "seed-basic", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "sglang-qwen35_4b-kv" in out and "GPU only" in out and "vllm-tiny_llama-kv" in out
    assert "refused by kvcached here" in out  # SGLang's hybrid rows say why they fail today


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "vllm-nope"], "no case or matrix 'vllm-nope'"),
        (["run", "cpu", "--set", "PAGE=1"], "give KVCACHED_NAME=VALUE"),
        (["run", "cpu", "--policy", "none"], "invalid choice"),
        (["list", "--rows", "3"], "unrecognized arguments"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_2(argv: list[str], says: str) -> None:
    done = _run(*argv)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and says in done.stderr and "Traceback" not in done.stderr


def test_an_existing_output_folder_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "mine.txt").write_text("keep")
    done = _run("run", "vllm-tiny_llama-kv", "--device", "cpu", "-o", str(tmp_path))
    assert done.returncode == 2 and "exists: name a new folder" in done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


def test_gpu_cases_on_a_cpu_are_skipped_saying_why_and_nothing_left_fails(tmp_path: Path) -> None:
    done = _run("run", "seed-basic", "--device", "cpu", "-o", str(tmp_path / "run"))
    assert done.returncode == 1, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 7 and lines[-1].startswith("kvvalidate: nothing to run on a CPU")
    assert all("skipped on a CPU (GPU only:" in line for line in lines[:-1])
    assert not (tmp_path / "run").exists()


def _c(tokens: str, cached: int | None = 0, lp: float = -0.5) -> Completion:
    return Completion(200, tokens, tuple(tokens), tuple(((t, lp),) for t in tokens), cached, 0.1)


def _served(name: str, gen: list[Completion], apc: list[Completion], *, kvcached: bool) -> checks.Served:
    phases = {
        "gen_seq": gen,
        "gen_conc": gen,
        **{p: apc for p in ("apc_0", "apc_1", "apc_2", "apc_conc", "apc_reload")},
    }
    return checks.Served(name, "vllm", kvcached, True, phases, True, True, 0.5, [], "")


def test_tokens_equal_is_the_seeds_majority_and_exact_asks_for_all() -> None:
    native = _served("n", [_c("ab"), _c("cd"), _c("ef")], [_c("xy", 16)], kvcached=False)
    one_off = _served("k", [_c("ab"), _c("cd"), _c("eX")], [_c("xy", 16)], kvcached=True)
    seed = {c.name: c for c in checks.compare("k", native, one_off, exact=False)}
    assert (
        seed["gen_seq_tokens_equal"].ok
        and "1 of 3 prompts differ; prompt 2: token 1" in seed["gen_seq_tokens_equal"].detail
    )
    exact = {c.name: c for c in checks.compare("k", native, one_off, exact=True)}
    assert not exact["gen_seq_tokens_equal"].ok
    two_off = _served("k", [_c("Xb"), _c("cX"), _c("ef")], [_c("xy", 16)], kvcached=True)
    assert not {c.name: c for c in checks.compare("k", native, two_off, exact=False)}["gen_seq_tokens_equal"].ok
    # Same tokens, other logprobs: the seed's rule passes, --exact does not.
    shifted = _served("k", [_c("ab"), _c("cd"), _c("ef", lp=-0.4)], [_c("xy", 16)], kvcached=True)
    assert not {c.name: c for c in checks.compare("k", native, shifted, exact=True)}["gen_seq_tokens_equal"].ok


def test_cached_tokens_must_equal_natives_for_every_request() -> None:
    native = _served("n", [_c("ab")], [_c("xy", 16), _c("zw", 16)], kvcached=False)
    ours = _served("k", [_c("ab")], [_c("xy", 16), _c("zw", 0)], kvcached=True)
    found = {c.name: c for c in checks.compare("k", native, ours, exact=True)}
    assert found["apc_0_tokens_equal"].ok
    assert not found["apc_0_cached_tokens_equal"].ok
    assert found["apc_0_cached_tokens_equal"].detail == "prompt 1: native 16, kvcached 0"


def test_server_checks_name_what_went_wrong() -> None:
    log = "INFO ready\nERROR kvcached: invariant I1 violated at event 4\nTraceback (most recent call last):\n"
    bad = checks.Served("k", "sglang", True, True, {}, False, False, None, [4242], log)
    found = {c.name: c for c in checks.server_checks(bad)}
    assert not found["gen_seq_ok"].ok and not found["prefix_cache_reset"].ok
    assert not found["clean_exit_on_signal"].ok and found["no_process_left"].detail == "pids 4242"
    # kvcached's own report of a freed-block copy is journal_clean's to judge, the traceback is not
    assert found["no_error_signatures"].detail == "Traceback (most recent call last):"
    assert not found["kvcached_active"].ok
    assert [
        c.name for c in checks.server_checks(checks.Served("n", "vllm", False, False, {}, False, False, None, [], ""))
    ] == ["server_ready"]


def test_the_limit_cases_are_the_seeds_on_one_kvcached_server() -> None:
    seed = {c.name: c for c in cases.MATRICES["seed-limit"]}
    assert set(seed) == {"limit-vllm-qwen05b", "limit-sglang-qwen05b"}
    assert all(c.scenario == "limit" and c.model.short == "qwen05b" and not c.native_flags for c in seed.values())
    cpu = [c.name for c in cases.MATRICES["cpu"] if c.scenario == "limit"]
    assert cpu == ["limit-vllm-tiny_llama", "limit-sglang-tiny_llama"]


def test_the_elastic_cases_are_the_seeds_three_pairs() -> None:
    pairs = {(c.engine, c.partner) for c in cases.MATRICES["cpu"] if c.scenario == "elastic"}
    assert pairs == {("vllm", "sglang"), ("sglang", "sglang"), ("vllm", "vllm")}


def test_run_prints_the_table_a_line_per_case_and_writes_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command's own work, with the servers left out: each case's checks as the runner gives them."""
    from kvvalidate import runner

    def fake(case: cases.Case, opts: runner.Options, say: object) -> tuple[list[checks.Check], dict[str, object]]:
        assert opts.on_cpu and opts.exact and opts.settings == {"KVCACHED_MIN_RESERVED_PAGES": "0"}
        ok = case.engine == "vllm"
        found = [
            checks.Check(case.name, "server_ready", True),
            checks.Check(case.name, "journal_clean", ok, "" if ok else "I1 x"),
        ]
        return found, {"case": case}

    monkeypatch.setattr(runner, "run_case", fake)
    out = tmp_path / "run"
    argv = ["run", "vllm-tiny_llama-kv", "sglang-tiny_llama-kv", "--device", "cpu", "--exact", "-o", str(out)]
    assert main([*argv, "--set", "KVCACHED_MIN_RESERVED_PAGES=0"]) == 1
    got = capsys.readouterr()
    table = got.out.splitlines()
    assert table[0].split() == ["case", "check", "result", "detail"] and len(table) == 5
    assert table[-1].split() == ["sglang-tiny_llama-kv", "journal_clean", "FAIL", "I1", "x"]
    lines = got.err.splitlines()
    assert lines[0].startswith("kvvalidate: vllm-tiny_llama-kv: all 2 checks passed (")
    assert lines[1].startswith("kvvalidate: sglang-tiny_llama-kv: 1 of 2 checks failed: journal_clean (")
    assert lines[2] == f"kvvalidate: 2 cases, 4 checks, 1 failed; logs and summary.json in {out}"
    summary = json.loads((out / "summary.json").read_text())
    assert [c["case"]["name"] for c in summary["cases"]] == ["vllm-tiny_llama-kv", "sglang-tiny_llama-kv"]
    assert [p.name for p in out.iterdir()] == ["summary.json"]  # no temporary left beside it
