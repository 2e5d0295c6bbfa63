"""kvctl: ask a running engine's ledger service which KV pages are pinned, why, and what it journals.

An operator reaches for this while an engine misbehaves (memory not given back, a shrink that
waits), so it has to answer fast and never add noise. It speaks the live view's protocol over the
service's Unix socket with a plain blocking socket (no event loop to start), and fails as kvreplay
and kvsim do, in one line. The commands, with their synopsis at ``main``: ``list``, ``status``,
``pins``, ``why``, ``tail``, ``limit``, ``limit-percent``, ``dump``, ``watch``, ``budget``.

Upstream kvcached's ``limit`` and ``limit-percent`` keep their meaning and size syntax; its
commands that have no meaning here (``kvtop``, ``shell``, ``delete``) say so in one line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

import kvcli
import msgspec

from kvcached.budget import NAME, budget_dir, budget_exists, budget_usage, set_budget_size
from kvcached.ledger.events import Event, describe
from kvcached.service import live, messages

from . import engines, parse, render


def cmd_pins(path: str, args: argparse.Namespace, out: TextIO) -> int:
    reply = live.request(path, messages.Request(op="pins", limit=args.limit), timeout=args.timeout)
    assert isinstance(reply, messages.PinsReply)
    if args.json:
        out.write(msgspec.json.encode(reply).decode() + "\n")
        return 0
    title = (
        f"{kvcli.plural(reply.pinned_pages, 'pinned page')}, {kvcli.plural(len(reply.rows), 'pin')} shown; "
        f"replica at event {reply.index:,}, build {reply.build:,}"
    )
    notes = []
    if reply.lossy:
        notes.append("the service dropped events (a gap): pins may be missing or stale")
    if reply.truncated:
        notes.append(f"only the first {kvcli.plural(len(reply.rows), 'pin')} are shown (--limit)")
    rows = [render.pin_cells(r) for r in reply.rows]
    if render.fancy(out) and rows:
        render.rich_print(out, title, render.PINS_HEAD, rows, {0, 3, 4})
    else:
        out.write(title + "\n")
        if rows:
            render.plain(out, render.PINS_HEAD, rows, {0, 3, 4})
    for note in notes:
        out.write(f"note: {note}\n")
    return 0


def cmd_status(path: str, args: argparse.Namespace, out: TextIO) -> int:
    s = live.request(path, messages.Request(op="status"), timeout=args.timeout)
    assert isinstance(s, messages.StatusReply)
    if args.json:
        out.write(msgspec.json.encode(render.status_json(s)).decode() + "\n")
        return 0
    rows = render.status_rows(s)
    if render.fancy(out):
        render.rich_print(out, "kvcached ledger service", None, rows, set())
    else:
        width = max(len(k) for k, _ in rows)
        out.write("".join(f"{k.ljust(width)}  {v}\n" for k, v in rows))
    return 0


def cmd_why(path: str, args: argparse.Namespace, out: TextIO) -> int:
    reply = live.request(path, messages.Request(op="why", page=args.page), timeout=args.timeout)
    assert isinstance(reply, messages.WhyReply)
    out.write((msgspec.json.encode(reply.status).decode() if args.json else reply.status.describe()) + "\n")
    return 0


def _event_json(index: int, ev: Event) -> str:
    fields = {f: getattr(ev, f) for f in ev.__struct_fields__}
    return msgspec.json.encode({"index": index, "type": type(ev).__name__, **fields}).decode()


def cmd_tail(path: str, args: argparse.Namespace, out: TextIO) -> int:
    left = args.count
    for first, events in live.tail(path, timeout=args.timeout):
        if left is not None:
            events = events[:left]
            left -= len(events)
        if args.json:  # one JSON object per line: the event's fields, its type and global index
            out.write("".join(_event_json(first + i, ev) + "\n" for i, ev in enumerate(events)))
        else:
            out.write("".join(f"{first + i:>10}  {describe(ev)}\n" for i, ev in enumerate(events)))
        out.flush()
        if left is not None and left <= 0:
            break
    return 0


def _set_limit(path: str, size: int | None, args: argparse.Namespace, out: TextIO) -> int:
    request = messages.Request(op="limit", size=-1 if size is None else size, force=args.force)
    reply = live.request(path, request, timeout=args.timeout)
    assert isinstance(reply, messages.LimitReply)
    m = reply.memory
    if args.json:
        out.write(msgspec.json.encode(render.memory_json(m)).decode() + "\n")
        return 0
    out.write(render.memory_line(m) + "\n")
    out.write(("shrinking: " + m.reason if m.shrink_pending else "within the limit") + "\n")
    return 0


def cmd_limit(path: str, args: argparse.Namespace, out: TextIO) -> int:
    return _set_limit(path, args.size, args, out)


def cmd_limit_percent(path: str, args: argparse.Namespace, out: TextIO) -> int:
    status = live.request(path, messages.Request(op="status"), timeout=args.timeout)
    assert isinstance(status, messages.StatusReply)
    if status.memory is None:
        raise live.LiveViewError(f"{path}: this service reports no engine memory to take a percentage of")
    size = status.memory.capacity_bytes * args.percent // 100
    return _set_limit(path, None if args.percent >= 100 else size, args, out)


def cmd_dump(path: str, args: argparse.Namespace, out: TextIO) -> int:
    reply = live.request(path, messages.Request(op="dump"), timeout=args.timeout)
    assert isinstance(reply, messages.DumpReply)
    from kvcached.service.flight import write_dump

    try:
        written = write_dump(reply, args.output, replace=True)
    except OSError as exc:
        raise live.LiveViewError(f"{args.output}: cannot write the dump: {exc.strerror or exc}") from None
    if args.json:
        doc = {"files": written, "first_event": reply.first_event, "events": reply.events}
        out.write(msgspec.json.encode(doc).decode() + "\n")
        return 0
    out.write(
        f"{kvcli.plural(reply.events, 'event')} (from event {reply.first_event:,}) written to "
        f"{', '.join(written)}\nreplay with: kvreplay check {args.output}\n"
    )
    return 0


def cmd_budget(args: argparse.Namespace, out: TextIO) -> int:
    if args.size is None:
        if not budget_exists(args.name):
            raise live.LiveViewError(
                f"no budget named {args.name!r} in {budget_dir()}: engines started with KVCACHED_BUDGET={args.name} "
                f"make it, and so does kvctl budget {args.name} SIZE"
            )
        u = budget_usage(args.name)
    else:
        u = set_budget_size(args.name, args.size_bytes)
    if args.json:
        d = msgspec.to_builtins(u)
        d["headroom"] = u.headroom
        out.write(msgspec.json.encode(d).decode() + "\n")
    else:
        out.write(render.budget_line(u) + "\n")
    return 0


COMMANDS = {
    "pins": cmd_pins,
    "status": cmd_status,
    "why": cmd_why,
    "tail": cmd_tail,
    "limit": cmd_limit,
    "limit-percent": cmd_limit_percent,
    "dump": cmd_dump,
}


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run one kvctl command line and return its exit status.

        kvctl list [--all] [--prune] [--json]   this user's kvcached engines: model, pid, port, memory, socket
        kvctl status [--json]                   pages, memory, limit and floor (and what a shrink waits on), journal
        kvctl pins [--limit N] [--json]         page, pin kind, job or request, since build, waiting workers
        kvctl why PAGE [--json]                 everything that keeps one page
        kvctl tail [--count N] [--json]         events as the service journals them
        kvctl limit [ENGINE] SIZE [--force]     the engine's KV memory limit (512M, 2G, none), honouring pins
        kvctl limit-percent [ENGINE] PCT [--force]  the same, as a percentage of the KV capacity
        kvctl dump [ENGINE] -o FILE             the flight recorder's events as a replayable trace
        kvctl watch [-n SEC]                    kvctl list, redrawn every SEC seconds
        kvctl budget NAME [SIZE]                a memory budget shared by engines: its use, or set its size

    NOTE: it fails as kvreplay and kvsim do (``kvcli``): one line on stderr, never a traceback.
    Exit 1 when the engine cannot be reached or refuses (no service, only dead sockets, permission
    denied, a limit below the floor); exit 2 for a malformed command line (``parse``).

    NOTE: a table prints with rich when a person is watching, and as plain aligned columns when
    the output goes to a pipe or a file (``render``)."""
    ap = parse.parser()
    args = ap.parse_args(argv)
    stream = out if out is not None else sys.stdout
    if args.command in parse.NOT_HERE:
        print(f"kvctl: {parse.NOT_HERE[args.command]}", file=sys.stderr)
        return kvcli.USAGE
    if args.command in ("limit", "limit-percent"):
        parse.split_target(args)
    if args.command == "dump" and args.engine_arg:
        args.engine = args.engine_arg
    if args.command == "budget":
        if not NAME.fullmatch(args.name):
            parse.sub_command_usage("budget").error(
                f"budget: {args.name!r} is not a budget name (letters, digits, '.', '_', '-'; at most 64)"
            )
        if args.size is not None:
            try:
                args.size_bytes = parse.size(args.size)
            except argparse.ArgumentTypeError as exc:
                parse.sub_command_usage("budget").error(f"budget: {exc}")

    def body() -> int:
        if args.command == "list":
            return engines.cmd_list(args, stream)
        if args.command == "watch":
            return engines.cmd_watch(args, stream)
        if args.command == "budget":
            return cmd_budget(args, stream)
        # The engine is ``--socket PATH``, else ``-e ENGINE`` (a pid, a socket path or part of a model
        # name, as ``kvctl list`` shows them), else ``$KVCACHED_LEDGER_SOCKET``, else the only engine
        # of this user on this machine that answers (``engines``).
        path = args.socket or (engines.resolve(args.engine) if args.engine else None)
        return COMMANDS[args.command](engines.pick(path, args.timeout), args, stream)

    return kvcli.run("kvctl", body, debug_env="KVCTL_DEBUG", context=f"while running {args.command}")


if __name__ == "__main__":
    sys.exit(main())
