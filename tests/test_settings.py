"""Settings: one rule for every ``KVCACHED_*`` variable, one line per refusal.

Blank is the default everywhere; anything else parses exactly as its kind within its bounds or
is refused with a ``ConfigError`` naming the variable, the value and what to set. Upstream
kvcached's names keep upstream's meaning; unknown names get one warning line each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.errors import ConfigError
from kvcached.settings import SETTINGS, UPSTREAM_ONLY, Settings, unknown_settings

ROOT = Path(__file__).resolve().parent.parent
NUMERIC = (
    "KVCACHED_PAGE_SIZE_MB",
    "KVCACHED_MIN_RESERVED_PAGES",
    "KVCACHED_MAX_RESERVED_PAGES",
    "KVCACHED_MAX_CACHED_TOKENS",
)
# "\u0661" is an Arabic-Indic one, which int() would take; "1_000", which int() and float() take.
NOT_NUMBERS = ("nan", "NaN", "inf", "-inf", "infinity", "1e400", "1e3", "0x10", "1_000", "\u0661", "2,5", "5 MB", "--1")


def refusal(env: dict[str, str]) -> str:
    with pytest.raises(ConfigError) as e:
        Settings.from_env(env)
    return str(e.value)


def one_line_naming(message: str, name: str, raw: str) -> None:
    assert "\n" not in message, message
    assert message.startswith(f"{name}={raw!r}: "), message
    assert "; set " in message, message


@pytest.mark.parametrize("name", NUMERIC)
@pytest.mark.parametrize("raw", NOT_NUMBERS)
def test_every_number_refuses_what_is_not_one_in_one_line(name: str, raw: str) -> None:
    one_line_naming(refusal({name: raw}), name, raw)


@pytest.mark.parametrize(
    ("name", "raw", "why"),
    [
        ("KVCACHED_PAGE_SIZE_MB", "1" + "0" * 30, "out of range"),  # a page of 1e30 MiB
        ("KVCACHED_PAGE_SIZE_MB", "2048", "out of range"),
        ("KVCACHED_PAGE_SIZE_MB", "0", "out of range"),
        ("KVCACHED_PAGE_SIZE_MB", "-2", "not a size"),
        ("KVCACHED_PAGE_SIZE_MB", "0.1", "4 KiB units"),  # 104857.6 bytes
        ("KVCACHED_PAGE_SIZE_MB", "9" * 40, "too long"),
        ("KVCACHED_MIN_RESERVED_PAGES", "2.5", "not a whole number"),  # was silently 2
        ("KVCACHED_MAX_RESERVED_PAGES", "2.0", "not a whole number"),
        ("KVCACHED_MAX_RESERVED_PAGES", "1000001", "out of range"),
        ("KVCACHED_MIN_RESERVED_PAGES", "-1", "no sign"),  # refused as the sizes refuse a sign
        ("KVCACHED_MAX_CACHED_TOKENS", "10000000000", "out of range"),
        ("KVCACHED_MAX_CACHED_TOKENS", "16000.5", "not a whole number"),
        ("ENABLE_KVCACHED", "maybe", "not a flag"),
        ("KVCACHED_CONTIGUOUS_LAYOUT", "2", "not a flag"),
        ("KVCACHED_BACKEND", "rocm", "not one of auto, cuda, host"),
        ("KVCACHED_LEDGER_POLICY", "optimistic", "not one of "),
    ],
)
def test_absurd_fractional_and_misspelt_values_are_refused(name: str, raw: str, why: str) -> None:
    message = refusal({name: raw})
    assert "\n" not in message and message.startswith(f"{name}=") and "; set " in message, message
    assert why in message, message


def test_a_refusal_shows_a_long_or_multiline_value_on_one_short_line() -> None:
    message = refusal({"KVCACHED_LEDGER_POLICY": "ledger\n" * 10_000})
    assert "\n" not in message and len(message) < 200 and "..." in message


def test_sizes_are_exact() -> None:
    def page(mib: str) -> int:
        return Settings.from_env({"KVCACHED_PAGE_SIZE_MB": mib}).page_bytes

    assert page("2") == 2 << 20 and page("18") == 18 << 20  # 18: what kv_memory suggests for MLA's blocks
    assert page("0.25") == 256 << 10 and page("0.00390625") == 4096 and page(" 2.5 ") == 2560 << 10
    assert page("1024") == 1 << 30 and page("2.") == 2 << 20


@pytest.mark.parametrize(
    ("raw", "is_set"), [(None, False), ("", False), ("  ", False), ("2", True), (" 1.03515625", True)]
)
def test_settings_know_whether_the_page_size_was_set(raw: str | None, is_set: bool) -> None:
    """Unset (or blank) lets kvcached choose a page for a block the default does not fit
    (kvcached/page_size.py); a value the user set, even the default's, is theirs."""
    s = Settings.from_env({} if raw is None else {"KVCACHED_PAGE_SIZE_MB": raw})
    assert s.page_bytes_set is is_set
    assert s.page_bytes == (1085440 if "1.03" in (raw or "") else 2 << 20)


@pytest.mark.parametrize("blank", ["", " ", "\t\n"])
def test_blank_means_the_default_for_every_setting(blank: str) -> None:
    default = Settings.from_env({})
    assert default == Settings()
    for var in SETTINGS:
        assert Settings.from_env({var.name: blank}) == default, var.name


def test_max_cached_tokens_has_upstreams_meaning_and_default() -> None:
    assert Settings.from_env({}).max_cached_tokens == 16_000  # upstream's MAX_CACHED_TOKENS default
    assert Settings.from_env({"KVCACHED_MAX_CACHED_TOKENS": "-1"}).max_cached_tokens is None  # upstream: no cap
    assert Settings.from_env({"KVCACHED_MAX_CACHED_TOKENS": "-5"}).max_cached_tokens is None
    assert Settings.from_env({"KVCACHED_MAX_CACHED_TOKENS": "0"}).max_cached_tokens == 0
    blocks = {t: Settings(max_cached_tokens=t).max_cached_blocks(16) for t in (None, 0, 8, 16, 16_000)}
    assert blocks == {None: None, 0: 0, 8: 1, 16: 1, 16_000: 1000}  # upstream floors a positive cap at one block


def test_flags_words_and_counts_read_as_before() -> None:
    s = Settings.from_env(
        {
            "ENABLE_KVCACHED": "TRUE",
            "KVCACHED_CONTIGUOUS_LAYOUT": "off",
            "KVCACHED_BACKEND": " Host ",
            "KVCACHED_LEDGER_POLICY": "LEGACY",
            "KVCACHED_MIN_RESERVED_PAGES": "0",
            "KVCACHED_MAX_RESERVED_PAGES": "0",
            "KVCACHED_LEDGER_JOURNAL": "/tmp/a run.kvj",
        }
    )
    assert (s.enabled, s.contiguous_layout, s.backend, s.policy.value) == (True, False, "host", "legacy")
    assert (s.min_reserved_pages, s.max_reserved_pages, s.journal) == (0, 0, "/tmp/a run.kvj")
    message = refusal({"KVCACHED_MIN_RESERVED_PAGES": "7", "KVCACHED_MAX_RESERVED_PAGES": "2"})
    assert "\n" not in message and "KVCACHED_MIN_RESERVED_PAGES=7 is above KVCACHED_MAX_RESERVED_PAGES=2" in message


def test_unknown_variables_get_one_warning_line_each() -> None:
    env = {
        "KVCACHED_PAGESIZE_MB": "4",  # a typo
        "KVCACHED_SOMETHING": "1",
        "KVCACHED_IPC_NAME": "x",  # upstream's, not read here
        "KVCACHED_LOG_LEVEL": "DEBUG",
        "KVCACHED_PAGE_SIZE_MB": "2",  # known
        "KVCACHED_LEDGER_SOCKET": "/tmp/s.sock",  # known: kvctl's
        "VLLM_FOO": "1",  # not ours to judge
    }
    lines = unknown_settings(env)
    assert len(lines) == 4 and all("\n" not in line for line in lines)
    by_name = {n: line for n in env for line in lines if n in line}
    assert "did you mean KVCACHED_PAGE_SIZE_MB?" in by_name["KVCACHED_PAGESIZE_MB"]
    assert "unknown kvcached environment variable KVCACHED_SOMETHING (ignored)" in by_name["KVCACHED_SOMETHING"]
    assert "upstream kvcached's and does not apply here" in by_name["KVCACHED_IPC_NAME"]
    assert "VLLM_LOGGING_LEVEL" in by_name["KVCACHED_LOG_LEVEL"]
    assert unknown_settings({v.name: "" for v in SETTINGS}) == []
    assert all(name.startswith("KVCACHED_") for name in UPSTREAM_ONLY)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"KVCACHED_PAGE_SIZE_MB": "nan"}, "KVCACHED_PAGE_SIZE_MB='nan': "),  # was a traceback
        ({"KVCACHED_MAX_RESERVED_PAGES": "1e400"}, "KVCACHED_MAX_RESERVED_PAGES='1e400': "),
        ({"KVCACHED_LEDGER_POLICY": "optimistic"}, "KVCACHED_LEDGER_POLICY='optimistic': "),  # was two lines
    ],
)
def test_the_plugin_refuses_in_exactly_one_line(env: dict[str, str], needle: str) -> None:
    """What vLLM's plugin loader runs (``register``) prints one line and exits non-zero (without
    vLLM's handlers here, through logging's last resort: the message alone, on stderr)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))}
    r = subprocess.run(
        [sys.executable, "-c", "from kvcached.vllm import plugin; plugin.register()"],
        capture_output=True,
        text=True,
        env={**clean, "ENABLE_KVCACHED": "1", **env},
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode != 0
    lines = (r.stderr + r.stdout).splitlines()
    assert len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith(f"[kvcached] refused: {needle}") and "Traceback" not in r.stderr


def test_with_kvcached_off_its_other_settings_do_not_stop_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    # The plugin is loaded by every vLLM process once kvcached is installed; off, it must do
    # nothing at all, whatever else KVCACHED_* holds.
    from kvcached.vllm import plugin

    monkeypatch.delenv("ENABLE_KVCACHED", raising=False)
    monkeypatch.setenv("KVCACHED_PAGE_SIZE_MB", "nan")
    plugin.register()
    monkeypatch.setenv("ENABLE_KVCACHED", "0")
    plugin.register()
    assert plugin._installed is None
    monkeypatch.setenv("ENABLE_KVCACHED", "maybe")
    with pytest.raises(SystemExit, match="ENABLE_KVCACHED"):
        plugin.register()


def test_the_journal_and_dump_settings_read_strictly_and_reach_the_served_service() -> None:
    from kvcached.service.config import service_config
    from kvcached.service.ledger_service import Durability

    s = Settings.from_env({})
    assert (s.max_journal_bytes, s.journal_segment_bytes, s.journal_keep_runs, s.journal_durability, s.max_dumps) == (
        4 << 30,
        256 << 20,
        3,
        "interval",
        20,
    )
    s = Settings.from_env(
        {
            "KVCACHED_LEDGER_JOURNAL": "/tmp/j",
            "KVCACHED_MAX_JOURNAL_BYTES": "1G",
            "KVCACHED_JOURNAL_SEGMENT_BYTES": "64M",
            "KVCACHED_JOURNAL_KEEP_RUNS": "0",
            "KVCACHED_JOURNAL_DURABILITY": "Batch",
            "KVCACHED_MAX_DUMPS": "5",
        }
    )
    cfg = service_config(s, "/tmp/sock")
    assert (cfg.max_bytes, cfg.rotate_bytes, cfg.keep_runs, cfg.durability, cfg.max_dumps) == (
        1 << 30,
        64 << 20,
        0,
        Durability.BATCH,
        5,
    )
    assert Settings.from_env({"KVCACHED_MAX_JOURNAL_BYTES": "0"}).max_journal_bytes == 0  # no bound
    for name, raw, why in (
        ("KVCACHED_JOURNAL_DURABILITY", "always", "not one of none, interval, batch"),
        ("KVCACHED_JOURNAL_SEGMENT_BYTES", "1K", "out of range"),
        ("KVCACHED_MAX_DUMPS", "0", "out of range"),
        ("KVCACHED_JOURNAL_KEEP_RUNS", "-1", "no sign"),
        ("KVCACHED_JOURNAL_KEEP_RUNS", "2.5", "not a whole number"),
        ("KVCACHED_MAX_JOURNAL_BYTES", "4 gigs", "not a size"),
    ):
        message = refusal({name: raw})
        one_line_naming(message, name, raw)
        assert why in message, message


def test_a_journal_bound_below_two_segments_is_refused_in_one_line_naming_both() -> None:
    message = refusal({"KVCACHED_MAX_JOURNAL_BYTES": "300M"})
    assert "\n" not in message, message
    assert "KVCACHED_MAX_JOURNAL_BYTES=300 MiB" in message and "KVCACHED_JOURNAL_SEGMENT_BYTES=256 MiB" in message
    assert "at least 512 MiB" in message
    small = {"KVCACHED_MAX_JOURNAL_BYTES": "300M", "KVCACHED_JOURNAL_SEGMENT_BYTES": "150M"}
    assert Settings.from_env(small).max_journal_bytes == 300 << 20


def test_placement_reads_strictly_and_reaches_the_served_engine() -> None:
    from kvcached.kv_cache_manager import Placement
    from kvcached.settings import PLACEMENT

    assert set(PLACEMENT.words) == {p.value for p in Placement}  # the words are the rules, all of them
    assert Settings.from_env({}).placement == Placement.WHOLE_PAGES.value
    assert Settings.from_env({"KVCACHED_PLACEMENT": "Best-Fit"}).placement == "best-fit"
    message = refusal({"KVCACHED_PLACEMENT": "tightest"})
    one_line_naming(message, "KVCACHED_PLACEMENT", "tightest")
    assert "whole-pages" in message and "best-fit" in message, message
