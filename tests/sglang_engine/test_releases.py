"""SGLang releases: the tested range, an untested one, and the patch table's version ranges.

The table's rows say which releases each target holds for (``hooks.Patch.since``/``until``): a
row outside the running release is neither checked nor installed, one inside it that SGLang lacks
is refused in one line. A release older than the oldest tested is refused; a newer untested one
serves with one warning line, or is refused under ``KVCACHED_STRICT_VERSIONS=1``.
"""

from __future__ import annotations

import msgspec
import pytest

from kvcached.engine.targets import Target
from kvcached.errors import ConfigError
from kvcached.settings import Settings
from kvcached.sglang import engine, hooks
from kvcached.sglang.plugin import config_from

INSTALLED = engine.sglang_version()
MISSING = hooks.Patch(
    module="sglang.srt.mem_cache.memory_pool", owner="MHATokenToKVPool", attrs=("_not_there",), why="a planted row"
)


def _as(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    monkeypatch.setattr(engine, "sglang_version", lambda: version)


def test_the_table_is_rows_of_the_engine_neutral_record() -> None:
    assert all(isinstance(p, Target) for p in (*hooks.PATCHES, *hooks.CALLED))
    assert hooks.Patch.RELEASES is hooks.SGLANG


def test_the_installed_release_is_tested_and_has_every_target() -> None:
    assert INSTALLED in hooks.KNOWN
    assert hooks.check() is None
    assert hooks.check(strict=True) is None


def test_an_older_release_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    _as(monkeypatch, "0.5.19")
    with pytest.raises(ConfigError, match=r"supports SGLang 0\.5\.20 to 0\.5\.23 .*this is 0\.5\.19") as info:
        hooks.check()
    assert "\n" not in str(info.value)


def test_a_newer_untested_release_warns_or_under_strict_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _as(monkeypatch, "0.5.99")
    warning = hooks.check()
    assert warning is not None and "SGLang 0.5.99 is newer than" in warning and "newest 0.5.23" in warning
    with pytest.raises(ConfigError, match=r"not tested on SGLang 0\.5\.99 and KVCACHED_STRICT_VERSIONS=1"):
        hooks.check(strict=True)
    strict = config_from(Settings.from_env({"ENABLE_KVCACHED": "1", "KVCACHED_STRICT_VERSIONS": "1"}))
    assert strict.strict_versions


def test_a_row_is_checked_only_for_the_releases_it_holds_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target SGLang lacks, in a row for releases after the installed one: not checked here; the
    same row on a release it holds for: refused, naming the target."""
    future = msgspec.structs.replace(MISSING, since="0.6.0")
    monkeypatch.setattr(hooks, "PATCHES", (*hooks.PATCHES, future))
    assert hooks.check() is None
    _as(monkeypatch, "0.6.0")
    with pytest.raises(ConfigError, match=r"under SGLang 0\.6\.0: .*MHATokenToKVPool\._not_there is missing"):
        hooks.check()


def test_a_row_that_ended_before_this_release_is_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    past = msgspec.structs.replace(MISSING, until="0.5.20")
    monkeypatch.setattr(hooks, "PATCHES", (*hooks.PATCHES, past))
    assert hooks.check() is None
    monkeypatch.setattr(hooks, "PATCHES", (*hooks.PATCHES, MISSING))
    with pytest.raises(ConfigError, match="_not_there is missing"):
        hooks.check()
