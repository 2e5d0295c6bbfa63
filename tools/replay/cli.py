"""The ``kvreplay`` command line, in the style of git: one subcommand per question.

Errors that kvcached raises on purpose (``KvcachedError``) become one line on stderr and exit
code 2; nothing the user can cause should end in a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvcached.errors import KvcachedError
from kvcached.ledger.scenarios import SCENARIOS


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import render

    sys.stdout.write(render(args.scenario or None))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvreplay",
        description="Replay kvcached ledger traces offline: find, explain and shrink freed-block copies.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo",
        help="replay the seed's built-in freed-block-copy scenarios under legacy and ledger",
        description="Replay the built-in scenarios (the seed's three freed-block-copy cases and P2) "
        "with an eager allocator under both policies and print what each finds.",
    )
    demo.add_argument("scenario", nargs="*", choices=[*SCENARIOS, []], help="scenarios to run (default: all)")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KvcachedError as e:
        print(f"kvreplay: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
