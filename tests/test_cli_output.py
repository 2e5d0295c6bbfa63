"""What kvreplay's and kvsim's lines say (one behaviour across the tools): a block list spelled one
way in every subcommand, sizes in their unit, counts that agree with their nouns, ``--json``
where ``demo --save`` prints data, and a usage error that names the sub-command's ``--help``.

Each test fails on the code before it: minimize printed a job's blocks ``((1,),)`` where show
printed ``((1,))``; compare's cost of a 16 KiB page was ``+0.0 MiB``; ``1 events``, ``+1 pages``;
``demo --save --json`` printed text; ``demo bogus`` offered ``[]`` among the scenarios. The last
holds what ``show`` already did: a stamped build boundary in a timeline says its wall time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from kvcached.ledger.events import BuildBoundary, JobBuilt, JobKind, Policy, describe
from kvcached.ledger.journal import JournalWriter
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.simulate import derive
from kvcached.testing.seed_cases import SCENARIOS
from kvreplay.cli import main
from kvreplay.timeline_text import describe_event, wall

TRACES = Path(__file__).resolve().parent.parent / "traces"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("blocks", [((1,),), ((1, 2, 3),), ((0, 1), (7,)), ()])
def test_a_job_block_list_reads_as_describe_writes_it(blocks: tuple[tuple[int, ...], ...]) -> None:
    ev = JobBuilt(job=3, kind=JobKind.STORE, req=0, blocks=blocks, workers=1)
    assert describe_event(ev) == describe(ev)


def test_a_long_job_block_list_is_cut_per_pool() -> None:
    ev = JobBuilt(job=3, kind=JobKind.LOAD, req=0, blocks=(tuple(range(20)),), workers=2)
    assert "blocks=((0, 1, 2, 3, 4, 5, ... 20 ids),)" in describe_event(ev)


def test_minimize_and_show_spell_a_job_alike(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    small = str(tmp_path / "m.kvj")
    code, out, _ = run(capsys, "minimize", str(TRACES / "finish-in-write-step.legacy.kvj"), "-o", small)
    assert code == 0
    built = [line[line.index("JobBuilt(") :] for line in out.splitlines() if "JobBuilt(" in line]
    code, shown, _ = run(capsys, "show", small, "--job", "0", "--no-progress")
    assert code == 0 and built and built[0] in shown, (built, shown)


def test_compare_gives_the_cost_in_its_unit_and_agrees_in_number(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "compare", str(TRACES / "finish-in-write-step.legacy.kvj"))
    assert code == 0
    cost = next(line for line in out.splitlines() if line.startswith("memory cost of safety"))
    # 16 KiB pages, 4 page-builds over 5 builds: 0.8 pages, 12.8 KiB a build.
    assert "+0.80 pages = +12.8 KiB per build" in cost and "MiB" not in cost, cost
    code, out, _ = run(capsys, "compare", str(TRACES / "finished-store-next-build.legacy.kvj"))
    assert code == 0 and "at most +1 page in one build" in out and "+1 pages" not in out, out


def test_a_count_of_one_is_singular(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(TRACES / "finish-in-write-step.legacy.kvj")
    code, out, _ = run(capsys, "snapshot", trace, "--at", "1", "-o", str(tmp_path / "one.snap"))
    assert code == 0 and "after the first 1 event (" in out, out
    code, out, _ = run(capsys, "synth", "-o", str(tmp_path / "s.kvj"), "--events", "1")
    assert code == 0 and "(1 input of the synthetic workload" in out, out
    code, out, _ = run(capsys, "minimize", trace, "-o", str(tmp_path / "m.kvj"))
    counts = re.search(r"to (\d+ events?) \((\d+ inputs?), (\d+ decisions?)\)", out)
    assert counts, out
    for phrase in counts.groups():
        n, noun = phrase.split()
        assert noun.endswith("s") == (n != "1"), phrase


def test_demo_save_json_lists_what_it_wrote(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo", "--save", str(tmp_path), "--json", "sliding-window")
    rows = json.loads(out)
    assert code == 0 and [(r["scenario"], r["policy"]) for r in rows] == [
        ("sliding-window", "legacy"),
        ("sliding-window", "ledger"),
    ]
    assert all(Path(r["file"]).is_file() and r["events"] > 0 for r in rows)
    code, out, _ = run(capsys, "demo", "--save", str(tmp_path), "sliding-window")
    assert out.splitlines()[0].startswith(f"wrote {rows[0]['file']}: {rows[0]['events']} events, ")


def test_demo_names_only_the_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "bogus"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "'sliding-window'" in err and "[]" not in err, err
    assert run(capsys, "demo", "finish-in-write-step")[0] == 0  # no scenario named is still all of them


def test_a_usage_error_found_after_parsing_names_the_sub_commands_help(capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(TRACES / "finish-in-write-step.legacy.kvj")
    with pytest.raises(SystemExit) as info:
        main(["check", trace, "--from-snapshot", "x.snap", "--derive"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "(see kvreplay check --help)" in err, err
    code = "import sys; from kvsim.cli import main; sys.exit(main(['run', '--seeds', '1', '--variants', 'x']))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.endswith("(see kvsim run --help)\n"), r.stderr


def test_show_gives_a_stamped_boundary_its_wall_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A page's timeline on a served engine's journal says when each build it shows closed."""
    base = 1796306400.0
    sc = SCENARIOS["preempt-shrink"]()
    header = msgspec.structs.replace(sc.header, policy=Policy.LEDGER, clock_base_unix=base)
    events = [
        BuildBoundary(e.build, (e.build + 1) * 1_000_000) if type(e) is BuildBoundary else e
        for e in derive(Ledger(header), sc.events)
    ]
    path = tmp_path / "timed.kvj"
    with JournalWriter.create(path, header) as w:
        w.append(events)
    code, out, _ = run(capsys, "show", str(path), "--page", "0", "--no-progress")
    boundary = next(line for line in out.splitlines() if "(BuildBoundary(build=23)" in line)
    assert code == 0 and f"(BuildBoundary(build=23) at {wall(base + 24)})" in boundary, out
