"""kvvalidate's command line: ``list`` the cases, ``run`` them and print the seed's check table.

It fails as kvreplay, kvctl and kvsim do (``kvcli``): exit 0 when every check of every case run
passed, 1 when a check failed or nothing could run, 2 for a usage error, one line each.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import kvcli
import msgspec

from . import cases, checks, runner


def _setting(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not eq or not name.startswith("KVCACHED_"):
        raise argparse.ArgumentTypeError(f"{text!r}: give KVCACHED_NAME=VALUE")
    return name, value


def _parser() -> kvcli.Parser:
    p = kvcli.Parser(prog="kvvalidate", description="kvcached PR #598's validation matrix, run here.")
    p.add_argument("--version", action="version", version=kvcli.version("kvvalidate"))
    sub = p.add_subparsers(dest="command", required=True, parser_class=kvcli.Parser)
    ls = sub.add_parser("list", help="the cases of the matrices (all, or those named)")
    ls.add_argument("names", nargs="*", metavar="MATRIX|CASE")
    ls.add_argument("--json", action="store_true")
    run = sub.add_parser("run", help="run cases: native and kvcached servers, the seed's checks")
    run.add_argument("names", nargs="+", metavar="MATRIX|CASE")
    run.add_argument("-o", "--out", type=Path, help="a new folder for logs and summary.json")
    run.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where nvidia-smi is found")
    run.add_argument("--policy", choices=("ledger", "legacy"), default="ledger")
    run.add_argument("--set", dest="settings", type=_setting, action="append", default=[], metavar="KVCACHED_X=V")
    run.add_argument("--exact", action="store_true", help="all tokens and top-5 logprobs equal native's")
    run.add_argument("--vllm-python", default=runner.python_for("vllm"), metavar="PYTHON")
    run.add_argument("--sglang-python", default=runner.python_for("sglang"), metavar="PYTHON")
    run.add_argument("--json", action="store_true", help="the checks as JSON lines")
    return p


def _find(p: kvcli.Parser, names: list[str]) -> list[cases.Case]:
    try:
        return cases.find(names or list(cases.MATRICES))
    except KeyError as e:
        known = ", ".join(cases.MATRICES)
        p.error(f"no case or matrix {e.args[0]!r} (matrices: {known}; kvvalidate list shows the cases)")


def cmd_list(found: list[cases.Case], as_json: bool, out: TextIO) -> int:
    if as_json:
        for c in found:
            out.write(msgspec.json.encode(c).decode() + "\n")
        return kvcli.OK
    rows = [("case", "model", "kind", "TP", "KV dtype", "runs on", "known")]
    for c in found:
        where = "GPU only" if c.gpu_only else "CPU or GPU"
        rows.append((c.name, c.model.path, c.model.kind, str(c.tp), c.kv_dtype or "model", where, c.known))
    _table(rows, out)
    return kvcli.OK


def _table(rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() + "\n")


def cmd_run(args: argparse.Namespace, found: list[cases.Case], out: TextIO, err: TextIO) -> int:
    on_cpu = (args.device or ("cuda" if shutil.which("nvidia-smi") else "cpu")) == "cpu"
    runnable = [c for c in found if not (on_cpu and c.gpu_only)]
    for c in found:
        if c not in runnable:
            err.write(f"kvvalidate: {c.name}: skipped on a CPU (GPU only: {c.gpu_only})\n")
    if not runnable:
        err.write("kvvalidate: nothing to run on a CPU; the cpu matrix runs here (kvvalidate list cpu)\n")
        return kvcli.FAILED
    folder = args.out or Path(f"kvvalidate-{time.strftime('%Y%m%d-%H%M%S')}")
    folder.mkdir(parents=True, exist_ok=False)  # a new folder: nothing of anyone's is overwritten
    opts = runner.Options(
        out=folder.resolve(),
        on_cpu=on_cpu,
        python={"vllm": args.vllm_python, "sglang": args.sglang_python},
        policy=args.policy,
        settings=dict(args.settings),
        exact=args.exact,
    )
    every: list[checks.Check] = []
    summary: list[dict[str, object]] = []
    verdicts: list[tuple[str, list[checks.Check], float]] = []  # case, its checks, its seconds
    for case in runnable:
        t0 = time.monotonic()
        found_checks, part = runner.run_case(case, opts, lambda line: print(f"kvvalidate: {line}", file=err))
        seconds = time.monotonic() - t0
        every += found_checks
        summary.append({**part, "seconds": round(seconds, 1), "checks": found_checks})
        verdicts.append((case.name, found_checks, seconds))
    tmp = folder / ".summary.json.tmp"
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode({"cases": summary})))
    tmp.replace(folder / "summary.json")
    if args.json:
        for check in every:
            out.write(msgspec.json.encode(check).decode() + "\n")
    else:
        rows = [("case", "check", "result", "detail")]
        rows += [(k.case, k.name, "pass" if k.ok else "FAIL", k.detail) for k in every]
        _table(rows, out)
    for name, mine, seconds in verdicts:
        wrong = checks.failed(mine)
        names = ", ".join(c.name for c in wrong[:4]) + (", ..." if len(wrong) > 4 else "")
        verdict = f"{len(wrong)} of {len(mine)} checks failed: {names}" if wrong else f"all {len(mine)} checks passed"
        err.write(f"kvvalidate: {name}: {verdict} ({seconds:.0f} s)\n")
    bad = checks.failed(every)
    cases_run = kvcli.plural(len(runnable), "case")
    err.write(
        f"kvvalidate: {cases_run}, {kvcli.plural(len(every), 'check')}, {len(bad)} failed; "
        f"logs and summary.json in {folder}\n"
    )
    return kvcli.FAILED if bad else kvcli.OK


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run one kvvalidate command line and return its exit status.

        kvvalidate list [MATRIX|CASE ...] [--json]    the cases: model, kind, TP, KV dtype, where they run
        kvvalidate run MATRIX|CASE ... [-o DIR]       serve each case native and under kvcached; the checks

    ``run``'s options: ``--device cpu|cuda``, ``--policy legacy`` (the bug planted: the journal
    check must fail), ``--set KVCACHED_X=V`` (a setting for the kvcached servers), ``--exact``,
    ``--vllm-python``/``--sglang-python`` (an engine's interpreter, when it is another environment's).
    """
    out = out or sys.stdout
    p = _parser()
    args = p.parse_args(argv)
    found = _find(p, args.names)
    if args.command == "run" and args.out is not None and (args.out.exists() or args.out.is_symlink()):
        p.error(f"{args.out} exists: name a new folder for the run")

    def body() -> int:
        if args.command == "list":
            return cmd_list(found, args.json, out)
        return cmd_run(args, found, out, sys.stderr)

    return kvcli.run("kvvalidate", body, debug_env="KVVALIDATE_DEBUG")
