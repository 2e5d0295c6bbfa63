"""The ``kvreplay`` command line, in the style of git: one subcommand per question.

Each subcommand lives in its own module and adds its own parser; this module only wires them
and owns the promise made to users: whatever the input, the answer is a result or one line on
stderr, never a traceback. Errors kvcached raises on purpose (``KvcachedError``: an unreadable
journal, a bad snapshot) become that line and exit code 2; so does an ``OSError`` on an output
file; anything else is a bug in kvreplay or the ledger and becomes one line that says so, with
``KVREPLAY_DEBUG=1`` to get the traceback. Exit codes: 0 clean or done, 1 a violation found
(``check``), 2 the input could not be used.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from kvcached.errors import KvcachedError
from kvcached.ledger.events import Policy
from kvcached.testing.seed_cases import SCENARIOS

from . import check, compare, make, minimize, plot, show, snapshot, stats


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.save:
        print("\n".join(make.save_scenarios(args.save, args.scenario)))
        return 0
    from .demo import render

    sys.stdout.write(render(args.scenario or None))
    return 0


def _replay_options() -> argparse.ArgumentParser:
    """Options shared by the subcommands that replay one trace under one policy."""
    common = argparse.ArgumentParser(add_help=False)
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
    parser = argparse.ArgumentParser(
        prog="kvreplay",
        description="Replay kvcached ledger traces offline: find, explain and shrink freed-block copies. "
        "Exit codes: 0 clean, 1 violation found (check), 2 unusable input.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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
    demo.add_argument("scenario", nargs="*", choices=[*SCENARIOS, []], help="scenarios to run (default: all)")
    demo.add_argument(
        "--save",
        metavar="DIR",
        help="instead, write each scenario as a trace under both policies (DIR/NAME-POLICY.kvj) to try kvreplay on",
    )
    demo.set_defaults(func=_cmd_demo)
    make.add_parser(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "from_snapshot", None) and getattr(args, "derive", False):
        print(
            "kvreplay: --from-snapshot needs the recorded decisions; it cannot be combined with --derive",
            file=sys.stderr,
        )
        return 2
    try:
        code: int = args.func(args)
    except KvcachedError as e:
        print(f"kvreplay: {_one_line(e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        print(f"kvreplay: {e.filename or ''}{': ' if e.filename else ''}{e.strerror or _one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:
        if os.environ.get("KVREPLAY_DEBUG") == "1":
            raise
        trace = getattr(args, "trace", "")
        print(
            f"kvreplay: internal error while running {args.command} on {trace}: {type(e).__name__}: {_one_line(e)} "
            "(a bug: please report it with the trace; KVREPLAY_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
