"""Shrink a failing kvsim case to a small one that fails the same check, and write it down.

Greedy delta debugging over the case's data (``draw.Case``, ``shrink``). Every candidate is a
complete case run from scratch, so what comes out is reproducible by ``kvsim repro`` and needs no
history. ``write_case`` writes the shrunk case down with its journal and expected report.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from kvsim.on_vllm.draw import Abort, Action, Add, Case, Limit, Reset, SimConfig, Step
from kvsim.on_vllm.execute import run_case
from kvsim.on_vllm.result import SeedResult


class ShrinkReport(msgspec.Struct, frozen=True, kw_only=True):
    case: Case
    variant: str
    check: str
    runs: int
    result: SeedResult


def shrink(
    case: Case, variant: str, check: str, *, budget: int = 150, progress: Callable[[str], None] | None = None
) -> ShrinkReport:
    """Shrink ``case`` while it still fails ``check`` under ``variant``, in at most ``budget`` runs.

    NOTE: it tries each simplification in turn (``_candidates``) and keeps the first that still
    fails the same check under the same variant; it starts over until nothing applies or the run
    budget is spent.
    """
    runs = 0
    best = run_case(case, variant)
    runs += 1
    if check not in best.checks():
        raise ValueError(f"seed {case.seed} does not fail {check} under {variant}")
    changed = True
    while changed and runs < budget:
        changed = False
        for cand in _candidates(case):
            if runs >= budget:
                break
            res = run_case(cand, variant)
            runs += 1
            if check in res.checks():
                case, best, changed = cand, res, True
                if progress is not None:
                    size = f"{len(case.adds)} requests, {_tokens(case)} tokens, {case.faults()} faults"
                    progress(f"  {runs:3} runs: {size}")
                break
    return ShrinkReport(case=case, variant=variant, check=check, runs=runs, result=best)


def _tokens(case: Case) -> int:
    return sum(a.shared_len + a.length + a.max_tokens for a in case.adds)


def _replace_action(case: Case, i: int, new: Action | None) -> Case:
    acts = list(case.actions)
    if new is None:
        del acts[i]
    else:
        acts[i] = new
    return msgspec.structs.replace(case, actions=tuple(acts))


def _drop_add(case: Case, k: int) -> Case:
    """Drop the k-th request, its aborts, and renumber the requests after it."""
    out: list[Action] = []
    n = -1
    for a in case.actions:
        if isinstance(a, Add):
            n += 1
            if n == k:
                continue
            if a.follow_up == k:
                a = msgspec.structs.replace(a, follow_up=-1)
            elif a.follow_up > k:
                a = msgspec.structs.replace(a, follow_up=a.follow_up - 1)
        elif isinstance(a, Abort):
            if a.target == k:
                continue
            if a.target > k:
                a = Abort(a.target - 1)
        out.append(a)
    return msgspec.structs.replace(case, actions=tuple(out))


def _candidates(case: Case) -> Iterator[Case]:
    """Each simpler case, in the order tried: drop a request, drop a fault, drop or shorten a run
    of steps, shorten a prompt or an output, undo a shared prefix, a stop token or a follow-up,
    then simplify the configuration toward the defaults."""
    nadds = len(case.adds)
    for k in reversed(range(nadds)):
        if nadds > 1:
            yield _drop_add(case, k)
    for i, a in enumerate(case.actions):
        if isinstance(a, Abort | Reset | Limit):
            yield _replace_action(case, i, None)
    for i, a in enumerate(case.actions):
        if isinstance(a, Step):
            yield _replace_action(case, i, None)
            if a.n > 1:
                yield _replace_action(case, i, Step(a.n - 1))
    for i, a in enumerate(case.actions):
        if not isinstance(a, Add):
            continue
        simpler = [
            msgspec.structs.replace(a, length=a.length // 2) if a.length > 1 else None,
            msgspec.structs.replace(a, shared=-1, shared_len=0) if a.shared >= 0 else None,
            msgspec.structs.replace(a, shared_len=a.shared_len // 2) if a.shared_len > 1 else None,
            msgspec.structs.replace(a, max_tokens=a.max_tokens // 2, stop_at=min(a.stop_at, a.max_tokens // 2))
            if a.max_tokens > 1
            else None,
            msgspec.structs.replace(a, stop_at=0) if a.stop_at else None,
            msgspec.structs.replace(a, follow_up=-1) if a.follow_up >= 0 else None,
        ]
        for s in simpler:
            if s is not None:
                yield _replace_action(case, i, s)
    c = case.config
    default = SimConfig()
    for name in (
        "async_scheduling",
        "worker_at_schedule",
        "late_steps",
        "sliding_window",
        "blocks_per_chunk",
        "max_cached_blocks",
        "min_reserved_pages",
        "max_reserved_pages",
        "eviction_policy",
        "cpu_blocks",
        "max_num_seqs",
        "max_num_batched_tokens",
        "page_blocks",
        "kind",
    ):
        if getattr(c, name) != getattr(default, name):
            yield msgspec.structs.replace(case, config=msgspec.structs.replace(c, **{name: getattr(default, name)}))
    if c.tp != 1:
        yield msgspec.structs.replace(case, config=msgspec.structs.replace(c, tp=1, late_steps=0))


def write_case(report: ShrinkReport, out: Path) -> list[Path]:
    """Write the journal, its expected ``kvreplay check --json`` report and the case; returns the paths.

    NOTE: the journal is the shrunk case's under its variant (under ``ledger`` for a ``vllm``
    failure, which has no journal of its own), with its ``kvreplay check --json`` report beside it
    (``NAME.VARIANT.kvj`` and ``NAME.VARIANT.check.json``: with ``-o traces`` the golden trace test
    picks them up). ``NAME.kvsim.json`` holds the case and the checks it fails, which
    ``tests/vllm_scheduler/test_kvsim.py`` runs again."""
    from kvreplay.check import dumps, run_check
    from kvreplay.check import report as check_report

    out.mkdir(parents=True, exist_ok=True)
    name = f"kvsim-{report.case.seed}"
    journal_variant = report.variant if report.variant != "vllm" else "ledger"
    kvj = out / f"{name}.{journal_variant}.kvj"
    run_case(report.case, journal_variant, journal=str(kvj))
    check = out / f"{name}.{journal_variant}.check.json"
    check.write_text(dumps(check_report(run_check(str(kvj), progress=False))))
    doc = {
        "seed": report.case.seed,
        "variant": report.variant,
        "check": report.check,
        "fails": report.result.checks(),
        "failures": [f.line() for f in report.result.failures],
        "case": msgspec.to_builtins(report.case),
    }
    spec = out / f"{name}.kvsim.json"
    spec.write_text(json.dumps(doc, indent=1) + "\n")
    return [kvj, check, spec]


def read_case(path: Path) -> tuple[Case, str, list[str]]:
    """A case written by ``write_case``: the case, its variant, the checks it failed then."""
    doc = json.loads(path.read_text())
    return msgspec.convert(doc["case"], Case), str(doc["variant"]), list(doc["fails"])
