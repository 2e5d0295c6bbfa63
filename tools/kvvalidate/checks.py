"""The seed's checks, by its names, over what one server (or a kvcached/native pair) showed.

Server checks (every server): ``server_ready``, ``<phase>_ok``, ``prefix_cache_reset``,
``server_alive_after_load``, ``clean_exit_on_signal``, ``no_error_signatures``,
``no_process_left`` (the seed's ``no_gpu_process_left``, asked of the server's own process tree,
which is what a CPU run can see), ``kvcached_active`` or ``kvcached_inactive``. Comparisons with
native: ``<phase>_tokens_equal`` (gen_seq, apc_0..2: more than half of the prompts give native's
greedy tokens, or all of them and the same top-5 logprobs with ``exact``) and
``apc_<n>_cached_tokens_equal`` (every request). Ours beside the seed's: the same two for
``apc_reload`` (CPU-tier loads), and ``journal_clean``, the kvcached server's ledger journal
replayed by ``kvreplay check``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Final

import msgspec

from kvcached.vllm.testing.e2e import ERROR_SIGNATURES, Completion, replay_check

from .phases import COMPARED, PHASES

# What each engine logs, once, when kvcached is serving it (kvcached.vllm.engine_core.served and
# kvcached.sglang.hooks), and what a native server's log must not hold.
ACTIVE: Final = {"vllm": "[kvcached] active:", "sglang": "pool on elastic pages:"}
OURS: Final = "[kvcached]"
# What kvcached itself logs at ERROR when its ledger sees a freed-block copy (the service's flight
# recorder): a finding, reported by journal_clean, not a crash.
FINDINGS: Final = re.compile(r"kvcached: (invariant I\d violated|flight recorder \()")
EXIT_GRACE_S: Final = 90.0


class Check(msgspec.Struct, frozen=True):
    case: str
    name: str
    ok: bool
    detail: str = ""


class Served(msgspec.Struct, frozen=True):
    """What one server showed, as the runner recorded it."""

    case: str
    engine: str
    kvcached: bool
    ready: bool
    phases: dict[str, list[Completion]]
    reset_ok: bool
    alive_after_load: bool
    exit_seconds: float | None
    left_behind: list[int]
    log_before_stop: str


def _phase_ok(done: list[Completion]) -> tuple[bool, str]:
    bad = [i for i, c in enumerate(done) if not c.ok]
    return not bad and bool(done), ", ".join(f"prompt {i}: HTTP {done[i].status}" for i in bad[:3])


def server_checks(s: Served) -> list[Check]:
    out = [Check(s.case, "server_ready", s.ready)]
    if not s.ready:
        return out
    for phase in PHASES:
        ok, why = _phase_ok(s.phases.get(phase, []))
        out.append(Check(s.case, f"{phase}_ok", ok, why))
    out.append(Check(s.case, "prefix_cache_reset", s.reset_ok))
    out.append(Check(s.case, "server_alive_after_load", s.alive_after_load))
    return out + shutdown_checks(s)


def shutdown_checks(s: Served) -> list[Check]:
    """What the stop and the log show: a clean exit, no error line, nothing left, kvcached on or off."""
    out: list[Check] = []
    exited = s.exit_seconds is not None and s.exit_seconds <= EXIT_GRACE_S
    took = "" if s.exit_seconds is None else f"{s.exit_seconds:.1f} s"
    out.append(Check(s.case, "clean_exit_on_signal", exited, took))
    lines = s.log_before_stop.splitlines()
    bad = [ln for ln in lines if ERROR_SIGNATURES.search(ln) and not FINDINGS.search(ln)]
    out.append(Check(s.case, "no_error_signatures", not bad, bad[0].strip()[:160] if bad else ""))
    left = ", ".join(map(str, s.left_behind))
    out.append(Check(s.case, "no_process_left", not s.left_behind, f"pids {left}" if left else ""))
    if s.kvcached:
        active = [ln for ln in lines if ACTIVE[s.engine] in ln]
        why = "" if len(active) == 1 else f"{len(active)} lines say kvcached is active (one expected)"
        out.append(Check(s.case, "kvcached_active", len(active) == 1, why))
    else:
        ours = [ln for ln in lines if OURS in ln]
        out.append(Check(s.case, "kvcached_inactive", not ours, ours[0].strip()[:160] if ours else ""))
    return out


def _differs(a: Completion, b: Completion, exact: bool) -> str:
    """How ``b`` differs from native's ``a`` ("" where it does not)."""
    if a.tokens != b.tokens:
        at = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y), 0)
        return f"token {at}: native {a.tokens[at : at + 1]}, kvcached {b.tokens[at : at + 1]}"
    if exact and b.max_logprob_diff(a) != 0.0:
        return "top-5 logprobs differ"
    return ""


def compare(case: str, native: Served, ours: Served, *, exact: bool) -> list[Check]:
    """``<phase>_tokens_equal`` and ``apc_<n>_cached_tokens_equal`` of ``ours`` against native."""
    out: list[Check] = []
    if not (native.ready and ours.ready):
        return [Check(case, "compared_with_native", False, "a server did not start")]
    for phase in COMPARED:
        a, b = native.phases.get(phase, []), ours.phases.get(phase, [])
        diffs = [(i, _differs(x, y, exact)) for i, (x, y) in enumerate(zip(a, b, strict=False))]
        diffs = [(i, d) for i, d in diffs if d]
        same = len(a) - len(diffs) if len(a) == len(b) else 0
        ok = same == len(a) if exact else same * 2 > len(a)
        detail = f"{len(diffs)} of {len(a)} prompts differ" + "".join(f"; prompt {i}: {d}" for i, d in diffs[:2])
        out.append(Check(case, f"{phase}_tokens_equal", ok and len(a) == len(b), detail if diffs else ""))
        if phase.startswith("apc_"):
            counts = [(x.cached_tokens, y.cached_tokens) for x, y in zip(a, b, strict=False)]
            wrong = [(i, x, y) for i, (x, y) in enumerate(counts) if x != y or x is None]
            why = "; ".join(f"prompt {i}: native {x}, kvcached {y}" for i, x, y in wrong[:2])
            out.append(Check(case, f"{phase}_cached_tokens_equal", not wrong and len(a) == len(b), why))
    return out


def failed(checks: Iterable[Check]) -> list[Check]:
    return [c for c in checks if not c.ok]


def journal_check(case: str, journal: Path) -> Check:
    """``journal_clean``: the journal replayed by ``kvreplay check``; its first violation if any."""
    if not journal.exists():
        return Check(case, "journal_clean", False, f"no journal at {journal}")
    rc, text = replay_check(journal, timeout=600)
    lines = text.strip().splitlines() or [""]
    first = next((ln for ln in lines if re.search(r": I\d ", ln)), lines[-1])
    return Check(case, "journal_clean", rc == 0, "" if rc == 0 else first.removeprefix(f"{journal}: ")[:160])
