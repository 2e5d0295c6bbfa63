"""kvreplay end to end, in process: check, compare, minimize, show, stats, plot, snapshots, goldens.

Traces are made here from the scenarios of kvcached PR #598 and the synthetic workload, with decisions
derived under a policy (``simulate.derive``), written with ``JournalWriter`` in small batches so
that multi-frame reading is exercised. Golden traces are picked up from ``traces/``: any
``NAME.kvj`` with a ``NAME.check.json`` beside it is replayed and compared, so adding one needs
no change here.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvcached.ledger.events import (
    DECISIONS,
    BlockAlloc,
    BlockFree,
    BuildBoundary,
    Event,
    Header,
    JobBuilt,
    JobKind,
    JobReported,
    PageMapped,
    PageUnmapped,
    Policy,
    PoolGeometry,
    RequestAdded,
)
from kvcached.ledger.journal import JournalWriter, read_journal
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.segments import read_snapshot, segment_header, segment_path
from kvcached.ledger.simulate import derive
from kvcached.ledger.state import LedgerSnapshot
from kvcached.service.ledger_service import BackgroundService, ServiceConfig
from kvcached.testing import synth
from kvcached.testing.seed_cases import SCENARIOS, preempt_shrink
from kvreplay import tracefile
from kvreplay.cli import main

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "traces"


def write(path: Path, header: Header, events: Sequence[Event], batch: int = 4) -> str:
    with JournalWriter.create(path, header) as w:
        for i in range(0, len(events), batch):
            w.append(list(events[i : i + batch]))
    return str(path)


def recorded(header: Header, inputs: Sequence[Event], policy: str) -> tuple[Header, list[Event]]:
    """A "recorded" trace: the inputs with the eager allocator's decisions under ``policy``."""
    h = msgspec.structs.replace(header, policy=Policy(policy))
    return h, list(derive(Ledger(h), inputs))


def scenario_trace(tmp_path: Path, name: str, policy: str) -> str:
    sc = SCENARIOS[name]()
    h, ev = recorded(sc.header, sc.events, policy)
    return write(tmp_path / f"{name}.{policy}.kvj", h, ev)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def synth_legacy(tmp_path_factory: pytest.TempPathFactory) -> str:
    # 5,000 inputs of the randomized workload reach its first freed-block copy (near input 2,200).
    h, ev = recorded(synth.header(), list(itertools.islice(synth.workload(7), 5000)), "legacy")
    return write(tmp_path_factory.mktemp("synth") / "synth.legacy.kvj", h, ev, batch=512)


# --- check ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_check_finds_the_copy_under_legacy_and_none_under_ledger(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    bad = scenario_trace(tmp_path, name, "legacy")
    code, out, err = run(capsys, "check", bad)
    assert (code, err) == (1, "")
    assert f"{bad}: I1 " in out and "summary:" in out
    first = out.splitlines()[1]
    assert "event " in first and "build " in first and "page " in first and "job " in first
    good = scenario_trace(tmp_path, name, "ledger")
    code, out, err = run(capsys, "check", good)
    assert (code, err) == (0, "")
    assert "clean: no invariant violated" in out


def test_check_witness_chain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = scenario_trace(tmp_path, "finish-in-write-step", "legacy")
    _, out, _ = run(capsys, "check", path)
    steps = [line.split()[0] for line in out.splitlines()[2:6]]
    assert steps == ["pin", "free", "unmap", "late"]
    assert "1 violation: I1 unmap-under-job x1" in out
    assert "peak 1 pinned page," in out and "1 unmap\n" in out


def test_check_json_is_deterministic_and_has_no_paths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = scenario_trace(tmp_path, "sliding-window", "legacy")
    code, first, _ = run(capsys, "check", path, "--json")
    code2, second, _ = run(capsys, "check", path, "--json")
    assert code == code2 == 1
    assert first == second
    assert str(tmp_path) not in first
    doc = json.loads(first)
    assert doc["trace"] == "sliding-window.legacy.kvj"
    assert doc["policy"] == "legacy" and doc["decisions"] == "recorded" and not doc["clean"]
    assert doc["violations_by_invariant"] == {"I1": len(doc["violations"])}
    assert doc["violations"][0]["chain"][-1]["step"] == "late copy"
    assert set(doc["summary"]) >= {"events", "builds", "jobs", "peak_pinned_pages", "unmaps"}
    assert "created_unix" not in first and "producer" not in first


def test_check_derive_on_an_inputs_only_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sc = SCENARIOS["finished-store-next-build"]()
    path = write(tmp_path / "inputs.kvj", msgspec.structs.replace(sc.header, policy=Policy.LEGACY), sc.events)
    code, out, _ = run(capsys, "check", path)
    assert code == 1 and "alloc-on-unmapped" in out and "--derive" in out
    code, out, _ = run(capsys, "check", path, "--derive")
    assert code == 1 and "copy-of-lost-block" in out and "alloc-on-unmapped" not in out
    code, out, _ = run(capsys, "check", path, "--derive", "--policy", "ledger")
    assert code == 0, out


def test_malformed_sequence_is_a_violation_with_file_and_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A report for a job never built: the ledger's I3; check names file and event and exits 1.
    h = Header(page_bytes=4096, pools=(PoolGeometry(1024, 16),), policy=Policy.LEDGER)
    path = write(tmp_path / "orphan.kvj", h, [BuildBoundary(0), JobReported(7, 1), BuildBoundary(1)])
    code, out, err = run(capsys, "check", path)
    assert (code, err) == (1, "")
    assert f"{path}: I3 report-unknown-job (event 1, build 1, job 7)" in out


# --- compare --------------------------------------------------------------------------------


def _page_builds(header: Header, inputs: Sequence[Event], policy: str) -> int:
    lg = Ledger(header, policy)
    return sum(lg.mapped_pages for ev in derive(lg, inputs) if type(ev) is BuildBoundary)


def test_compare_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sc = preempt_shrink()
    path = scenario_trace(tmp_path, "preempt-shrink", "legacy")
    code, out, err = run(capsys, "compare", path, "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    legacy, ledger = doc["policies"]
    assert doc["baseline"] == "legacy" and doc["decisions"] == "derived"
    assert legacy["violations_by_invariant"].get("I1", 0) > 0 and ledger["violations"] == 0
    # The memory cost of safety, recomputed here the slow way.
    want = _page_builds(sc.header, sc.events, "ledger") - _page_builds(sc.header, sc.events, "legacy")
    assert ledger["extra_page_builds"] == want > 0
    assert ledger["mapped_page_builds"] - legacy["mapped_page_builds"] == want
    assert doc["inputs"] == len(sc.events)
    code, text, _ = run(capsys, "compare", path)
    assert "memory cost of safety: ledger held" in text and "I1 unmap-under-job" in text
    code, text, _ = run(capsys, "compare", path, "--policy", "ledger", "--policy", "legacy", "--limit", "0")
    assert text.splitlines()[1].split() == ["ledger", "legacy"]


# --- minimize -------------------------------------------------------------------------------


def _codes(path: str) -> set[str]:
    from kvreplay.check import run_check

    return {v.code for v in run_check(path, progress=False).ledger.violations}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_minimize_scenarios(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str) -> None:
    path = scenario_trace(tmp_path, name, "legacy")
    before = _codes(path)
    out = str(tmp_path / "min.kvj")
    code, text, err = run(capsys, "minimize", path, "-o", out)
    assert (code, err) == (0, ""), err
    events = read_journal(out).events
    assert len(events) <= 8
    assert f"to {len(events)} events" in text
    # Same kind, nothing else: no report without its job, no free without its alloc (I3).
    after = _codes(out)
    assert after and after <= before


def test_minimize_the_randomized_workload(
    synth_legacy: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "min.kvj")
    code, text, err = run(capsys, "minimize", synth_legacy, "-o", out)
    assert (code, err) == (0, "")
    c = read_journal(out)
    assert len(c.events) <= 12, text
    assert _codes(out) == {"unmap-under-job"}
    assert c.header.policy is Policy.LEGACY and c.header.meta["minimized_from"] == "synth.legacy.kvj"
    assert "late copy" in text  # the witness is complete: the job's copy finishes after the unmap


def test_minimize_keeps_recorded_decisions_when_they_are_the_bug(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Under ledger the eager allocator never unmaps under a job; a buggy allocator did.
    h = Header(page_bytes=4096, pools=(PoolGeometry(1024, 16),), policy=Policy.LEDGER)
    ev: list[Event] = [
        RequestAdded(0, "a"),
        RequestAdded(1, "b"),
        PageMapped(0),
        PageMapped(1),
        BlockAlloc(0, (0, 1, 4)),
        JobBuilt(0, JobKind.STORE, 0, ((0, 1),), 1),
        BuildBoundary(0),
        BlockFree(0, (0, 1)),
        BuildBoundary(1),
        BuildBoundary(2),
        PageUnmapped(0),
        JobReported(0, 1),
        BlockFree(0, (4,)),
        BuildBoundary(3),
    ]
    path = write(tmp_path / "buggy.kvj", h, ev)
    out = str(tmp_path / "min.kvj")
    code, text, err = run(capsys, "minimize", path, "-o", out)
    assert (code, err) == (0, "")
    assert "recorded decisions kept" in text
    events = read_journal(out).events
    assert any(type(e) is PageUnmapped for e in events) and len(events) <= 7
    assert _codes(out) == {"unmap-under-job"}
    code, _, err = run(capsys, "minimize", path, "-o", out, "--decisions", "derive")
    assert code == 1 and err.count("\n") == 1 and path in err


def test_minimize_clean_trace_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = scenario_trace(tmp_path, "finish-in-write-step", "ledger")
    code, out, err = run(capsys, "minimize", path, "-o", str(tmp_path / "m.kvj"))
    assert code == 1 and out == "" and err.count("\n") == 1 and "no violation to minimize" in err
    # ... unless asked what legacy would have done with the same inputs.
    code, out, err = run(capsys, "minimize", path, "-o", str(tmp_path / "m.kvj"), "--policy", "legacy")
    assert code == 0 and "decisions re-derived under legacy" in out


def test_minimize_knows_every_code_the_ledger_reports() -> None:
    """``--only`` refuses a kind it does not know (``I9``, a misspelt code) before reading the
    trace, so its list of codes must be the ledger's: every ``violate("I?", "code"`` there."""
    from kvreplay.minimize import CODES

    src = "".join(p.read_text() for p in sorted((ROOT / "kvcached" / "ledger").glob("*.py")))
    found = re.findall(r'\.violate\(\s*"(I\d)",\s*"([a-z0-9-]+)"', src)
    assert len(found) == src.count(".violate("), "a violation code that is not a literal: CODES cannot list it"
    assert {code: inv for inv, code in found} == CODES


# --- show, stats, plot ----------------------------------------------------------------------


def test_show_page_job_request(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = scenario_trace(tmp_path, "finish-in-write-step", "legacy")
    code, out, _ = run(capsys, "show", path, "--page", "0")
    assert code == 0
    assert "PageUnmapped(page=0)" in out and "!! I1 unmap-under-job" in out and "JobBuilt(job=0" in out
    assert out.splitlines()[-1].startswith("at the end: page 0: unmapped")
    code, out, _ = run(capsys, "show", path, "--job", "0")
    lines = out.splitlines()
    assert "JobBuilt(job=0" in lines[1] and "reported 1/1: complete" in lines[-1]
    assert any("PageUnmapped(page=0)" in line and "(unmapped)" in line for line in lines)
    code, by_name, _ = run(capsys, "show", path, "--request", "req-one-token")
    code, by_id, _ = run(capsys, "show", path, "--request", "0")
    assert by_name == by_id and "RequestFinished(req=0)" in by_name
    code, out, err = run(capsys, "show", path, "--page", "999")
    assert code == 1 and "no page 999" in err
    code, out, _ = run(capsys, "show", path, "--page", "0", "--limit", "2")
    assert "more lines" in out


@pytest.mark.parametrize(("what", "value"), [("--job", "999"), ("--request", "nope"), ("--request", "999")])
@pytest.mark.parametrize("json_out", [False, True])
def test_show_of_a_job_or_request_the_trace_lacks_is_a_failed_run(
    capsys: pytest.CaptureFixture[str], what: str, value: str, json_out: bool
) -> None:
    """It printed an empty timeline and exited 0, as if the job or request were there and idle."""
    golden = str(TRACES / "finish-in-write-step.legacy.kvj")
    code, out, err = run(capsys, "show", golden, what, value, "--no-progress", *(["--json"] if json_out else []))
    assert (code, out) == (1, "") and err.count("\n") == 1, (code, out, err)
    assert err.startswith(f"kvreplay: {golden}: the trace has no {what[2:]} {value}: none of its "), err
    code, out, _ = run(capsys, "show", golden, what, "0", "--no-progress")  # one it has
    assert code == 0 and out


def test_stats_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = scenario_trace(tmp_path, "preempt-shrink", "ledger")
    code, out, _ = run(capsys, "stats", path, "--json", "--rows", "0")
    doc = json.loads(out)
    assert code == 0 and doc["builds"] == len(doc["rows"]) == 24
    for r in doc["rows"]:
        assert r["mapped_max"] == r["in_use_max"] + r["empty_max"]
        assert r["free_max"] == doc["num_pages"] - r["mapped_max"]
    assert doc["totals"]["empty_page_builds"] > 0  # pins kept empty pages mapped
    assert doc["end"]["events_after_last_build"] > 0  # the scenario ends with a reset's frees
    code, out, _ = run(capsys, "stats", path, "--rows", "4")
    assert code == 0 and len(out.splitlines()) == 1 + 1 + 4 + 1 + 1
    legacy = scenario_trace(tmp_path, "preempt-shrink", "legacy")
    _, out, _ = run(capsys, "stats", legacy, "--json")
    assert json.loads(out)["totals"]["empty_page_builds"] == 0  # legacy gives empty pages back at once


def test_stats_reports_what_follows_the_last_build(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # A prefix-cache reset frees blocks after the last build; its unmaps are no build's sample.
    header = Header(page_bytes=4096, pools=(PoolGeometry(block_bytes=1024, num_blocks=8),), policy=Policy.LEGACY)
    inputs: list[Event] = [BuildBoundary(0), BlockAlloc(0, (0, 4)), BuildBoundary(1), BlockFree(0, (0, 4))]
    h, ev = recorded(header, inputs, "legacy")
    assert [type(e) for e in ev[-2:]] == [PageUnmapped, PageUnmapped]
    path = write(tmp_path / "reset.kvj", h, ev)
    code, out, _ = run(capsys, "stats", path, "--json", "--rows", "0")
    doc = json.loads(out)
    assert code == 0 and doc["rows"][-1]["mapped_max"] == 2
    assert doc["end"] == {
        "events_after_last_build": 3,
        "mapped": 0,
        "in_use": 0,
        "empty": 0,
        "pinned": 2,  # the freed pages' grace pins, which legacy does not wait for
        "releasable": 0,
        "free": 2,
    }
    code, out, _ = run(capsys, "stats", path)
    assert "after the last build (3 more events): mapped 0, in use 0, empty 0, pinned 2, free 2" in out
    _, out, _ = run(capsys, "stats", write(tmp_path / "cut.kvj", h, ev[: ev.index(BuildBoundary(1)) + 1]), "--json")
    assert json.loads(out)["end"] is None


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = scenario_trace(tmp_path, "sliding-window", "legacy")
    png = tmp_path / "m.png"
    code, out, err = run(capsys, "plot", path, "-o", str(png))
    assert (code, err) == (0, "") and out.startswith(f"wrote {png}")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = run(capsys, "plot", path, "-o", str(tmp_path / "no" / "such" / "dir.png"))
    assert code == 1 and err.count("\n") == 1


# --- snapshots ------------------------------------------------------------------------------


def test_from_snapshot_gives_the_same_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = scenario_trace(tmp_path, "preempt-shrink", "legacy")
    _, full, _ = run(capsys, "check", path, "--json")
    want = json.loads(full)
    assert want.pop("from_snapshot") is None
    n = want["summary"]["events"]
    snap = str(tmp_path / "s.snap")
    for at in range(0, n + 1, 7):
        code, out, _ = run(capsys, "snapshot", path, "--at", str(at), "-o", snap)
        assert code == 0 and f"first {at} events" in out
        code, out, _ = run(capsys, "check", path, "--json", "--from-snapshot", snap)
        got = json.loads(out)
        assert got.pop("from_snapshot") == at
        assert got == want
        assert code == 1
    code, out, _ = run(capsys, "stats", path, "--json", "--from-snapshot", snap)
    assert code == 0


def test_snapshot_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = scenario_trace(tmp_path, "preempt-shrink", "legacy")
    other = scenario_trace(tmp_path, "finish-in-write-step", "legacy")
    snap = str(tmp_path / "s.snap")
    assert run(capsys, "snapshot", path, "--at", "10", "-o", snap)[0] == 0
    cases = [
        (["check", other, "--from-snapshot", snap], "another geometry"),
        (["check", path, "--from-snapshot", other], "not a ledger snapshot"),
        (["check", path, "--from-snapshot", str(tmp_path / "missing")], "cannot read the snapshot"),
        (["check", path, "--from-snapshot", snap, "--policy", "ledger"], "not ledger"),
        (["snapshot", path, "--at", "100000", "-o", snap], "past the end"),
    ]
    for argv, what in cases:
        code, _, err = run(capsys, *argv)
        assert code == 1 and err.count("\n") == 1 and what in err, (argv, err)
    # Options that do not go together are a usage error: exit 2, one line.
    with pytest.raises(SystemExit) as usage:
        main(["check", path, "--from-snapshot", snap, "--derive"])
    assert usage.value.code == 2 and "--derive" in capsys.readouterr().err
    # A snapshot of the right type but the wrong shape is refused before it can fail mid-replay.
    s = msgspec.msgpack.decode(Path(snap).read_bytes(), type=LedgerSnapshot)
    Path(snap).write_bytes(msgspec.msgpack.encode(msgspec.structs.replace(s, page_alloc=[0])))
    code, _, err = run(capsys, "check", path, "--from-snapshot", snap)
    assert code == 1 and "not a consistent ledger snapshot: its page tables" in err


# --- progress, help, demo -------------------------------------------------------------------


def test_progress_bar_only_on_a_terminal(
    synth_legacy: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, plain, err = run(capsys, "check", synth_legacy, "--json")
    assert err == ""
    monkeypatch.setattr(tracefile, "PROGRESS_MIN_BYTES", 0)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True, raising=False)
    code2, with_bar, _ = run(capsys, "check", synth_legacy, "--json")
    assert (code2, with_bar) == (code, plain)


@pytest.mark.parametrize("cmd", ["check", "compare", "minimize", "show", "stats", "plot", "snapshot", "demo"])
def test_help(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([cmd, "--help"])
    assert exc.value.code == 0
    assert "usage: kvreplay" in capsys.readouterr().out


def test_demo_still_works(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo", "finish-in-write-step")
    assert code == 0 and "freed-block copy found under legacy in 1 of 1" in out


def test_example_traces(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo", "--save", str(tmp_path / "ex"), "finish-in-write-step")
    assert code == 0 and len(out.splitlines()) == 2
    assert run(capsys, "check", str(tmp_path / "ex" / "finish-in-write-step.legacy.kvj"))[0] == 1
    assert run(capsys, "check", str(tmp_path / "ex" / "finish-in-write-step.ledger.kvj"))[0] == 0
    path = str(tmp_path / "s.kvj")
    code, out, _ = run(capsys, "synth", "-o", path, "--events", "3000", "--inputs-only")
    assert code == 0 and "3,000 events" in out
    assert not any(type(e) in DECISIONS for e in read_journal(path).events)
    assert run(capsys, "check", path, "--derive", "--policy", "ledger")[0] == 0


# --- golden traces --------------------------------------------------------------------------


def _goldens() -> list[Path]:
    return sorted(p for p in TRACES.glob("*.kvj") if p.with_suffix(".check.json").exists())


@pytest.mark.parametrize("trace", _goldens() or [None], ids=lambda p: p.name if p else "none-yet")
def test_golden_trace(trace: Path | None, capsys: pytest.CaptureFixture[str]) -> None:
    """Replays a golden trace and compares with its expected report.

    Regenerate one (with a reason in the commit message):
    ``kvreplay check traces/NAME.kvj --json > traces/NAME.check.json``.
    """
    if trace is None:
        pytest.skip("no golden traces in traces/ yet (NAME.kvj + NAME.check.json)")
    expected = json.loads(trace.with_suffix(".check.json").read_text())
    code, out, err = run(capsys, "check", str(trace), "--json")
    assert err == ""
    assert json.loads(out) == expected
    assert code == (0 if expected["clean"] else 1)


def test_golden_report_is_independent_of_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = scenario_trace(tmp_path, "finished-store-next-build", "legacy")
    _, here, _ = run(capsys, "check", path, "--json")
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        _, there, _ = run(capsys, "check", os.path.basename(path), "--json")
    finally:
        os.chdir(cwd)
    assert here == there


def test_decisions_and_inputs_split_is_what_minimize_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = scenario_trace(tmp_path, "finished-store-next-build", "legacy")
    out = str(tmp_path / "m.kvj")
    _, text, _ = run(capsys, "minimize", path, "-o", out)
    events = read_journal(out).events
    n_dec = sum(1 for e in events if type(e) in DECISIONS)
    assert f"({len(events) - n_dec} inputs, {n_dec} decisions)" in text
    assert all(type(e) is not BlockFree or e.blocks for e in events)
    assert struct.unpack("<H", Path(out).read_bytes()[8:10]) == (1,)


# --- rotated journals: the service's segments are one trace -----------------------------------


def _service_journal(path: Path, header: Header, events: Sequence[Event], **cfg: Any) -> list[str]:
    """Journals ``events`` through the real ledger service, rotating small; returns its files."""
    config = ServiceConfig(journal=str(path), batch_events=97, rotate_bytes=16 << 10, **cfg)
    with BackgroundService.start(header, config) as bg:
        for i, ev in enumerate(events):
            bg.producer.put(ev)
            if i % 400 == 0:
                time.sleep(0.001)  # let the writer interleave, as scheduler steps would
    assert bg.producer.dropped == 0
    return sorted(n for n in os.listdir(path.parent) if n.startswith(path.name) and not n.endswith(".snap"))


@pytest.fixture(scope="module")
def rotated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, list[Event]]:
    """synth-legacy through the service, in segments of 16 KiB, and the same events in one file."""
    h, ev = recorded(synth.header(), list(itertools.islice(synth.workload(7), 5000)), "legacy")
    folder = tmp_path_factory.mktemp("rotated")
    files = _service_journal(folder / "run.kvj", h, ev, replica=True, snapshot_every=2000)
    assert len(files) >= 3, files
    return folder / "run.kvj", write(folder / "whole.kvj", h, ev, batch=97), ev


def _without(doc: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in keys}


def test_check_reads_every_event_of_every_segment_of_a_rotated_journal(
    rotated: tuple[Path, str, list[Event]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, whole, events = rotated
    files = sorted(n for n in os.listdir(path.parent) if n.startswith("run.kvj") and not n.endswith(".snap"))
    _, want, _ = run(capsys, "check", whole, "--json")
    code, out, err = run(capsys, "check", str(path), "--json")
    got = json.loads(out)
    assert (code, err) == (1, "")
    assert got["summary"]["events"] == len(events)
    # Everything one file of the same events gives, violations included (the first one lies past
    # the first segment: a reader of P alone would call the run clean).
    assert _without(got, "trace", "segments") == _without(json.loads(want), "trace")
    segs = got["segments"]
    assert sorted(s["file"] for s in segs) == files and [s["segment"] for s in segs] == list(range(len(files)))
    assert sum(s["events"] for s in segs) == len(events) and all(s["events"] for s in segs)
    assert [s["first_event"] for s in segs] == list(itertools.accumulate([0] + [s["events"] for s in segs[:-1]]))
    assert got["violations"][0]["index"] >= segs[1]["first_event"]
    code, text, _ = run(capsys, "check", str(path))
    assert code == 1 and text.startswith(f"{path}: {len(events):,} events, ")
    n = len(files)
    assert text.splitlines()[1] == f"{path}: a journal of {n} segments ({segtext(path, n)}); read all"


def segtext(path: Path, n: int) -> str:
    names = [str(path)] + [f"{path}.{k}" for k in range(1, n)]
    return ", ".join(names) if n <= 4 else f"{names[0]}, {names[1]} ... {names[-2]}, {names[-1]}"


def test_check_of_one_segment_reads_the_journal_it_belongs_to_and_says_so(
    rotated: tuple[Path, str, list[Event]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _, events = rotated
    _, whole, _ = run(capsys, "check", str(path), "--json")
    one = f"{path}.2"
    code, out, err = run(capsys, "check", one, "--json")
    assert code == 1 and err == ""
    assert _without(json.loads(out), "trace") == _without(json.loads(whole), "trace")
    _, text, _ = run(capsys, "check", one)
    n = len(json.loads(whole)["segments"])
    assert text.splitlines()[1] == (
        f"{one}: segment 2 of the rotated journal {path}, which has {n} segments ({segtext(path, n)}); read all"
    )
    # The other subcommands say it on stderr, and read the same events.
    code, out, err = run(capsys, "stats", one, "--json")
    assert code == 0 and err.startswith(f"kvreplay: note: {one}: segment 2 of the rotated journal {path}")
    code, out, err = run(capsys, "compare", str(path), "--json")
    assert code == 0 and json.loads(out)["events"] == len(events)


def test_every_replaying_subcommand_reads_past_the_first_segment(
    rotated: tuple[Path, str, list[Event]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, whole, events = rotated
    for argv in (["stats", "--json"], ["compare", "--json"], ["show", "--page", "3", "--limit", "0"]):
        _, want, _ = run(capsys, argv[0], whole, *argv[1:])
        code, got, _ = run(capsys, argv[0], str(path), *argv[1:])
        assert code == 0 and got.replace(str(path), "T").replace('"run.kvj"', '"T"') == want.replace(
            whole, "T"
        ).replace('"whole.kvj"', '"T"'), argv
    at = len(events) - 10  # in the last segment
    code, out, _ = run(capsys, "snapshot", str(path), "--at", str(at), "-o", str(tmp_path / "late.snap"))
    assert code == 0 and f"first {at:,} events" in out
    code, out, _ = run(capsys, "minimize", str(path), "-o", str(tmp_path / "w.kvj"), "--max-seconds", "20")
    assert code == 0 and "unmap-under-job" in out
    code, out, _ = run(capsys, "plot", str(path), "-o", str(tmp_path / "p.png"))
    assert code == 0 and "1 violation\n" in out


def test_the_services_snapshot_starts_kvreplay_and_earlier_segments_stay_unread(
    rotated: tuple[Path, str, list[Event]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, _, events = rotated
    snap = f"{path}.snap"
    index = read_snapshot(snap).index
    assert 0 < index < len(events)
    _, full, _ = run(capsys, "check", str(path), "--json")
    code, out, _ = run(capsys, "check", str(path), "--json", "--from-snapshot", snap)
    got = json.loads(out)
    assert code == 1 and got.pop("from_snapshot") == index
    want = json.loads(full)
    want.pop("from_snapshot")
    unread = [s for s in got.pop("segments") if s["events"] is None]
    want.pop("segments")
    assert got == want
    assert unread and all(s["first_event"] < index for s in unread)
    _, text, _ = run(capsys, "check", str(path), "--from-snapshot", snap)
    assert "; unread, as they hold only events before the snapshot: " in text.splitlines()[1]


def _segments_of(tmp_path: Path, sizes: Sequence[int]) -> tuple[str, list[Event]]:
    """A rotated journal written segment by segment, as the service names and heads them."""
    h, ev = recorded(synth.header(), list(itertools.islice(synth.workload(3), sum(sizes))), "ledger")
    base = str(tmp_path / "j.kvj")
    at = 0
    for k, n in enumerate(sizes):
        write(Path(segment_path(base, k)), segment_header(h, k, at), ev[at : at + n], batch=50)
        at += n
    return base, ev[:at]


def test_a_rotated_journal_with_a_missing_or_torn_segment_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, _ = _segments_of(tmp_path, [300, 300, 300, 300])
    code, out, err = run(capsys, "check", base, "--json")
    assert code == 0 and json.loads(out)["summary"]["events"] == 1200
    data = Path(f"{base}.1").read_bytes()
    Path(f"{base}.1").write_bytes(data[:-5])  # a torn frame, but not in the last segment
    code, out, err = run(capsys, "check", base)
    assert code == 1 and out == "" and err.count("\n") == 1
    assert f"{base}.2: at byte 16: segment 2 follows {base}.1, which ends in a torn frame" in err
    Path(f"{base}.1").write_bytes(data)
    os.unlink(f"{base}.2")
    code, out, err = run(capsys, "check", f"{base}.3")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert f"segment 2 of the rotated journal {base} is missing" in err


def test_a_journal_that_starts_mid_run_needs_its_snapshot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    h, ev = recorded(synth.header(), list(itertools.islice(synth.workload(3), 3000)), "ledger")
    live = Ledger(h)
    live.apply_all(ev[:1000])
    path = tmp_path / "late.kvj"
    config = ServiceConfig(journal=str(path), rotate_bytes=8 << 10, snapshot_every=0)
    with BackgroundService.start(h, config, start=live.snapshot()) as bg:
        for e in ev[1000:]:
            bg.producer.put(e)
    whole = write(tmp_path / "whole.kvj", h, ev)
    _, want, _ = run(capsys, "check", whole, "--json")
    # Its own P.snap is where it starts (as for a flight-recorder dump): used without being named.
    for extra in ([], ["--from-snapshot", f"{path}.snap"]):
        code, out, err = run(capsys, "check", str(path), "--json", *extra)
        got = json.loads(out)
        assert code == 0 and got["from_snapshot"] == 1000 and got["summary"] == json.loads(want)["summary"]
    # Without it, the journal cannot be replayed, and kvreplay says what would do.
    os.rename(f"{path}.snap", tmp_path / "elsewhere.snap")
    code, out, err = run(capsys, "check", str(path))
    assert code == 1 and out == ""
    assert err == (
        f"kvreplay: {path}: the journal starts at event 1,000 (its service started from a snapshot); "
        "replay it with --from-snapshot SNAP (one taken at or after that event)\n"
    )
    code, _, err = run(capsys, "compare", str(path))
    assert code == 1 and "starts at event 1000" in err and err.count("\n") == 1
