"""kvctl: ask a running engine's ledger service which KV pages are pinned, why, and what it journals.

An operator reaches for this while an engine misbehaves (memory not given back, a shrink that
waits), so it has to answer fast and never add noise: it speaks the live view's protocol over
the service's Unix socket with a plain blocking socket (no event loop to start), prints a rich
table when a person is watching and plain aligned columns when the output goes to a pipe or a
file, and turns every failure (no service, a stale socket, permission denied, a refused request)
into one line on stderr and exit status 2, never a traceback; a malformed argument too (a
timeout of ``-1``, ``nan``, ``inf`` or ``1e300``, a page beyond what the protocol carries), as
argparse does but without the usage block. The engine is ``--socket PATH``, else ``-e ENGINE``
(a pid, a socket path or part of a model name, as ``kvctl list`` shows them), else
``$KVCACHED_LEDGER_SOCKET``, else the only engine of this user on this machine.

    kvctl list [--all] [--json]           this user's kvcached engines: model, pid, port, memory, socket
    kvctl status [--json]                 pages, memory and limit (and what a shrink waits on), jobs, journal
    kvctl pins [--limit N] [--json]       page, pin kind, job or request, since build, waiting workers
    kvctl why PAGE [--json]               everything that keeps one page
    kvctl tail [--count N]                events as the service journals them
    kvctl limit [ENGINE] SIZE             the engine's KV memory limit (512M, 2G, none), honouring pins
    kvctl limit-percent [ENGINE] PCT      the same, as a percentage of the engine's KV capacity
    kvctl dump [ENGINE] -o FILE           the flight recorder's events as a replayable trace
    kvctl watch [-n SEC]                  kvctl list, again every SEC seconds
    kvctl budget NAME [SIZE]              a memory budget shared by engines: its use, or set its size

Upstream kvcached's ``limit`` and ``limit-percent`` keep their meaning and size syntax; its
commands that have no meaning here (``kvtop``, ``shell``, ``delete``) say so in one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Final, NoReturn, TextIO

import msgspec

from kvcached.budget import NAME, BudgetUsage, budget_usage, set_budget_size
from kvcached.errors import KvcachedError
from kvcached.ledger.events import Event, describe
from kvcached.service import live, messages
from kvcached.settings import format_size, parse_size
from kvcached.version import KVCACHED_VERSION

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
        out.write(_status_json(s) + "\n")
        return 0
    rows: list[tuple[str, str]] = [("service", f"pid {s.pid}, up {s.uptime_s:.0f} s, {s.events} events taken")]
    rows += _status_rows(s)
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
        if j.max_bytes:
            journal += f"; {_mib(j.kept_bytes)} kept of a {_mib(j.max_bytes)} bound"
        if j.pruned_segments:
            journal += f" ({j.pruned_segments} older segment(s), {_mib(j.pruned_bytes)}, deleted: from segment "
            journal += f"{j.first_segment} on)"
        if j.error:
            journal += f"; error: {j.error}"
    h = s.handoff
    rows += [
        ("journal", journal),
        ("hand-off", f"{h.queued} of {h.capacity} queued; {h.dropped} dropped in {h.gaps} gap(s), "
                     f"{h.episodes} overflow episode(s)"),
        ("live view", f"{s.clients} client(s), {s.dropped_clients} slow client(s) dropped, "
                      f"{s.evicted_clients} idle one(s) let go"),
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


def _memory_line(m: messages.MemoryStatus) -> str:
    limit = "none" if m.limit_pages >= m.num_pages else format_size(m.limit_bytes)
    return (
        f"{format_size(m.mapped_bytes)} mapped of {format_size(m.capacity_bytes)} ({m.mapped_pages} pages of "
        f"{format_size(m.page_bytes)}: {m.in_use_pages} in use, {m.reserved_pages} reserved); limit {limit}"
    )


def _memory_json(m: messages.MemoryStatus) -> dict[str, object]:
    d: dict[str, object] = msgspec.to_builtins(m)
    d.update(mapped_bytes=m.mapped_bytes, limit_bytes=m.limit_bytes, capacity_bytes=m.capacity_bytes)
    return d


def _status_rows(s: messages.StatusReply) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    e = s.engine
    if e is not None:
        port = f", port {e.port}" if e.port is not None else ""
        rows.append(("engine", f"{e.model}, pid {e.pid}{port}, vLLM {e.vllm}, kvcached {e.kvcached}"))
    m = s.memory
    if m is not None:
        rows.append(("memory", _memory_line(m)))
        rows.append(("shrink", m.reason if m.shrink_pending else "none pending"))
    if s.pinned_by_kind:
        rows.append(("pinned by", ", ".join(f"{k} {n}" for k, n in sorted(s.pinned_by_kind.items()))))
    if s.violations_by_invariant:
        rows.append(("violated", ", ".join(f"{k} x{n}" for k, n in sorted(s.violations_by_invariant.items()))))
    f = s.flight
    if f is not None:
        dumps = f"; saved: {', '.join(f.dumps)}" if f.dumps else ""
        rows.append(("flight rec.", f"events {f.first_event}..{f.first_event + f.events} kept{dumps}"))
    return rows


def _status_json(s: messages.StatusReply) -> str:
    d = msgspec.to_builtins(s)
    if s.memory is not None:
        d["memory"] = _memory_json(s.memory)
    return msgspec.json.encode(d).decode()


# --- the engines of this user: list, watch ---------------------------------------------------------


class Found(msgspec.Struct, frozen=True, kw_only=True):
    socket: str
    alive: bool
    status: messages.StatusReply | None = None
    problem: str | None = None


def discover(timeout: float = 2.0, folder: str | None = None) -> list[Found]:
    """Every socket in the live view's directory, asked for its status: a socket whose engine is
    gone (SIGKILL leaves it behind) answers nothing and is reported as not alive."""
    found = []
    for path in live.known_sockets(folder):
        try:
            reply = live.request(path, messages.Request(op="status"), timeout=timeout)
        except live.LiveViewError as exc:
            found.append(Found(socket=path, alive=False, problem=str(exc)))
            continue
        assert isinstance(reply, messages.StatusReply)
        found.append(Found(socket=path, alive=True, status=reply))
    return found


def _list_cells(f: Found) -> tuple[str, ...]:
    s = f.status
    if s is None:
        return ("-", "-", "-", "-", "-", "-", "dead", f.socket)
    e, m = s.engine, s.memory
    model = e.model if e is not None else "?"
    port = str(e.port) if e is not None and e.port is not None else "-"
    mem = "-" if m is None else format_size(m.mapped_bytes)
    limit = "-" if m is None else ("none" if m.limit_pages >= m.num_pages else format_size(m.limit_bytes))
    state = "shrinking" if m is not None and m.shrink_pending else "serving"
    if s.violations_by_invariant:
        state += " (violations: " + ",".join(sorted(s.violations_by_invariant)) + ")"
    budget = (e.budget if e is not None else None) or "-"
    return (model, str(s.pid), port, mem, limit, budget, state, f.socket)


_LIST_HEAD = ("model", "pid", "port", "mapped", "limit", "budget", "state", "socket")


def cmd_list(args: argparse.Namespace, out: TextIO) -> int:
    found = [f for f in discover(min(args.timeout, 2.0)) if f.alive or args.all]
    if args.json:
        rows = []
        for f in found:
            d: dict[str, object] = {"socket": f.socket, "alive": f.alive}
            if f.status is not None:
                d["status"] = msgspec.json.decode(_status_json(f.status))
            if f.problem is not None:
                d["problem"] = f.problem
            rows.append(d)
        out.write(msgspec.json.encode(rows).decode() + "\n")
        return 0
    if not found:
        out.write(f"no kvcached engine of this user answers in {live.default_socket_dir()}\n")
        return 0
    cells = [_list_cells(f) for f in found]
    if _fancy(out):
        _rich(out, "kvcached engines", _LIST_HEAD, cells, {1, 2, 3, 4})
    else:
        _plain(out, _LIST_HEAD, cells, {1, 2, 3, 4})
    names = sorted({f.status.engine.budget for f in found if f.status and f.status.engine and f.status.engine.budget})
    for name in names:
        out.write(_budget_line(budget_usage(name)) + "\n")
    return 0


def _budget_line(u: BudgetUsage) -> str:
    size = "no size set" if u.size is None else format_size(u.size)
    engines = ", ".join(f"pid {e.pid} {format_size(e.bytes)}{'' if e.alive else ' (dead)'}" for e in u.engines)
    return f"budget {u.name}: {format_size(u.used)} used of {size}" + (f" ({engines})" if engines else "")


def cmd_budget(args: argparse.Namespace, out: TextIO) -> int:
    if not NAME.fullmatch(args.name):
        raise live.LiveViewError(f"{args.name!r} is not a budget name (letters, digits, '.', '_', '-'; at most 64)")
    if args.size is None:
        u = budget_usage(args.name)
    else:
        try:
            size = _size(args.size)
        except argparse.ArgumentTypeError as exc:
            raise live.LiveViewError(f"budget: {exc}") from None
        u = set_budget_size(args.name, size)
    if args.json:
        d = msgspec.to_builtins(u)
        d["headroom"] = u.headroom
        out.write(msgspec.json.encode(d).decode() + "\n")
    else:
        out.write(_budget_line(u) + "\n")
    return 0


def cmd_watch(args: argparse.Namespace, out: TextIO) -> int:
    while True:
        out.write(time.strftime("%H:%M:%S") + "\n")
        cmd_list(args, out)
        out.flush()
        time.sleep(args.interval)


def resolve(engine: str) -> str:
    """The socket of ``engine``: a socket path, a pid, or part of a model name (one match)."""
    if os.sep in engine or engine.endswith(".sock"):
        return engine
    alive = [f for f in discover() if f.alive and f.status is not None]
    if engine.isdigit():
        hits = [f for f in alive if f.status is not None and f.status.pid == int(engine)]
    else:
        hits = [f for f in alive if f.status and f.status.engine and engine in f.status.engine.model]
    if len(hits) == 1:
        return hits[0].socket
    if not hits:
        raise live.LiveViewError(f"no running kvcached engine matches {engine!r} (see kvctl list)")
    pids = ", ".join(str(f.status.pid) for f in hits if f.status is not None)
    raise live.LiveViewError(f"{len(hits)} engines match {engine!r} (pids {pids}); name one by pid")


# --- steering: limit, dump --------------------------------------------------------------------------


def _set_limit(path: str, size: int | None, args: argparse.Namespace, out: TextIO) -> int:
    reply = live.request(path, messages.Request(op="limit", size=-1 if size is None else size), timeout=args.timeout)
    assert isinstance(reply, messages.LimitReply)
    m = reply.memory
    if args.json:
        out.write(msgspec.json.encode(_memory_json(m)).decode() + "\n")
        return 0
    out.write(_memory_line(m) + "\n")
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
        out.write(msgspec.json.encode({"files": written, "first_event": reply.first_event, "events": reply.events})
                  .decode() + "\n")
        return 0
    out.write(f"{reply.events} events (from event {reply.first_event}) written to {', '.join(written)}\n")
    out.write(f"replay with: kvreplay check {args.output}\n")
    return 0


_NOT_HERE = {
    "kvtop": "kvtop is upstream kvcached's GPU memory monitor; here use kvctl watch, or /metrics",
    "shell": "kvctl has no interactive shell here; run one command per call",
    "delete": "there are no IPC segments to delete here: an engine's memory goes with its process",
}

COMMANDS = {"pins": cmd_pins, "status": cmd_status, "why": cmd_why, "tail": cmd_tail, "limit": cmd_limit,
            "limit-percent": cmd_limit_percent, "dump": cmd_dump}


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


def _size(text: str) -> int | None:
    if text.strip().lower() in ("none", "max", "off", "unlimited"):
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def _percent(text: str) -> int:
    v = _whole(0, "a percentage")(text)
    if v > 100:
        raise argparse.ArgumentTypeError(f"{text!r}: give a percentage from 0 to 100")
    return v


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="kvctl", description="Watch and steer the kvcached engines of this user on this machine.")
    ap.add_argument("--version", action="version", version=f"kvctl (kvcached {KVCACHED_VERSION})")
    ap.add_argument("--socket", metavar="PATH", help=f"the engine's socket (default: ${live.SOCKET_ENV})")
    ap.add_argument("-e", "--engine", metavar="ENGINE", help="the engine: a pid, a socket or part of a model name")
    limits = f"default 10, at most {MAX_TIMEOUT:g}"
    ap.add_argument("--timeout", type=_seconds, default=10.0, help=f"seconds to wait for an answer ({limits})")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    ls = sub.add_parser("list", help="this user's kvcached engines on this machine", description=(
        "Every kvcached engine of this user on this machine (its model, pid, HTTP port, memory and socket). "
        "A socket left by an engine that was killed is not listed; --all shows it as dead."))
    ls.add_argument("--all", action="store_true", help="also the sockets nobody answers on")
    ls.add_argument("--json", action="store_true", help="one JSON array, each engine's full status")
    s = sub.add_parser("status", help="memory, limit, pins, jobs, journal and flight recorder at a glance",
                       description="One engine at a glance; a pending shrink says what it waits on.")
    s.add_argument("--json", action="store_true", help="the full reply as JSON")
    p = sub.add_parser("pins", help="every pin: page, kind, job or request, since build, waiting workers",
                       description="Every pin the engine's ledger holds, by page.")
    p.add_argument("--limit", type=_whole(0, "a number of pins"), help="show at most N pins")
    p.add_argument("--json", action="store_true", help="the reply as JSON")
    w = sub.add_parser("why", help="everything that keeps one page", description="Why a page is mapped, or not.")
    w.add_argument("page", type=_whole(0, "a page number"), help="the page number (kvctl pins shows them)")
    w.add_argument("--json", action="store_true", help="the reply as JSON")
    t = sub.add_parser("tail", help="events as the service journals them (Ctrl-C to stop)",
                       description="Ledger events as they happen, one per line.")
    t.add_argument("--count", type=_whole(1, "a number of events"), help="stop after N events")
    t.add_argument("--json", action="store_true", help="one JSON object per event and line")
    lim = sub.add_parser("limit", help="set an engine's KV memory limit (512M, 2G, none)", description=(
        "Set the engine's KV memory limit, in bytes with an optional unit (512M, 2G, 1.5GiB) or 'none'. A lower "
        "limit shrinks now as far as pins allow (a page a copy may still read stays until it is released); "
        "kvctl status says what the rest waits on."))
    lim.add_argument("target", nargs="+", metavar="[ENGINE] SIZE", help="the engine (optional) and the size")
    lim.add_argument("--json", action="store_true", help="the engine's memory after the change, as JSON")
    pct = sub.add_parser("limit-percent", help="set the limit as a percentage of the engine's KV capacity",
                         description="As limit, as a percentage (0-100) of the KV memory vLLM sized this engine for.")
    pct.add_argument("target", nargs="+", metavar="[ENGINE] PCT", help="the engine (optional) and the percentage")
    pct.add_argument("--json", action="store_true", help="the engine's memory after the change, as JSON")
    d = sub.add_parser("dump", help="save the flight recorder as a replayable trace", description=(
        "Write the engine's flight recorder (its latest events and the ledger state before them) to FILE "
        "(and FILE.snap when it starts mid-run); replay it with kvreplay check FILE."))
    d.add_argument("engine_arg", nargs="?", metavar="ENGINE", help="the engine (optional)")
    d.add_argument("-o", "--output", required=True, metavar="FILE", help="the trace to write (replaced if a file)")
    d.add_argument("--json", action="store_true", help="the files written, as JSON")
    wa = sub.add_parser("watch", help="kvctl list, again every few seconds", description="kvctl list, repeated.")
    wa.add_argument("-n", "--interval", type=_seconds, default=2.0, help="seconds between updates (default 2)")
    wa.add_argument("--all", action="store_true", help="also the sockets nobody answers on")
    wa.add_argument("--json", action="store_true", help="one JSON array per update")
    b = sub.add_parser("budget", help="a memory budget shared by engines: show it, or set its size", description=(
        "Engines started with the same KVCACHED_BUDGET map pages only within it. Without SIZE: what it holds, "
        "per engine. With SIZE (512M, 8G, none): set it; lowering it takes nothing away, engines map no more "
        "until enough is given back."))
    b.add_argument("name", metavar="NAME", help="the budget's name (KVCACHED_BUDGET)")
    b.add_argument("size", nargs="?", metavar="SIZE", help="its new size, or none")
    b.add_argument("--json", action="store_true", help="the budget as JSON")
    for name, why in _NOT_HERE.items():
        sub.add_parser(name, help=f"upstream kvcached's; not here ({why.split(';')[0]})", description=why)
    return ap


def _split_target(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """``limit [ENGINE] SIZE``: one or two words; the last is the size (or percentage)."""
    words = args.target
    if len(words) > 2:
        ap.error(f"{args.command}: give [ENGINE] and one value, not {len(words)} words")
    value = words[-1]
    if len(words) == 2:
        args.engine = words[0]
    try:
        if args.command == "limit":
            args.size = _size(value)
        else:
            args.percent = _percent(value)
    except argparse.ArgumentTypeError as exc:
        ap.error(f"{args.command}: {exc}")


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    stream = out if out is not None else sys.stdout
    if args.command in _NOT_HERE:
        print(f"kvctl: {_NOT_HERE[args.command]}", file=sys.stderr)
        return 2
    if args.command in ("limit", "limit-percent"):
        _split_target(args, ap)
    if args.command == "dump" and args.engine_arg:
        args.engine = args.engine_arg
    try:
        if args.command == "list":
            return cmd_list(args, stream)
        if args.command == "watch":
            return cmd_watch(args, stream)
        if args.command == "budget":
            return cmd_budget(args, stream)
        path = args.socket or (resolve(args.engine) if args.engine else None)
        return COMMANDS[args.command](live.find_socket(path), args, stream)
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
