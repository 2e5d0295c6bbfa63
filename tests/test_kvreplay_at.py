"""``kvreplay show --at TIME``: from a wall-clock time on a dashboard to the build in the journal.

The trace is a PR #598 scenario under legacy (its freed-block copy is an I1 in build 1) with
its build boundaries stamped as a served engine stamps them: build b closes b+1 seconds after
the header's clock base. Each test would fail if the boundary's time were read wrongly (off by
a build), if a naive ISO time were taken as UTC rather than local, or if a trace without times
were answered instead of refused.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvcached.ledger.events import BuildBoundary, Event, Policy
from kvcached.ledger.journal import JournalWriter
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.simulate import derive
from kvcached.testing.seed_cases import SCENARIOS
from kvreplay.cli import main

BASE = 1796306400.0  # 2026-12-03 14:00:00 UTC


def stamped(events: list[Event]) -> list[Event]:
    return [BuildBoundary(e.build, (e.build + 1) * 1_000_000) if type(e) is BuildBoundary else e for e in events]


def trace(tmp_path: Path, clock: bool = True) -> str:
    sc = SCENARIOS["finish-in-write-step"]()
    h = msgspec.structs.replace(sc.header, policy=Policy.LEGACY, clock_base_unix=BASE if clock else 0.0)
    events = list(derive(Ledger(h), sc.events))
    path = tmp_path / ("timed.kvj" if clock else "plain.kvj")
    with JournalWriter.create(path, h) as w:
        w.append(stamped(events) if clock else events)
    return str(path)


def local_iso(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix).isoformat()  # naive: local time, as a dashboard shows it


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def kolkata(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Local time 5:30 ahead of UTC, so that a naive time read as UTC lands five builds away."""
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.usefixtures("kolkata")
def test_the_build_running_at_a_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = trace(tmp_path)
    code, out, err = run(capsys, "show", path, "--at", local_iso(BASE + 1.5), "--no-progress")
    assert (code, err) == (0, ""), err
    lines = out.splitlines()
    assert "build 1 was running" in lines[0] and "(0.500 s before)" in lines[0] and "(0.500 s after)" in lines[0]
    assert any(line.startswith("  !! I1 unmap-under-job") for line in lines), out
    closing = next(line for line in lines if "BuildBoundary(build=1) at " in line)
    assert closing.split(" at ")[1].startswith(dt.datetime.fromtimestamp(BASE + 2).isoformat(" ")[:19])
    assert lines[-1].startswith("at its close: ") and "1 violation so far" in lines[-1]
    # The same instant as a Unix time, and with an explicit offset, is the same build.
    for spelling in (str(BASE + 1.5), dt.datetime.fromtimestamp(BASE + 1.5, dt.UTC).isoformat()):
        code, again, _ = run(capsys, "show", path, "--at", spelling, "--no-progress")
        assert code == 0 and again.splitlines()[1:] == lines[1:]


def test_json_names_the_build_and_its_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "show", trace(tmp_path), "--at", str(BASE + 0.25), "--json", "--no-progress")
    doc = json.loads(out)
    assert code == 0 and doc["build"] == 0 and doc["began"] == BASE  # the first build began with the engine
    assert doc["closed"] == BASE + 1 and doc["events"][-1]["event"].startswith("BuildBoundary(build=0) at ")


def test_a_time_outside_the_trace_says_its_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = trace(tmp_path)
    for at, words in ((BASE - 60, "is before its engine started"), (BASE + 3600, "after its last build boundary")):
        code, out, err = run(capsys, "show", path, "--at", str(at), "--no-progress")
        assert code == 1 and out == "" and err.count("\n") == 1 and words in err, err


def test_a_trace_without_times_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "show", trace(tmp_path, clock=False), "--at", str(BASE + 1), "--no-progress")
    assert code == 1 and out == "" and "carry no time" in err and err.count("\n") == 1


@pytest.mark.parametrize("bad", ["yesterday", "nan", "1e400", "-5", "2026-13-40T00:00:00"])
def test_a_time_that_is_not_one_is_a_usage_error(tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["show", trace(tmp_path), "--at", bad])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "--at" in err


@pytest.mark.parametrize("zone", ["UTC", "Etc/GMT+12", "Etc/GMT-14", "Asia/Kolkata"])
@pytest.mark.parametrize(
    "bad",
    [
        "0001-01-01T00:00:00Z",
        "0001-01-01T00:00:00",
        "9999-12-31T23:59:59.999999",
        "9999-12-31T23:59:59+14:00",
        "1969-12-31T23:59:59Z",
        "2300-01-01T00:00:00",
    ],
)
def test_an_iso_time_outside_what_a_journal_holds_is_a_usage_error(
    tmp_path: Path, zone: str, bad: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The calendar's ends move out of it on the way to UTC or the local zone (year 1 at UTC-12
    is year 0, year 9999 at UTC+14 is 10000): one line, as for a Unix time out of range."""
    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        with pytest.raises(SystemExit) as info:
            main(["show", trace(tmp_path), "--at", bad])
    finally:
        monkeypatch.undo()
        time.tzset()
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "--at" in err and "1970 to 2242" in err, err
