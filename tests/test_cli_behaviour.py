"""kvreplay, kvctl and kvsim fail alike (one behaviour, ``tools/kvcli``).

0 done, 1 a failed run, 2 a usage error in one line naming ``--help``; ``--version`` on each; a
plain user error (a count of -1, nan or 1e400, a picture format matplotlib cannot write, no
matplotlib, no vLLM) is never "internal error (a bug)". Each tool runs as its own process here,
as a user or a script runs it, so that what reaches stderr and the exit status are what they see.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcached.version import KVCACHED_VERSION
from kvcached.vllm.patches import VLLM

GOLDEN = sorted((Path(__file__).parent.parent / "traces").glob("*.kvj"))[0]


def tool(name: str, *argv: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"import sys; {prelude}from {name}.cli import main; sys.exit(main({list(argv)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", ["kvreplay", "kvctl", "kvsim"])
def test_version_is_the_packages(name: str) -> None:
    r = tool(name, "--version")
    assert (r.returncode, r.stdout.strip()) == (0, f"{name} (kvcached {KVCACHED_VERSION})"), r.stderr


@pytest.mark.parametrize(
    "argv, words",
    [
        (["kvreplay", "synth", "-o", "x.kvj", "--events", "-1"], "from 1 to 1,000,000,000"),
        (["kvreplay", "check", str(GOLDEN), "--limit", "nan"], "not a whole number"),
        (["kvreplay", "show", str(GOLDEN), "--page", "1e400"], "not a whole number"),
        (["kvreplay", "minimize", str(GOLDEN), "-o", "m.kvj", "--max-seconds", "inf"], "above 0"),
        (["kvreplay", "stats", str(GOLDEN), "--rows", "-3"], "from 0"),
        (["kvreplay", "plot", str(GOLDEN), "-o", "x.txt"], ".png, .pdf, .svg"),
        (["kvreplay", "check"], "required"),
        (["kvsim", "run", "--seeds", "-5"], "1-500"),
        (["kvsim", "run", "--seeds", "1", "--variants", "bogus"], "choose from"),
        (["kvctl", "--timeout", "nan", "status"], "above 0"),
        # A name no check has is refused before the seed runs (for minutes) or the trace is read:
        # the trace here does not even exist.
        (["kvsim", "shrink", "1", "-o", "shrunk", "--check", "no-such-check"], "attended-bytes, load-bytes"),
        (["kvreplay", "minimize", "no-such.kvj", "-o", "m.kvj", "--only", "I9"], "I1, I2, I3, I4, I5"),
        (["kvreplay", "minimize", "no-such.kvj", "-o", "m.kvj", "--only", "unmap-under-jobs"], "unmap-under-job,"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_2(argv: list[str], words: str) -> None:
    r = tool(argv[0], *argv[1:])
    assert r.returncode == 2 and r.stdout == "", r
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{argv[0]}: ") and words in lines[0], lines
    assert "--help" in lines[0] and "internal error" not in lines[0]


def test_unusable_input_is_exit_1_and_a_violation_too(tmp_path: Path) -> None:
    bad = tmp_path / "bad.kvj"
    bad.write_bytes(b"not a journal at all")
    r = tool("kvreplay", "check", str(bad))
    assert r.returncode == 1 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r
    legacy = next(p for p in sorted(GOLDEN.parent.glob("*.legacy.kvj")))
    r = tool("kvreplay", "check", "--no-progress", str(legacy))
    assert r.returncode == 1 and "violation" in r.stdout and r.stderr == "", r


def _stated_code(text: str, about: str) -> int:
    """The exit code a help text gives for ``about``: the last bare 0, 1 or 2 followed by a word
    ("exit 0 clean", "1 when ...") before it."""
    flat = " ".join(text.split())
    codes = re.findall(r"(?<![\w.])([012]) (?=[a-z])", flat[: flat.index(about)])
    assert codes, (about, flat)
    return int(codes[-1])


def test_the_help_states_the_exit_code_an_unreadable_trace_gets(tmp_path: Path) -> None:
    """``check --help`` said 2 for a trace that cannot be read; it is a failed run, 1, as the
    convention (and docs/kvreplay.md) says. The same for ``minimize``'s help."""
    bad = tmp_path / "bad.kvj"
    bad.write_bytes(b"not a journal at all")
    for sub, argv in (("check", [str(bad)]), ("minimize", [str(bad), "-o", str(tmp_path / "m.kvj")])):
        real = tool("kvreplay", sub, *argv)
        assert real.returncode == 1 and len(real.stderr.splitlines()) == 1, real
        assert _stated_code(tool("kvreplay", sub, "--help").stdout, "cannot be read") == real.returncode, sub
    listing = tool("kvreplay", "--help").stdout  # check's line in the list of subcommands
    assert _stated_code(listing[listing.index("    check ") :], "unreadable") == 1, listing


def test_plot_without_matplotlib_says_which_extra(tmp_path: Path) -> None:
    hide = "sys.modules['matplotlib'] = None; "
    r = tool("kvreplay", "plot", str(GOLDEN), "-o", str(tmp_path / "p.png"), prelude=hide)
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr.splitlines() == [
        "kvreplay: kvreplay plot needs matplotlib, which this environment lacks: "
        "pip install '.[replay]' from the kvcached checkout"
    ]
    assert not (tmp_path / "p.png").exists()


def test_kvsim_without_vllm_is_one_line_exit_1() -> None:
    r = tool("kvsim", "run", "--seeds", "1", prelude="sys.modules['vllm'] = None; ")
    assert r.returncode == 1 and r.stdout == "", r
    assert len(r.stderr.splitlines()) == 1 and f"install vLLM {VLLM.newest}" in r.stderr


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(actions[0].choices)


def test_every_subcommand_that_prints_data_has_json() -> None:
    from kvctl.parse import NOT_HERE
    from kvctl.parse import parser as kvctl_parser
    from kvreplay.cli import build_parser as kvreplay_parser
    from kvsim.cli import build_parser as kvsim_parser

    for tool, parser, exempt in (
        ("kvreplay", kvreplay_parser(), set()),
        ("kvsim", kvsim_parser(), set()),
        ("kvctl", kvctl_parser(), set(NOT_HERE)),  # upstream's commands that only say they are not here
    ):
        subs = _subcommands(parser)
        missing = [n for n, p in subs.items() if n not in exempt and "--json" not in p._option_string_actions]
        assert subs and missing == [], (tool, missing)


def test_demo_json_is_one_object_per_scenario_and_policy() -> None:
    r = tool("kvreplay", "demo", "--json", "finish-in-write-step")
    rows = json.loads(r.stdout)
    assert r.returncode == 0 and [(x["scenario"], x["policy"]) for x in rows] == [
        ("finish-in-write-step", "legacy"),
        ("finish-in-write-step", "ledger"),
    ]
    assert rows[0]["violations"] and rows[1]["violations"] == []


def test_a_trace_too_large_for_the_memory_limit_is_one_line_not_a_bug(tmp_path: Path) -> None:
    """A header may declare up to 2**24 blocks (ledger tables of 1 to 2 GB): under a memory limit
    that is out of memory, said in one line with exit 1, not an internal error."""
    from kvcached.ledger.events import BuildBoundary, Header, Policy, PoolGeometry
    from kvcached.ledger.journal import JournalWriter

    big = tmp_path / "big.kvj"
    header = Header(
        page_bytes=1 << 21, pools=(PoolGeometry(block_bytes=1 << 12, num_blocks=1 << 24),), policy=Policy.LEDGER
    )
    with JournalWriter.create(big, header) as w:
        w.append([BuildBoundary(0), BuildBoundary(1)])
    # The limit is set once the tool is imported, so that only the run itself can hit it.
    limit = "import resource, kvreplay.cli; resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20)); "
    r = tool("kvreplay", "check", "--no-progress", str(big), prelude=limit)
    assert r.returncode == 1 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r
    assert r.stderr.startswith(f"kvreplay: out of memory while running check on {big}: "), r.stderr
    assert "a bug" not in r.stderr
