"""kvsim's SGLang variant: the shipped policy passes, and each check catches what it is for.

``legacy`` must trip the checks of the two hazards (a forward under overlap reading pages
unmapped under it; a backup a flush orphaned copying from unmapped pages), and each planted bug
must trip its own check, or the campaign proves nothing.
"""

from __future__ import annotations

import subprocess
import sys

from kvsim.on_sglang import VARIANTS, draw, run_case

SEEDS = range(30)


def test_seeds_repeat_exactly() -> None:
    assert draw(7) == draw(7)
    assert run_case(draw(7), "legacy") == run_case(draw(7), "legacy")


def test_the_shipped_policy_passes_and_each_bug_is_caught() -> None:
    tripped: dict[str, set[str]] = {v: set() for v in VARIANTS}
    for seed in SEEDS:
        case = draw(seed)
        for variant in VARIANTS:
            result = run_case(case, variant)
            if variant == "ledger":
                assert result.ok, (seed, result.failures)
            tripped[variant] |= set(result.checks())
    assert {"attended-bytes", "unmapped-touch", "ledger"} <= tripped["legacy"]
    assert "attended-bytes" in tripped["no-hold"]  # overlap's frees recorded at once
    assert {"leftover", "ledger"} <= tripped["no-poll"]  # copies whose acks a reset dropped


def test_the_cli_runs_it_and_says_what_legacy_trips() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvsim.cli", "run", "--engine", "sglang", "--seeds", "0-9"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert sum(line.startswith("seed ") for line in lines) == 10
    assert any(line.strip().startswith("ledger     : 0 of 10 seeds failed") for line in lines)
