"""Which kvcached engines this user runs here: found by their sockets, listed, watched, pruned.

Every engine's ledger service listens on a Unix socket in one directory
(``$XDG_RUNTIME_DIR/kvcached``); an engine killed with SIGKILL leaves its socket behind, and those
pile up on a machine that restarts servers all day. So a socket counts as an engine only if it
answers (``discover``, ``pick``), and ``kvctl list --prune`` removes only what is certainly dead
(``prune``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import time
from typing import TextIO

import msgspec
from kvcli import format_size, plural

from kvcached.budget import budget_usage
from kvcached.service import live, messages

from . import render


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


def prune(folder: str | None = None) -> list[str]:
    """Removes the dead sockets of the live view's directory (``live.is_dead_socket``: this
    user's sockets, bound a while ago, whose connect is refused); returns those removed.

    NOTE: pruning removes only what is certainly dead: a socket (``lstat``, never following a
    link) owned by this user in that directory, bound more than two seconds ago (an engine binds
    a moment before it listens), whose connect is refused. Anything else there, a live socket, or
    one that merely timed out, stays. The service prunes the same way when it starts
    (``live.prune_dead_sockets``), so ``--prune`` is for what is left between starts."""
    return live.prune_dead_sockets(folder or live.default_socket_dir())


def pick(path: str | None, timeout: float) -> str:
    """The socket a per-engine command talks to: ``path``, ``$KVCACHED_LEDGER_SOCKET``, else the
    one engine of this user that answers.

    NOTE: ``kvctl status`` on a machine with one live engine and three dead sockets talks to the
    live one. With none it says that no engine runs (and how many dead sockets ``kvctl list
    --prune`` would remove) instead of "connection refused"."""
    if path or os.environ.get(live.SOCKET_ENV):
        return live.find_socket(path)
    folder = live.default_socket_dir()
    found = discover(min(timeout, 2.0), folder)
    alive = [f for f in found if f.alive]
    if len(alive) == 1:
        return alive[0].socket
    if alive:
        pids = ", ".join(str(f.status.pid) for f in alive if f.status is not None)
        raise live.LiveViewError(f"{len(alive)} kvcached engines are running (pids {pids}); name one with -e PID")
    dead = f" ({plural(len(found), 'dead socket')} in {folder}; kvctl list --prune removes them)" if found else ""
    raise live.LiveViewError(f"no kvcached engine is running{dead or f' (nothing in {folder})'}")


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
        models = [f.status.engine.model for f in alive if f.status is not None and f.status.engine is not None]
        guess = _guess(engine, models)
        raise live.LiveViewError(f"no running kvcached engine matches {engine!r} (see kvctl list){guess}")
    pids = ", ".join(str(f.status.pid) for f in hits if f.status is not None)
    raise live.LiveViewError(f"{len(hits)} engines match {engine!r} (pids {pids}); name one by pid")


def _guess(engine: str, models: list[str]) -> str:
    """``; did you mean M?`` for the models ``engine`` is a misspelling of, as the settings say it
    of a misspelt variable. ``engine`` need only be part of a model name, so each model is compared
    whole and word by word (``lamma`` is close to the ``llama`` of ``tiny-llama``)."""
    close: list[str] = []
    for model in sorted(set(models)):
        words = [model, *re.split(r"[/_.:\s-]+", model)]
        if any(difflib.get_close_matches(engine.lower(), [w.lower() for w in words if w], n=1, cutoff=0.75)):
            close.append(model)
    return f"; did you mean {' or '.join(close[:3])}?" if close else ""


def _cells(f: Found) -> tuple[str, ...]:
    s = f.status
    if s is None:
        return ("-", "-", "-", "-", "-", "-", "dead", f.socket)
    e, m = s.engine, s.memory
    model = e.model if e is not None else "?"
    if e is not None and e.data_parallel > 1:  # one server's ranks share its model and port
        model += f" [dp {e.index}/{e.data_parallel}]"
    port = str(e.port) if e is not None and e.port is not None else "-"
    mem = "-" if m is None else format_size(m.mapped_bytes)
    limit = "-" if m is None else render.limit_text(m)
    state = "shrinking" if m is not None and m.shrink_pending else "serving"
    if s.violations_by_invariant:
        state += " (violations: " + ",".join(sorted(s.violations_by_invariant)) + ")"
    budget = (e.budget if e is not None else None) or "-"
    return (model, str(s.pid), port, mem, limit, budget, state, f.socket)


def _listing(args: argparse.Namespace) -> tuple[list[Found], list[str], list[str]]:
    """The engines to list, the budgets they share, and what --prune removed."""
    removed = prune() if getattr(args, "prune", False) else []
    found = [f for f in discover(min(args.timeout, 2.0)) if f.alive or args.all]
    names = sorted({f.status.engine.budget for f in found if f.status and f.status.engine and f.status.engine.budget})
    return found, names, removed


def _json(found: list[Found], removed: list[str]) -> str:
    rows = []
    for f in found:
        d: dict[str, object] = {"socket": f.socket, "alive": f.alive}
        if f.status is not None:
            d["status"] = render.status_json(f.status)
        if f.problem is not None:
            d["problem"] = f.problem
        rows.append(d)
    doc: object = {"engines": rows, "pruned": removed} if removed else rows
    return msgspec.json.encode(doc).decode()


def cmd_list(args: argparse.Namespace, out: TextIO) -> int:
    found, names, removed = _listing(args)
    if args.json:
        out.write(_json(found, removed) + "\n")
        return 0
    if removed:
        out.write(f"removed {plural(len(removed), 'dead socket')}: {', '.join(removed)}\n")
    if not found:
        out.write(f"no kvcached engine of this user answers in {live.default_socket_dir()}\n")
        return 0
    cells = [_cells(f) for f in found]
    if render.fancy(out):
        render.rich_print(out, "kvcached engines", render.LIST_HEAD, cells, {1, 2, 3, 4})
    else:
        render.plain(out, render.LIST_HEAD, cells, {1, 2, 3, 4})
    for name in names:
        out.write(render.budget_line(budget_usage(name)) + "\n")
    return 0


def cmd_watch(args: argparse.Namespace, out: TextIO) -> int:
    """``kvctl list`` again every ``-n`` seconds: redrawn in place on a terminal (rich.live),
    one listing after another otherwise (or one JSON array per line)."""
    if args.json or not render.fancy(out):
        while True:
            if args.json:
                found, _, removed = _listing(args)
                out.write(_json(found, removed) + "\n")
            else:
                out.write(time.strftime("%H:%M:%S") + "\n")
                cmd_list(args, out)
            out.flush()
            time.sleep(args.interval)
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    def frame() -> Group:
        found, names, _ = _listing(args)
        head = Text(f"{time.strftime('%H:%M:%S')}  every {args.interval:g} s (Ctrl-C to stop)")
        if not found:
            return Group(head, Text(f"no kvcached engine of this user answers in {live.default_socket_dir()}"))
        body = render.table("kvcached engines", render.LIST_HEAD, [_cells(f) for f in found], {1, 2, 3, 4})
        return Group(head, body, *(Text(render.budget_line(budget_usage(n))) for n in names))

    with Live(frame(), console=Console(file=out), auto_refresh=False, screen=False) as view:
        while True:
            time.sleep(args.interval)
            view.update(frame(), refresh=True)
