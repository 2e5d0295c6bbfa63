"""kvctl: ask a running engine's ledger service which KV pages are pinned, why, and what it journals.

An operator reaches for this while an engine misbehaves (memory not given back, a shrink that
waits), so it has to answer fast and never add noise: it speaks the live view's protocol over
the service's Unix socket with a plain blocking socket (no event loop to start), prints a rich
table when a person is watching and plain aligned columns when the output goes to a pipe or a
file, and turns every failure (no service, a stale socket, permission denied, a refused request)
into one line on stderr and exit status 2, never a traceback; a malformed argument too (a
timeout of ``-1``, ``nan``, ``inf`` or ``1e300``, a page beyond what the protocol carries), as
argparse does but without the usage block. The socket is ``--socket PATH``,
else ``$KVCACHED_LEDGER_SOCKET``, else the only socket in the default directory.

    kvctl pins [--limit N] [--json]    page, pin kind, job or request, since build, waiting workers
    kvctl status [--json]              pages mapped / pinned / releasable, jobs, journal, gaps
    kvctl why PAGE [--json]            everything that keeps one page
    kvctl tail [--count N]             events as the service journals them
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Final, NoReturn, TextIO

import msgspec

from kvcached.errors import KvcachedError
from kvcached.ledger.events import describe
from kvcached.service import live, messages

_PINS_HEAD = ("page", "pin", "job or request", "since build", "waiting workers")
MAX_TIMEOUT: Final = 86_400.0  # a day: longer is a typo (and 1e300 overflows the socket's timeval)
_MAX_INT: Final = 2**63 - 1  # the largest integer msgpack carries signed: the request's page and limit


def _pin_cells(row: messages.PinRow) -> tuple[str, str, str, str, str]:
    if row.kind == "job":
        who = f"job {row.job} ({row.request})"
        waiting = str(row.waiting_workers)
        kind = f"{row.job_kind} job"
    elif row.kind == "grace":
        who, waiting, kind = "-", "-", f"grace (until build {row.until_build})"
    else:
        who, waiting, kind = str(row.request), "-", "window hold"
    return str(row.page), kind, who, str(row.since_build), waiting


def _plain(out: TextIO, head: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    # One format string for every row: 10,000 pins render in a few ms, not 40.
    fmt = "  ".join(f"{{:{'>' if i in right else '<'}{w}}}" for i, w in enumerate(widths)).format
    lines = [fmt(*(h.upper() for h in head)), *(fmt(*r) for r in rows)]
    if len(head) - 1 not in right:
        lines = [line.rstrip() for line in lines]
    out.write("\n".join(lines) + "\n")


def _rich(out: TextIO, title: str, head: Sequence[str] | None, rows: Sequence[Sequence[str]], right: set[int]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=head is not None, title_justify="left")
    for i, h in enumerate(head or [""] * len(rows[0])):
        table.add_column(h, justify="right" if i in right else "left", no_wrap=i in right)
    for r in rows:
        table.add_row(*r)
    Console(file=out).print(table)


def _fancy(out: TextIO) -> bool:
    if not out.isatty():
        return False
    try:
        import rich  # noqa: F401 - optional: plain text without it
    except ImportError:
        return False
    return True


def cmd_pins(path: str, args: argparse.Namespace, out: TextIO) -> int:
    reply = live.request(path, messages.Request(op="pins", limit=args.limit), timeout=args.timeout)
    assert isinstance(reply, messages.PinsReply)
    if args.json:
        out.write(msgspec.json.encode(reply).decode() + "\n")
        return 0
    title = f"{reply.pinned_pages} pinned page(s), {len(reply.rows)} pin(s) shown; replica at event {reply.index}"
    title += f", build {reply.build}"
    notes = []
    if reply.lossy:
        notes.append("the service dropped events (a gap): pins may be missing or stale")
    if reply.truncated:
        notes.append(f"only the first {len(reply.rows)} pins are shown (--limit)")
    rows = [_pin_cells(r) for r in reply.rows]
    if _fancy(out) and rows:
        _rich(out, title, _PINS_HEAD, rows, {0, 3, 4})
    else:
        out.write(title + "\n")
        if rows:
            _plain(out, _PINS_HEAD, rows, {0, 3, 4})
    for note in notes:
        out.write(f"note: {note}\n")
    return 0


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def cmd_status(path: str, args: argparse.Namespace, out: TextIO) -> int:
    s = live.request(path, messages.Request(op="status"), timeout=args.timeout)
    assert isinstance(s, messages.StatusReply)
    if args.json:
        out.write(msgspec.json.encode(s).decode() + "\n")
        return 0
    rows: list[tuple[str, str]] = [("service", f"pid {s.pid}, up {s.uptime_s:.0f} s, {s.events} events taken")]
    lg = s.ledger
    if lg is None:
        rows.append(("ledger", "no replica (replica=False): page counts and pins are not available"))
    else:
        rows += [
            ("ledger", f"event {lg.index}, build {lg.build}, policy {lg.policy}"),
            ("pages", f"{lg.num_pages} total, {lg.mapped_pages} mapped, {lg.pinned_pages} pinned, "
                      f"{lg.releasable_pages} releasable"),
            ("jobs", f"{lg.outstanding_jobs} outstanding"),
            ("violations", str(lg.violations)),
        ]
        if lg.lossy:
            rows.append(("gaps", f"{lg.dropped_events} event(s) dropped: the view may be off by as much"))
    j = s.journal
    if j.state == "off":
        journal = "off"
    else:
        journal = (
            f"{j.state} {j.path} (segment {j.segment}, {_mib(j.segment_bytes)}), {j.events_written} events written, "
            f"{j.events_durable} durable ({j.durability})"
        )
        if j.snapshot_index is not None:
            journal += f"; snapshot at event {j.snapshot_index}"
        if j.error:
            journal += f"; error: {j.error}"
    h = s.handoff
    rows += [
        ("journal", journal),
        ("hand-off", f"{h.queued} of {h.capacity} queued; {h.dropped} dropped in {h.gaps} gap(s), "
                     f"{h.episodes} overflow episode(s)"),
        ("live view", f"{s.clients} client(s), {s.dropped_clients} slow client(s) dropped"),
    ]
    if _fancy(out):
        _rich(out, "kvcached ledger service", None, list(rows), set())
    else:
        width = max(len(k) for k, _ in rows)
        out.write("".join(f"{k.ljust(width)}  {v}\n" for k, v in rows))
    return 0


def cmd_why(path: str, args: argparse.Namespace, out: TextIO) -> int:
    reply = live.request(path, messages.Request(op="why", page=args.page), timeout=args.timeout)
    assert isinstance(reply, messages.WhyReply)
    out.write((msgspec.json.encode(reply.status).decode() if args.json else reply.status.describe()) + "\n")
    return 0


def cmd_tail(path: str, args: argparse.Namespace, out: TextIO) -> int:
    left = args.count
    for first, events in live.tail(path, timeout=args.timeout):
        if left is not None:
            events = events[:left]
            left -= len(events)
        out.write("".join(f"{first + i:>10}  {describe(ev)}\n" for i, ev in enumerate(events)))
        out.flush()
        if left is not None and left <= 0:
            break
    return 0


COMMANDS = {"pins": cmd_pins, "status": cmd_status, "why": cmd_why, "tail": cmd_tail}


class _Parser(argparse.ArgumentParser):
    """argparse's, but a usage error is one line on stderr and exit status 2, like every other
    kvctl failure (argparse prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see kvctl --help)\n")


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < v <= MAX_TIMEOUT:  # NaN fails both comparisons
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds above 0 and at most {MAX_TIMEOUT:g}")
    return v


def _whole(low: int, what: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= v <= _MAX_INT:
            raise argparse.ArgumentTypeError(f"{text!r}: give {what} from {low} to {_MAX_INT}")
        return v

    return parse


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="kvctl", description="Ask a running engine's kvcached ledger service.")
    ap.add_argument("--socket", metavar="PATH", help=f"the service's socket (default: ${live.SOCKET_ENV})")
    limits = f"default 10, at most {MAX_TIMEOUT:g}"
    ap.add_argument("--timeout", type=_seconds, default=10.0, help=f"seconds to wait for an answer ({limits})")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pins", help="every pin: page, kind, job or request, since build, waiting workers")
    p.add_argument("--limit", type=_whole(0, "a number of pins"), help="show at most N pins")
    p.add_argument("--json", action="store_true")
    s = sub.add_parser("status", help="pages, jobs, journal and hand-off at a glance")
    s.add_argument("--json", action="store_true")
    w = sub.add_parser("why", help="everything that keeps one page")
    w.add_argument("page", type=_whole(0, "a page number"))
    w.add_argument("--json", action="store_true")
    t = sub.add_parser("tail", help="events as the service journals them (Ctrl-C to stop)")
    t.add_argument("--count", type=_whole(1, "a number of events"), help="stop after N events")
    return ap


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    args = parser().parse_args(argv)
    stream = out if out is not None else sys.stdout
    try:
        return COMMANDS[args.command](live.find_socket(args.socket), args, stream)
    except KvcachedError as exc:
        print(f"kvctl: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (kvctl tail | head): not an error; keep Python's exit flush quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
