"""``kvsim``: run, reproduce and shrink seeded simulations of vLLM + kvcached.

``kvsim run`` runs seeds under every variant and counts what fails (``cmd_run``), ``kvsim repro``
shows one seed's case and failing checks (``cmd_repro``), and ``kvsim shrink`` reduces a failing
seed to a test case (``cmd_shrink``). A seed repeats exactly (``_pin_hash_seed``). Exit codes
are the three tools' (``kvcli``; ``main``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import kvcli

VARIANTS = ("ledger", "legacy", "never-unmap", "vllm")
# ``--engine sglang``: kvsim.on_sglang (SGLang's pool, allocator and HiCache; run in
# the SGLang environment); two of its variants are planted bugs its checks must catch.
SGLANG_VARIANTS = ("ledger", "legacy", "no-hold", "no-poll")


def parse_seeds(text: str) -> list[int]:
    """``1-500``, ``3,7,9`` or ``1-10,20``: seeds >= 0, at most 1,000,000 of them."""
    seeds: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise argparse.ArgumentTypeError(f"{text!r}: give seeds as 1-500, 3,7,9 or 1-10,20")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a or len(seeds) + b - a + 1 > 1_000_000:
            raise argparse.ArgumentTypeError(f"{text!r}: an empty or too large range (at most 1,000,000 seeds)")
        seeds += range(a, b + 1)
    return seeds


_seed = kvcli.whole(0, "a seed")
_jobs = kvcli.whole(1, "a number of processes", 64)
_runs = kvcli.whole(1, "a number of runs", 100_000)


def _check_name(known: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse ``type``: one of ``known``, else one usage line that lists them."""

    def parse(text: str) -> str:
        if text not in known:
            raise argparse.ArgumentTypeError(f"{text!r} is not a check: choose from {', '.join(known)}")
        return text

    parse.__name__ = "check"
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = kvcli.Parser(prog="kvsim", description="Seeded simulation of vLLM's scheduler and connector over kvcached.")
    ap.add_argument("--version", action="version", version=kvcli.version("kvsim"))
    sub = ap.add_subparsers(dest="cmd", required=True, parser_class=kvcli.Parser)
    r = sub.add_parser("run", help="run seeds under every variant and count what fails")
    r.add_argument("--seeds", type=parse_seeds, required=True, help="1-500, 3,7,9 or 1-10,20")
    r.add_argument("--engine", choices=("vllm", "sglang"), default="vllm", help="whose scheduler (default vllm)")
    r.add_argument("--jobs", type=_jobs, default=1, help="processes (default 1)")
    r.add_argument(
        "--variants",
        help=f"comma-separated, of {', '.join(VARIANTS)} (sglang: {', '.join(SGLANG_VARIANTS)}); default: all",
    )
    r.add_argument("--json", action="store_true", help="one JSON object per seed, then the summary")
    p = sub.add_parser("repro", help="the case of a seed and every check it fails, with step and block")
    p.add_argument("seed", type=_seed)
    p.add_argument("--variant", choices=VARIANTS, help="one variant (default: all)")
    p.add_argument("--json", action="store_true", help="the case and every variant's result as one JSON object")
    s = sub.add_parser("shrink", help="reduce a failing seed; write its journal and a test case")
    s.add_argument("seed", type=_seed)
    s.add_argument("-o", "--output", required=True, metavar="DIR", help="where to write (traces/ for a golden test)")
    s.add_argument(
        "--variant", choices=VARIANTS, help="default: the first failing of ledger, never-unmap, vllm, legacy"
    )
    # Checked here, before the seed runs: else a misspelt check runs every variant (minutes with
    # vLLM) only to say the seed does not fail it. result imports msgspec alone, never vLLM.
    from kvsim.on_vllm.result import CHECKS

    s.add_argument(
        "--check",
        type=_check_name(tuple(CHECKS)),
        metavar="CHECK",
        help=f"the check to keep failing, of {', '.join(CHECKS)} (default: the first the variant fails)",
    )
    s.add_argument("--max-runs", type=_runs, default=150, help="runs of candidate cases at most (default 150)")
    s.add_argument("--json", action="store_true", help="one JSON object at the end: the check, runs and files written")
    return ap


def _pin_hash_seed(argv: Sequence[str]) -> None:
    """Re-execute this command with ``PYTHONHASHSEED=0`` unless the hash seed is pinned already.

    NOTE: a seed repeats exactly: the case is drawn from the seed alone, nothing reads the clock,
    and the hash seed is pinned, since vLLM hands some ids over in sets of strings."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        env = dict(os.environ, PYTHONHASHSEED="0")
        os.execve(sys.executable, [sys.executable, "-m", "kvsim.cli", *argv], env)


def _quiet() -> None:
    # vLLM logs a line per connector it builds; a campaign builds thousands.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TQDM_DISABLE", "1")


def _run_seed(seed: int, variants: tuple[str, ...]) -> list[Any]:
    from kvsim.on_vllm.draw import draw
    from kvsim.on_vllm.execute import run_case

    case = draw(seed)
    return [run_case(case, v) for v in variants]


def _run_sglang_seed(seed: int, variants: tuple[str, ...]) -> list[Any]:
    from kvsim.on_sglang import draw, run_case

    case = draw(seed)
    return [run_case(case, v) for v in variants]


class _Tally:
    """A campaign's failures: per variant and check, failed seeds per variant, and whether the
    shipped variant failed; the same for either engine's results (``ok``, ``checks()``)."""

    def __init__(self, variants: tuple[str, ...]) -> None:
        self.variants = variants
        self.fails: dict[str, dict[str, int]] = {v: {} for v in variants}
        self.failed_seeds: dict[str, int] = dict.fromkeys(variants, 0)
        self.shipped_failed = False

    def add(self, results: list[Any]) -> str:
        """Counts one seed's results; returns its verdicts, as the seed's line shows them."""
        for r in results:
            for c in r.checks():
                self.fails[r.variant][c] = self.fails[r.variant].get(c, 0) + 1
            self.failed_seeds[r.variant] += not r.ok
            self.shipped_failed |= r.variant == "ledger" and not r.ok
        return ", ".join(f"{r.variant} {'ok' if r.ok else '+'.join(r.checks())}" for r in results)

    def print_variants(self, n: int, checks: Any) -> None:
        p = kvcli.plural
        for v in self.variants:
            per = ", ".join(f"{c} {k}" for c, k in sorted(self.fails[v].items())) or "nothing failed"
            print(f"  {v:11}: {self.failed_seeds[v]:,} of {p(n, 'seed')} failed; {per}")
        if "legacy" in self.variants:
            never = [c for c in checks if not self.fails["legacy"].get(c)]
            print(f"  checks legacy never tripped in this campaign: {', '.join(never) or 'none'}")


def _seeds_run(
    args: argparse.Namespace, run_seed: Any, variants: tuple[str, ...], chunksize: int
) -> Iterator[list[Any]]:
    """Each seed's results, in seed order, in this process or ``--jobs`` of them."""
    if args.jobs == 1:
        for seed in args.seeds:
            yield run_seed(seed, variants)
    else:
        with ProcessPoolExecutor(args.jobs) as ex:
            yield from ex.map(run_seed, args.seeds, [variants] * len(args.seeds), chunksize=chunksize)


def cmd_run_sglang(args: argparse.Namespace, variants: tuple[str, ...]) -> int:
    import msgspec

    from kvsim.on_sglang import CHECKS

    tally = _Tally(variants)
    totals = {"flushes": 0, "stores": 0, "loads": 0}
    for results in _seeds_run(args, _run_sglang_seed, variants, chunksize=4):
        verdicts = tally.add(results)
        first = results[0]
        for k in totals:
            totals[k] += getattr(first, k)
        if args.json:
            print(json.dumps({"seed": first.seed, "results": msgspec.to_builtins(results)}), flush=True)
        else:
            print(
                f"seed {first.seed:5}: {verdicts} | flushes {first.flushes}, stores {first.stores}, "
                f"loads {first.loads}",
                flush=True,
            )
    n = len(args.seeds)
    if args.json:
        summary = {"seeds": n, "failed_seeds": tally.failed_seeds, "fails": tally.fails, "totals": totals}
        print(json.dumps({"summary": summary}))
    else:
        p = kvcli.plural
        print(
            f"\n{p(n, 'seed')} (SGLang); first variant: {totals['flushes']:,} flushes, "
            f"{p(totals['stores'], 'acknowledged backup')}, {p(totals['loads'], 'load')}"
        )
        tally.print_variants(n, CHECKS)
    return 1 if tally.shipped_failed else 0


def cmd_run(args: argparse.Namespace) -> int:
    """``kvsim run --seeds 1-500 [--jobs N] [--json]``.

    NOTE: it runs each seed under every variant (a line per seed) and ends with the counts per
    check and variant, how often ``legacy`` trips each check (a check that never does is suspect)
    and what the campaign covered."""
    import msgspec

    if args.engine == "sglang":
        return cmd_run_sglang(args, tuple(v.strip() for v in (args.variants or ",".join(SGLANG_VARIANTS)).split(",")))

    from kvsim.on_vllm.result import CHECKS, Coverage

    variants = tuple(v.strip() for v in (args.variants or ",".join(VARIANTS)).split(","))  # checked by main
    tally = _Tally(variants)
    cov = Coverage()
    for results in _seeds_run(args, _run_seed, variants, chunksize=1):
        verdicts = tally.add(results)
        cov = cov + results[0].coverage
        if args.json:
            print(json.dumps({"seed": results[0].seed, "results": msgspec.to_builtins(results)}), flush=True)
        else:
            c = results[0].coverage
            print(
                f"seed {results[0].seed:5}: {verdicts} | steps {c.steps}, preempt {c.preemptions}, "
                f"abort {c.aborts} ({c.aborts_in_flight} in flight), reset {c.resets}, shrink {c.shrinks}",
                flush=True,
            )
    n = len(args.seeds)
    fails = tally.fails
    summary = {
        "seeds": n,
        "failed_seeds": tally.failed_seeds,
        "fails": fails,
        "legacy_trips": {c: fails.get("legacy", {}).get(c, 0) for c in CHECKS} if "legacy" in variants else {},
        "coverage": msgspec.to_builtins(cov),
    }
    if args.json:
        print(json.dumps({"summary": summary}))
    else:
        p = kvcli.plural
        print(
            f"\n{p(n, 'seed')}; coverage (first variant): {p(cov.preemptions, 'preemption')}, "
            f"{p(cov.aborts, 'abort')} ({cov.aborts_in_flight:,} with jobs in flight), {p(cov.resets, 'reset')}, "
            f"{p(cov.shrinks, 'shrink')}, {p(cov.stores, 'store')}, {p(cov.loads, 'load')}, {p(cov.steps, 'step')}"
        )
        tally.print_variants(n, CHECKS)
    return 1 if tally.shipped_failed else 0


def cmd_repro(args: argparse.Namespace) -> int:
    """``kvsim repro SEED [--variant V]``: the case and every failing check with its step and block."""
    import msgspec

    from kvsim.on_vllm.draw import draw
    from kvsim.on_vllm.execute import run_case

    case = draw(args.seed)
    results = [run_case(case, v) for v in ([args.variant] if args.variant else VARIANTS)]
    if args.json:
        print(json.dumps({"case": msgspec.to_builtins(case), "results": msgspec.to_builtins(results)}))
    else:
        print(f"seed {case.seed}: {case.describe()}")
        print("config: " + json.dumps(msgspec.to_builtins(case.config)))
        print("workload:")
        for i, a in enumerate(case.actions):
            print(f"  {i:3} {a!r}")
        for r in results:
            print(r.line())
            for f in r.failures:
                print(f"    {f.line()}")
    return 1 if any(r.variant == "ledger" and not r.ok for r in results) else 0


def cmd_shrink(args: argparse.Namespace) -> int:
    """``kvsim shrink SEED -o DIR``: reduce a failing seed and write its journal, expected report
    and case (see ``kvsim.on_vllm.shrink.write_case``)."""
    from kvsim.on_vllm.draw import draw
    from kvsim.on_vllm.execute import run_case
    from kvsim.on_vllm.shrink import shrink, write_case

    case = draw(args.seed)
    order = [args.variant] if args.variant else ["ledger", "never-unmap", "vllm", "legacy"]
    for variant in order:
        res = run_case(case, variant)
        checks = res.checks()
        if args.check:
            if args.check in checks:
                break
        elif checks:
            break
    else:
        what = f"check {args.check}" if args.check else "any check"
        where = ", ".join(order)
        print(f"kvsim: seed {args.seed} does not fail {what} under {where}: nothing to shrink", file=sys.stderr)
        return kvcli.FAILED
    check = args.check or checks[0]
    say = (lambda *_: None) if args.json else print
    say(f"seed {args.seed}: shrinking {check} under {variant}: {case.describe()}")
    rep = shrink(case, variant, check, budget=args.max_runs, progress=say)
    paths = write_case(rep, Path(args.output))
    if args.json:
        doc = {
            "seed": args.seed,
            "variant": variant,
            "check": check,
            "runs": rep.runs,
            "case": rep.case.describe(),
            "failures": [f.line() for f in rep.result.failures],
            "files": [str(p) for p in paths],
        }
        print(json.dumps(doc))
        return kvcli.OK
    print(f"after {kvcli.plural(rep.runs, 'run')}: {rep.case.describe()}")
    for f in rep.result.failures:
        print(f"    {f.line()}")
    for p in paths:
        print(f"wrote {p}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The ``kvsim`` command; returns its exit code.

    NOTE: exit codes are the three tools' (``kvcli``): 2 a bad argument (one line), 1 a shipped
    variant (``ledger``) fails a seed, or the run cannot be done (no vLLM here, nothing to
    shrink), 0 otherwise."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    usage = kvcli.Parser(prog=f"kvsim {args.cmd}")  # names the sub-command's --help
    if args.cmd == "run" and args.variants is not None:
        known = SGLANG_VARIANTS if args.engine == "sglang" else VARIANTS
        if not {v.strip() for v in args.variants.split(",")} <= set(known):
            usage.error(f"--variants {args.variants!r}: choose from {', '.join(known)}")
    if args.cmd == "shrink" and Path(args.output).exists() and not Path(args.output).is_dir():
        usage.error(f"-o {args.output}: not a directory")
    _pin_hash_seed(argv)
    _quiet()
    body = {"run": cmd_run, "repro": cmd_repro, "shrink": cmd_shrink}[args.cmd]

    def guarded() -> int:
        try:
            return body(args)
        except ModuleNotFoundError as e:
            if e.name is None or e.name.split(".")[0] not in _ENGINE_DEPS:
                raise
            from kvcached.sglang.hooks import SGLANG
            from kvcached.vllm.patches import VLLM

            if getattr(args, "engine", "vllm") == "sglang":
                need = f"SGLang {SGLANG.oldest} to {SGLANG.newest} (scripts/_env.sh's ensure_sglang_env: .venv-sglang)"
                print(
                    f"kvsim: --engine sglang drives SGLang's own classes, and this environment has no "
                    f"{e.name}: run it in {need}",
                    file=sys.stderr,
                )
                return kvcli.FAILED
            print(
                f"kvsim: it drives vLLM's real scheduler, and this environment has no {e.name}: "
                f"install vLLM {VLLM.newest} here (pip install vllm=={VLLM.newest}, which brings torch)",
                file=sys.stderr,
            )
            return kvcli.FAILED

    return kvcli.run("kvsim", guarded, debug_env="KVSIM_DEBUG", context=f"while running {args.cmd}")


# What the simulation imports beyond kvcached: missing, it is an environment to set up, not a bug.
_ENGINE_DEPS = frozenset(("vllm", "sglang", "torch", "transformers", "numpy"))


if __name__ == "__main__":
    sys.exit(main())
