"""Which vLLM releases kvcached serves: the patch table's version ranges and the startup check.

Runs without vLLM: the table (``kvcached.vllm.patches``) and the check
(``kvcached.vllm.api_server.checks.check_vllm_version``) are plain data and rules. A release
older than the oldest tested is refused in one line; a tested one passes silently; an untested
newer one (0.34.1, 0.35.0) serves with one warning line unless ``KVCACHED_STRICT_VERSIONS=1``,
its targets checked where they are installed; a moved target is two rows, one range each.
"""

from __future__ import annotations

import pytest

from kvcached.errors import ConfigError
from kvcached.settings import Settings
from kvcached.vllm import patches
from kvcached.vllm.api_server import checks
from kvcached.vllm.api_server.checks import check_vllm_version


@pytest.mark.parametrize(
    ("text", "release"),
    [("0.34.0", (0, 34, 0)), ("0.32.0+cpu", (0, 32, 0)), ("0.35.0rc1", (0, 35, 0)), ("0.34", (0, 34, 0))],
)
def test_a_version_string_names_its_release(text: str, release: tuple[int, int, int]) -> None:
    assert patches.release(text) == release


def test_an_unreadable_version_is_a_one_line_error() -> None:
    with pytest.raises(ConfigError, match="cannot read vLLM's version 'dev'") as e:
        patches.release("dev")
    assert "\n" not in str(e.value)


def test_each_tested_release_passes_and_an_older_one_is_refused() -> None:
    for v in patches.TESTED:
        assert check_vllm_version(v) is None and checks.tested(v)
    assert check_vllm_version("0.32.0+cpu") is None  # the CPU build's local version
    with pytest.raises(ConfigError) as e:
        check_vllm_version("0.29.0")
    assert "\n" not in str(e.value) and "this is 0.29.0" in str(e.value) and patches.OLDEST in str(e.value)


@pytest.mark.parametrize("version", ["0.34.1", "0.35.0", "0.33.1"])
def test_an_untested_release_warns_once_or_under_strict_is_refused(version: str) -> None:
    warning = check_vllm_version(version)
    assert warning is not None and "\n" not in warning and version in warning and patches.NEWEST in warning
    assert not checks.tested(version)
    with pytest.raises(ConfigError, match="KVCACHED_STRICT_VERSIONS=1") as e:
        check_vllm_version(version, strict=True)
    assert "\n" not in str(e.value)
    assert Settings.from_env({"KVCACHED_STRICT_VERSIONS": "1"}).strict_versions


def test_every_row_holds_for_a_range_and_moved_targets_do_not_overlap() -> None:
    rows = (*patches.PATCHES, *patches.RELIED_ON)
    for p in rows:
        lo = patches.release(p.since)
        assert lo >= patches.release(patches.OLDEST), p.name
        if p.until is not None:
            assert patches.release(p.until) > lo, p.name
    # Rows with one target (a module's or class's attribute): at most one holds for any release.
    for version in (*patches.TESTED, "0.34.1", "0.35.0"):
        held: dict[tuple[str, ...], str] = {}
        for p in rows:
            if p.holds_for(version) and not p.optional:
                key = tuple(p.targets())
                assert key not in held, f"{version}: {p.name} and {held[key]} both patch {key}"
                held[key] = p.name


def test_a_moved_target_is_two_rows_and_the_table_picks_one() -> None:
    old, new = patches.by_name("block hash field"), patches.by_name("block hash field (0.34)")
    assert old.attrs == ("_block_hash",) and new.attrs == ("block_hash",)
    assert old.holds_for("0.33.0") and not old.holds_for("0.34.0")
    assert new.holds_for("0.34.0") and new.holds_for("0.35.0") and not new.holds_for("0.33.0")
    assert old.range == f"{patches.OLDEST} to 0.33.x" and new.range == "0.34.0 on"
    v1 = patches.by_name("page decisions applied before each step")
    v2 = patches.by_name("page decisions applied before each step (V2 runner)")
    assert v1.until == "0.34.0" and v2.since == "0.34.0" and not v2.optional  # required where V1 is gone


def test_kvcached_info_says_whether_the_engines_release_was_tested() -> None:
    from kvcached.vllm.api_server import metrics

    assert "tested" in metrics.SERIES["info"][2] and "vllm_version" in metrics.SERIES["info"][2]
    tested = metrics.Collector(1).tested
    assert tested("0.34.0") and tested("0.32.0+cpu")
    assert not tested("0.35.0") and not tested("sglang 0.5.23") and not tested("?")
