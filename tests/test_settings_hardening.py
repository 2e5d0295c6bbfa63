"""Settings that say what they take, take what they say, and report what they did.

A refusal's words match the parser (``KVCACHED_MIN_KV_CACHE_MB`` is whole MiB, as upstream reads
it with ``int()``); a sign is refused on every non-negative number, counts and sizes alike; a
setting that has no effect on the running engine is named once as ignored; a setting the user did
not give yields to one they gave (and says so in ``Settings.notes``); and a startup refusal is one
line through vLLM's logger, with the ``[kvcached]`` prefix its other lines carry."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvcached.errors import ConfigError
from kvcached.settings import SCOPES, SETTINGS, Settings, ignored_settings

ROOT = Path(__file__).resolve().parent.parent
NON_NEGATIVE = [v.name for v in SETTINGS if v.kind == "count" and v.low >= 0]


def refusal(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as e:
        Settings.from_env(env)
    message = str(e.value)
    assert "\n" not in message and "; set " in message, message
    return message


# --- 1: KVCACHED_MIN_KV_CACHE_MB is whole MiB, as its refusal says -------------------------------


@pytest.mark.parametrize("raw", ["0.5", "2.0", "1.", ".5", "-0", "+1"])
def test_min_kv_cache_takes_whole_mib_as_its_refusal_says(raw: str) -> None:
    message = refusal({"KVCACHED_MIN_KV_CACHE_MB": raw})
    assert message.startswith(f"KVCACHED_MIN_KV_CACHE_MB={raw!r}: not a whole number of MiB (plain decimal digits)")
    assert "a whole number of MiB" in message.split("; set ", 1)[1], message


def test_min_kv_cache_reads_whole_mib_exactly() -> None:
    assert Settings.from_env({"KVCACHED_MIN_KV_CACHE_MB": "512"}).min_kv_cache_bytes == 512 << 20
    assert Settings.from_env({"KVCACHED_MIN_KV_CACHE_MB": " 0 "}).min_kv_cache_bytes == 0
    # The page size still takes exact fractions of a MiB (documented: 0.25 serves the host backend).
    assert Settings.from_env({"KVCACHED_PAGE_SIZE_MB": "0.25"}).page_bytes == 256 << 10


# --- 2: a sign is refused on every non-negative number, as the sizes refuse it --------------------


@pytest.mark.parametrize("name", NON_NEGATIVE)
@pytest.mark.parametrize("raw", ["-0", "+0", "+3", "-1"])
def test_a_sign_is_refused_on_every_non_negative_count(name: str, raw: str) -> None:
    message = refusal({name: raw})
    assert message.startswith(f"{name}={raw!r}: not a whole number (plain decimal digits, no sign)"), message


def test_sizes_and_counts_refuse_a_sign_alike_and_a_signed_count_keeps_it() -> None:
    assert "not a size" in refusal({"KVCACHED_MAX_JOURNAL_BYTES": "-0"})
    assert "no sign" in refusal({"KVCACHED_JOURNAL_KEEP_RUNS": "-0"})
    # Upstream's KVCACHED_MAX_CACHED_TOKENS is negative for no cap (read with int()): signs stay.
    assert Settings.from_env({"KVCACHED_MAX_CACHED_TOKENS": "-1"}).max_cached_tokens is None
    assert Settings.from_env({"KVCACHED_MAX_CACHED_TOKENS": "+8"}).max_cached_tokens == 8
    assert Settings.from_env({"KVCACHED_JOURNAL_KEEP_RUNS": "0"}).journal_keep_runs == 0


# --- 3: a setting the running engine does not read is named once as ignored ----------------------


def test_every_scope_names_a_setting() -> None:
    assert set(SCOPES) <= {v.name for v in SETTINGS}


def test_a_setting_that_does_not_apply_under_vllm_is_named_once_as_ignored() -> None:
    lines = ignored_settings("vllm", {"KVCACHED_CONTIGUOUS_LAYOUT": "false", "KVCACHED_PAGE_SIZE_MB": "2"})
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("KVCACHED_CONTIGUOUS_LAYOUT='false' does not apply under vLLM (")
    assert lines[0].endswith("; ignored"), lines[0]
    assert ignored_settings("vllm", {"KVCACHED_CONTIGUOUS_LAYOUT": "  "}) == []  # blank: not given
    assert ignored_settings("vllm", {}) == []


def test_a_budget_size_without_a_budget_name_is_named_as_ignored() -> None:
    (line,) = ignored_settings("vllm", {"KVCACHED_BUDGET_BYTES": "60G"})
    assert line.startswith("KVCACHED_BUDGET_BYTES='60G' sizes the budget KVCACHED_BUDGET names, and none is named")
    assert line.endswith("; ignored") and "\n" not in line
    assert ignored_settings("vllm", {"KVCACHED_BUDGET_BYTES": "60G", "KVCACHED_BUDGET": "gpu0"}) == []


def _fake_vllm_config() -> SimpleNamespace:
    """What ``check_config`` reads of a plain single-GPU ``VllmConfig``."""
    par = SimpleNamespace(pipeline_parallel_size=1, nnodes=1, tensor_parallel_size=1, distributed_executor_backend=None)
    return SimpleNamespace(parallel_config=par, kv_transfer_config=None)


def test_the_startup_checks_log_an_ignored_setting_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    from kvcached.vllm.api_server import checks

    env = {"ENABLE_KVCACHED": "1", "KVCACHED_CONTIGUOUS_LAYOUT": "0"}
    with caplog.at_level(logging.INFO, logger="vllm.kvcached"):
        checks.check_config(_fake_vllm_config(), Settings.from_env(env), version="0.33.0", on_cpu=False, env=env)
    said = [r for r in caplog.records if "KVCACHED_CONTIGUOUS_LAYOUT" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert said[0].name == "vllm.kvcached" and said[0].levelno == logging.WARNING
    assert said[0].getMessage().startswith("[kvcached] KVCACHED_CONTIGUOUS_LAYOUT='0' does not apply under vLLM")


# --- 4: a setting not given yields to one given ---------------------------------------------------


def test_a_max_reserve_given_alone_lowers_the_default_min() -> None:
    s = Settings.from_env({"KVCACHED_MAX_RESERVED_PAGES": "2"})  # upstream kvcached takes it
    assert (s.min_reserved_pages, s.max_reserved_pages) == (2, 2)
    assert s.notes == ("min reserved pages 2 (default 5 lowered to the given max)",)
    s = Settings.from_env({"KVCACHED_MIN_RESERVED_PAGES": "20"})
    assert (s.min_reserved_pages, s.max_reserved_pages) == (20, 20)
    assert s.notes == ("max reserved pages 20 (default 10 raised to the given min)",)


def test_a_reserve_within_the_defaults_or_given_in_full_is_taken_as_given() -> None:
    assert Settings.from_env({}).notes == () and Settings.from_env({}) == Settings()
    s = Settings.from_env({"KVCACHED_MAX_RESERVED_PAGES": "7"})
    assert (s.min_reserved_pages, s.max_reserved_pages, s.notes) == (5, 7, ())
    s = Settings.from_env({"KVCACHED_MIN_RESERVED_PAGES": "2", "KVCACHED_MAX_RESERVED_PAGES": "2"})
    assert (s.min_reserved_pages, s.max_reserved_pages, s.notes) == (2, 2, ())
    message = refusal({"KVCACHED_MIN_RESERVED_PAGES": "3", "KVCACHED_MAX_RESERVED_PAGES": "2"})
    assert "KVCACHED_MIN_RESERVED_PAGES=3 is above KVCACHED_MAX_RESERVED_PAGES=2" in message


# --- 5: a startup refusal is one line through vLLM's logger --------------------------------------


def test_a_startup_refusal_is_one_error_line_on_vllms_logger(caplog: pytest.LogCaptureFixture) -> None:
    from kvcached.vllm.api_server import startup

    with caplog.at_level(logging.INFO, logger="vllm.kvcached"), pytest.raises(SystemExit) as e:
        startup.refuse("kvcached: KVCACHED_BACKEND=host serves vLLM's CPU build only; use cuda or auto on GPUs")
    assert e.value.code == 1  # a non-zero exit, as before, and no second copy of the text
    (record,) = caplog.records
    assert (record.name, record.levelno) == ("vllm.kvcached", logging.ERROR)
    assert record.getMessage() == (
        "[kvcached] refused: KVCACHED_BACKEND=host serves vLLM's CPU build only; use cuda or auto on GPUs"
    )
    assert "KVCACHED_BACKEND=host" in str(e.value)  # whoever catches it can still read what was refused


def test_a_refusal_is_printed_even_where_vllms_level_hides_errors(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcached.vllm.api_server import startup

    with caplog.at_level(logging.CRITICAL, logger="vllm.kvcached"), pytest.raises(SystemExit):
        startup.refuse("KVCACHED_PAGE_SIZE_MB='nan': not a size")
    assert capsys.readouterr().err == "[kvcached] refused: KVCACHED_PAGE_SIZE_MB='nan': not a size\n"


def test_the_plugin_refuses_through_vllms_handlers_in_one_line() -> None:
    """``register`` as vLLM's plugin loader runs it: vLLM's handler (here one with a format of its
    own, as vLLM's ``DEFAULT_LOGGING_CONFIG`` installs on the ``vllm`` logger) formats the line."""
    code = (
        "import logging, sys\n"
        "h = logging.StreamHandler(sys.stdout)\n"
        "h.setFormatter(logging.Formatter('VLLM %(levelname)s %(name)s: %(message)s'))\n"
        "v = logging.getLogger('vllm'); v.addHandler(h); v.setLevel(logging.INFO); v.propagate = False\n"
        "from kvcached.vllm import plugin; plugin.register()\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))}
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**clean, "ENABLE_KVCACHED": "1", "KVCACHED_PAGE_SIZE_MB": "nan"},
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr == "", r.stderr[-2000:]
    (line,) = r.stdout.splitlines()
    assert line.startswith("VLLM ERROR vllm.kvcached: [kvcached] refused: KVCACHED_PAGE_SIZE_MB='nan': "), line
