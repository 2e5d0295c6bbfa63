"""The seed's elastic case: two kvcached servers on one budget, an idle one's memory reused.

kvcached PR #598's "Elastic tests" (sglang+sglang, vllm+vllm, vllm+sglang on one GPU), at the
tiny scale of ``kvcached.sglang.testing.mixed`` (which runs the phases: A loads, A's prefix cache
is reset, B loads and is reset, both load at once; probes before and after; a budget of 96 MiB
for two caches of 64 MiB). The checks are the seed's, named by server (``a_``, ``b_``), with
``budget_never_over`` and each server's ``journal_clean`` beside them.

NOTE: the seed sizes each server's load from a calibration on the GPU (70% of the memory free
after it); the tiny scale's load is fixed, so these cases run on a CPU (or on a GPU with the tiny
model), not with the seed's real models.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from kvcached.sglang.testing import mixed

from . import checks
from .cases import Case

MiB = 1 << 20


def run(
    case: Case, model: str, out: Path, python: dict[str, str], say: Callable[[str], None]
) -> tuple[list[checks.Check], dict[str, object]]:
    """The elastic case ``case`` (A's engine ``case.engine``, B's ``case.partner``) served in ``out``."""
    name = case.name
    pair = (case.engine, case.partner)
    out.mkdir(parents=True, exist_ok=True)
    runtime = Path(tempfile.mkdtemp(prefix="kvv-"))  # short: Unix socket paths have 108 bytes
    say(f"{name}: A ({pair[0]}) and B ({pair[1]}) on one budget")
    try:
        r = mixed.run_mixed(
            model,
            out,
            runtime,
            budget="kvvalidate",
            python=python["sglang"],
            vllm_python=python["vllm"],
            pair=pair,
            say=say,
        )
    except RuntimeError as e:
        return [checks.Check(name, "servers_ready", False, str(e)[:160])], {"case": case}
    found: list[checks.Check] = [checks.Check(name, f"{n.lower()}_ready", True) for n in "AB"]

    def check(check_name: str, ok: bool, detail: str = "") -> None:
        found.append(checks.Check(name, check_name, ok, detail))

    for n in "AB":
        done = r.completions.get(n, [])
        check(f"{n.lower()}_requests_ok", bool(done) and all(c.ok for c in done))
    start, a_peak = r.seen["start"], r.seen["a_loaded"]
    free = (start.size or 0) - start.used
    share = {
        mark: {k: int(v) for k, v in r.seen[mark].share.items()}
        for mark in ("start", "a_loaded", "a_reset", "b_loaded")
    }
    grew = share["a_loaded"].get("A", 0) - share["start"].get("A", 0)
    check("a_filled_memory", grew > free / 2, f"A grew {grew / MiB:.0f} MiB of {free / MiB:.0f} MiB free")
    kept = share["a_reset"].get("A", 0) - share["start"].get("A", 0)
    check("a_released_memory", bool(r.seen.get("a_reset_ok")) and kept < grew / 2, f"A kept {kept / MiB:.0f} MiB")
    free_at_peak = (a_peak.size or 0) - a_peak.used
    b = share["b_loaded"].get("B", 0)
    check(
        "b_reused_a_memory",
        b > free_at_peak,
        f"B reached {b / MiB:.0f} MiB, {free_at_peak / MiB:.0f} MiB were free at A's peak",
    )
    contended = r.completions.get("A contended", []) + r.completions.get("B contended", [])
    check("contended_requests_ok", bool(contended) and all(c.ok for c in contended))
    for n in "AB":
        before, after = r.probes.get(f"{n} before", []), r.probes.get(f"{n} after", [])
        same = (
            bool(before)
            and [c.tokens for c in before] == [c.tokens for c in after]
            and all(c.ok for c in before + after)
        )
        check(f"{n.lower()}_probe_unchanged", same)
    alive = r.seen.get("alive") or {}
    over = [s for s in r.samples if s.size is None or s.used > s.size]
    worst = max((s.used - (s.size or 0) for s in over), default=0)
    check(
        "budget_never_over",
        not over and not r.sampler_errors and len(r.samples) > 0,
        f"over by {worst / MiB:.1f} MiB" if over else "",
    )
    for n, engine in zip("AB", pair, strict=True):
        check(f"{n.lower()}_alive", bool(alive.get(n)))
        served = checks.Served(
            name,
            engine,
            True,
            True,
            {},
            True,
            bool(alive.get(n)),
            r.exit_seconds.get(n),
            r.left_behind.get(n, []),
            r.logs.get(n, ""),
        )
        for c in checks.shutdown_checks(served):
            check(f"{n.lower()}_{c.name}", c.ok, c.detail)
        journal = mixed.journal(out, n, engine)
        found.append(_prefixed(n, checks.journal_check(name, journal)))
    return found, {"case": case, "shares": share, "free_at_start": free}


def _prefixed(server: str, c: checks.Check) -> checks.Check:
    return checks.Check(c.case, f"{server.lower()}_{c.name}", c.ok, c.detail)
