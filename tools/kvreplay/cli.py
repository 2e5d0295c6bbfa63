"""The ``kvreplay`` command line, in the style of git: one subcommand per question.

Each subcommand lives in its own module and adds its own parser; this module only wires them
and keeps the promise the three tools make alike (``kvcli``): whatever the input, the answer is
a result or one line on stderr, never a traceback. Exit codes: 0 clean or done; 1 the run found
what it looks for (``check``: a violation) or could not be done (an unreadable, truncated or
foreign journal, a bad snapshot, an output file that cannot be written: errors kvcached raises
on purpose, ``KvcachedError``, or an ``OSError``); 2 the command line itself is wrong (one line
naming ``--help``). Anything else is a bug in kvreplay or the ledger and says so, with
``KVREPLAY_DEBUG=1`` to get the traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import kvcli
import msgspec

from kvcached.ledger.events import Policy
from kvcached.testing.seed_cases import SCENARIOS

from . import check, compare, make, minimize, plot, show, snapshot, stats


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.save:
        written = make.save_scenarios(args.save, args.scenario)
        if args.json:
            print(msgspec.json.encode(written).decode())
        else:
            print("\n".join(w.line() for w in written))
        return 0
    from .demo import render, results

    sys.stdout.write(results(args.scenario or None) if args.json else render(args.scenario or None))
    return 0


class _Names(tuple[str, ...]):
    """The scenario names as ``choices`` of a ``nargs="*"`` positional: Python 3.11's argparse
    checks an empty one as the value ``[]``, which is allowed, but never names it in a usage line."""

    def __contains__(self, value: object) -> bool:
        return value == [] or super().__contains__(value)


def _replay_options() -> argparse.ArgumentParser:
    """Options shared by the subcommands that replay one trace under one policy."""
    common = kvcli.Parser(add_help=False)
    common.add_argument("trace", metavar="TRACE", help="a kvcached journal (.kvj)")
    common.add_argument(
        "--policy",
        choices=[p.value for p in Policy],
        help="replay under this policy instead of the recorded one",
    )
    common.add_argument(
        "--derive",
        action="store_true",
        help="re-derive map/unmap decisions with the most eager allocator instead of using the recorded ones",
    )
    common.add_argument(
        "--from-snapshot",
        metavar="SNAP",
        help="start from a snapshot (kvreplay snapshot) and skip the events it already holds",
    )
    common.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = kvcli.Parser(
        prog="kvreplay",
        description="Replay kvcached ledger traces offline: find, explain and shrink freed-block copies. "
        "Exit codes: 0 clean or done, 1 a violation found (check) or input that cannot be used, 2 a usage error.",
    )
    parser.add_argument("--version", action="version", version=kvcli.version("kvreplay"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")  # sub-parsers are kvcli.Parser too
    common = _replay_options()
    check.add_parser(sub, common)
    compare.add_parser(sub)
    minimize.add_parser(sub)
    show.add_parser(sub, common)
    stats.add_parser(sub, common)
    plot.add_parser(sub, common)
    snapshot.add_parser(sub)
    demo = sub.add_parser(
        "demo",
        help="replay kvcached PR #598's freed-block-copy cases, built in, under legacy and ledger",
        description="Replay the built-in scenarios (the three freed-block-copy cases of upstream kvcached "
        "PR #598 and its review comment P2) with an eager allocator under both policies and print what each finds.",
    )
    demo.add_argument("scenario", nargs="*", choices=_Names(SCENARIOS), help="scenarios to run (default: all)")
    demo.add_argument(
        "--save",
        metavar="DIR",
        help="instead, write each scenario as a trace under both policies (DIR/NAME-POLICY.kvj) to try kvreplay on",
    )
    demo.add_argument("--json", action="store_true", help="per scenario and policy: violations, unmaps, peak pins")
    demo.set_defaults(func=_cmd_demo)
    make.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "from_snapshot", None) and getattr(args, "derive", False):
        # The sub-command's --help is the one that lists both options.
        kvcli.Parser(prog=f"kvreplay {args.command}").error(
            "--from-snapshot needs the recorded decisions; it cannot be combined with --derive"
        )
    trace = getattr(args, "trace", "")
    context = f"while running {args.command}" + (f" on {trace}" if trace else "")
    return kvcli.run("kvreplay", lambda: int(args.func(args)), debug_env="KVREPLAY_DEBUG", context=context)


if __name__ == "__main__":
    sys.exit(main())
