"""kvctl's command line: its subcommands, and argument types that refuse nonsense in one line.

Each value an operator types is checked where argparse reads it, so that a typo is a usage
error (one line, exit 2: ``kvcli.Parser``) and never reaches a socket: a timeout of ``-1``,
``nan``, ``inf`` or ``1e300`` (which overflowed the socket's timeval), a page or limit beyond
what msgpack carries, a size without a number. ``limit [ENGINE] SIZE`` keeps upstream kvcached's
syntax (``512M``, ``2G``, ``none``), with ``--force`` to go below the engine's floor.
"""

from __future__ import annotations

import argparse
from typing import Final

import kvcli

from kvcached.service import live
from kvcached.settings import parse_limit

MAX_TIMEOUT: Final = 86_400.0  # a day: longer is a typo (and 1e300 overflows the socket's timeval)

NOT_HERE: Final = {
    "kvtop": "kvtop is upstream kvcached's GPU memory monitor; here use kvctl watch, or /metrics",
    "shell": "kvctl has no interactive shell here; run one command per call",
    "delete": "there are no IPC segments to delete here: an engine's memory goes with its process",
}


def size(text: str) -> int | None:
    try:
        return parse_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def percent(text: str) -> int:
    return kvcli.whole(0, "a percentage", 100)(text)


def parser() -> argparse.ArgumentParser:
    ap = kvcli.Parser(
        prog="kvctl",
        description="Watch and steer the kvcached engines of this user on this machine. "
        "Exit codes: 0 done, 1 the engine could not be reached or refused, 2 a usage error.",
    )
    ap.add_argument("--version", action="version", version=kvcli.version("kvctl"))
    ap.add_argument("--socket", metavar="PATH", help=f"the engine's socket (default: ${live.SOCKET_ENV})")
    ap.add_argument("-e", "--engine", metavar="ENGINE", help="the engine: a pid, a socket or part of a model name")
    limits = f"default 10, at most {MAX_TIMEOUT:g}"
    ap.add_argument(
        "--timeout",
        type=kvcli.positive_seconds(MAX_TIMEOUT),
        default=10.0,
        help=f"seconds to wait for an answer ({limits})",
    )
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = sub.add_parser(
        "list",
        help="this user's kvcached engines on this machine",
        description=(
            "Every kvcached engine of this user on this machine (its model, pid, HTTP port, memory and socket). "
            "A socket left by an engine that was killed is not listed; --all shows it as dead, --prune removes it."
        ),
    )
    ls.add_argument("--all", action="store_true", help="also the sockets nobody answers on")
    ls.add_argument("--prune", action="store_true", help="first remove the sockets whose engine is gone")
    ls.add_argument("--json", action="store_true", help="one JSON array, each engine's full status")
    s = sub.add_parser(
        "status",
        help="memory, limit, pins, jobs, journal and flight recorder at a glance",
        description="One engine at a glance; a pending shrink says what it waits on.",
    )
    s.add_argument("--json", action="store_true", help="the full reply as JSON")
    p = sub.add_parser(
        "pins",
        help="every pin: page, kind, job or request, since build, waiting workers",
        description="Every pin the engine's ledger holds, by page.",
    )
    p.add_argument("--limit", type=kvcli.whole(0, "a number of pins"), help="show at most N pins")
    p.add_argument("--json", action="store_true", help="the reply as JSON")
    w = sub.add_parser("why", help="everything that keeps one page", description="Why a page is mapped, or not.")
    w.add_argument("page", type=kvcli.whole(0, "a page number"), help="the page number (kvctl pins shows them)")
    w.add_argument("--json", action="store_true", help="the reply as JSON")
    t = sub.add_parser(
        "tail",
        help="events as the service journals them (Ctrl-C to stop)",
        description="Ledger events as they happen, one per line.",
    )
    t.add_argument("--count", type=kvcli.whole(1, "a number of events"), help="stop after N events")
    t.add_argument("--json", action="store_true", help="one JSON object per event and line")
    force = "go below the engine's floor (what one request of max_model_len needs): it may then admit no request"
    lim = sub.add_parser(
        "limit",
        help="set an engine's KV memory limit (512M, 2G, none)",
        description=(
            "Set the engine's KV memory limit, in bytes with an optional unit (512M, 2G, 1.5GiB) or 'none'. A lower "
            "limit shrinks now as far as pins allow (a page a copy may still read stays until it is released); "
            "kvctl status says what the rest waits on. A limit below the engine's floor is refused without --force."
        ),
    )
    lim.add_argument("target", nargs="+", metavar="[ENGINE] SIZE", help="the engine (optional) and the size")
    lim.add_argument("--force", action="store_true", help=force)
    lim.add_argument("--json", action="store_true", help="the engine's memory after the change, as JSON")
    pct = sub.add_parser(
        "limit-percent",
        help="set the limit as a percentage of the engine's KV capacity",
        description="As limit, as a percentage (0-100) of the KV memory vLLM sized this engine for.",
    )
    pct.add_argument("target", nargs="+", metavar="[ENGINE] PCT", help="the engine (optional) and the percentage")
    pct.add_argument("--force", action="store_true", help=force)
    pct.add_argument("--json", action="store_true", help="the engine's memory after the change, as JSON")
    d = sub.add_parser(
        "dump",
        help="save the flight recorder as a replayable trace",
        description=(
            "Write the engine's flight recorder (its latest events and the ledger state before them) to FILE "
            "(and FILE.snap when it starts mid-run); replay it with kvreplay check FILE."
        ),
    )
    d.add_argument("engine_arg", nargs="?", metavar="ENGINE", help="the engine (optional)")
    d.add_argument("-o", "--output", required=True, metavar="FILE", help="the trace to write (replaced if a file)")
    d.add_argument("--json", action="store_true", help="the files written, as JSON")
    wa = sub.add_parser(
        "watch",
        help="kvctl list, redrawn every few seconds",
        description=(
            "kvctl list, redrawn in place every SEC seconds on a terminal; one listing after another otherwise."
        ),
    )
    wa.add_argument(
        "-n",
        "--interval",
        type=kvcli.positive_seconds(MAX_TIMEOUT),
        default=2.0,
        help="seconds between updates (default 2)",
    )
    wa.add_argument("--all", action="store_true", help="also the sockets nobody answers on")
    wa.add_argument("--json", action="store_true", help="one JSON array per update and line")
    b = sub.add_parser(
        "budget",
        help="a memory budget shared by engines: show it, or set its size",
        description=(
            "Engines started with the same KVCACHED_BUDGET map pages only within it. Without SIZE: what it holds, "
            "per engine (a name no engine or kvctl made is an error). With SIZE (512M, 8G, none): set it, making it "
            "if new; lowering it takes nothing away, engines map no more until enough is given back."
        ),
    )
    b.add_argument("name", metavar="NAME", help="the budget's name (KVCACHED_BUDGET)")
    b.add_argument("size", nargs="?", metavar="SIZE", help="its new size, or none")  # parsed by main: none != absent
    b.add_argument("--json", action="store_true", help="the budget as JSON")
    for name, why in NOT_HERE.items():
        sub.add_parser(name, help=f"upstream kvcached's; not here ({why.split(';')[0]})", description=why)
    return ap


def split_target(args: argparse.Namespace) -> None:
    """``limit [ENGINE] SIZE``: one or two words; the last is the size (or percentage)."""
    words = args.target
    if len(words) > 2:
        sub_command_usage(args.command).error(f"{args.command}: give [ENGINE] and one value, not {len(words)} words")
    value = words[-1]
    if len(words) == 2:
        args.engine = words[0]
    try:
        if args.command == "limit":
            args.size = size(value)
        else:
            args.percent = percent(value)
    except argparse.ArgumentTypeError as exc:
        sub_command_usage(args.command).error(f"{args.command}: {exc}")


def sub_command_usage(command: str) -> argparse.ArgumentParser:
    """A parser whose usage error names ``kvctl COMMAND --help``, the help that explains the value."""
    return kvcli.Parser(prog=f"kvctl {command}")
