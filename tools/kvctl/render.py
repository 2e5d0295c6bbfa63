"""How kvctl prints: a rich table for a person at a terminal, aligned plain columns for a pipe.

An operator reads kvctl on a terminal of any width and scripts it through ``grep`` and ``awk``,
so the same rows go out two ways: rich when stdout is a terminal (at the terminal's own width,
never squeezed to 80 columns: a socket path that wraps cannot be pasted), plain otherwise, with
no column ever cut. Sizes print in their unit (``format_size``: "16 KiB", not "0.015625 MiB") and
counts agree with their nouns (``kvcli.plural``), as in kvreplay and kvsim. Every line a status
reply becomes is made here, once, so that ``status``, ``list``, ``limit`` and ``watch`` agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

import msgspec
from kvcli import format_size, plural

from kvcached.budget import BudgetUsage
from kvcached.service import messages

PINS_HEAD = ("page", "pin", "job or request", "since build", "waiting workers")
LIST_HEAD = ("model", "pid", "port", "mapped", "limit", "budget", "state", "socket")


def fancy(out: TextIO) -> bool:
    if not out.isatty():
        return False
    try:
        import rich  # noqa: F401 - optional: plain text without it
    except ImportError:
        return False
    return True


def plain(out: TextIO, head: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    # One format string for every row: 10,000 pins render in a few ms, not 40.
    fmt = "  ".join(f"{{:{'>' if i in right else '<'}{w}}}" for i, w in enumerate(widths)).format
    lines = [fmt(*(h.upper() for h in head)), *(fmt(*r) for r in rows)]
    if len(head) - 1 not in right:
        lines = [line.rstrip() for line in lines]
    out.write("\n".join(lines) + "\n")


def table(title: str, head: Sequence[str] | None, rows: Sequence[Sequence[str]], right: set[int]) -> Any:
    """A rich Table of ``rows``: what ``rich_print`` prints and ``kvctl watch`` redraws."""
    from rich.table import Table

    t = Table(title=title, show_header=head is not None, title_justify="left")
    for i, h in enumerate(head or [""] * (len(rows[0]) if rows else 1)):
        # no_wrap everywhere: a cell that wraps (a socket path) cannot be pasted back.
        t.add_column(h, justify="right" if i in right else "left", no_wrap=True, overflow="fold")
    for r in rows:
        t.add_row(*r)
    return t


def rich_print(
    out: TextIO, title: str, head: Sequence[str] | None, rows: Sequence[Sequence[str]], right: set[int]
) -> None:
    from rich.console import Console

    Console(file=out, soft_wrap=True).print(table(title, head, rows, right))


def pin_cells(row: messages.PinRow) -> tuple[str, str, str, str, str]:
    if row.kind == "job":
        who = f"job {row.job} ({row.request})"
        waiting = str(row.waiting_workers)
        kind = f"{row.job_kind} job"
    elif row.kind == "grace":
        who, waiting, kind = "-", "-", f"grace (until build {row.until_build})"
    else:
        who, waiting, kind = str(row.request), "-", "window hold"
    return str(row.page), kind, who, str(row.since_build), waiting


def limit_text(m: messages.MemoryStatus) -> str:
    return "none" if m.limit_pages >= m.num_pages else format_size(m.limit_bytes)


def memory_line(m: messages.MemoryStatus) -> str:
    return (
        f"{format_size(m.mapped_bytes)} mapped of {format_size(m.capacity_bytes)} ({plural(m.mapped_pages, 'page')} of "
        f"{format_size(m.page_bytes)}: {m.in_use_pages:,} in use, {m.reserved_pages:,} reserved); limit {limit_text(m)}"
    )


def holds_text(held: int, h: messages.Histogram) -> str:
    """Emptied pages pins keep mapped now, and how long the holds that ended lasted
    (``kvcached.holds``; ``vllm:kvcached_page_hold_seconds`` on /metrics)."""
    now = f"{plural(held, 'empty page')} kept by pins now"
    if not h.observed:
        return f"{now}; no hold ended yet"
    top = max(i for i, n in enumerate(h.counts) if n)
    longest = f"at most {h.bounds[top]:g} s" if top < len(h.bounds) else f"over {h.bounds[-1]:g} s"
    return f"{now}; {plural(h.observed, 'hold')} ended, {h.sum / h.observed:.3g} s on average, the longest {longest}"


def memory_json(m: messages.MemoryStatus) -> dict[str, object]:
    d: dict[str, object] = msgspec.to_builtins(m)
    d.update(
        mapped_bytes=m.mapped_bytes,
        limit_bytes=m.limit_bytes,
        capacity_bytes=m.capacity_bytes,
        floor_bytes=m.floor_bytes,
    )
    return d


def status_json(s: messages.StatusReply) -> dict[str, Any]:
    d: dict[str, Any] = msgspec.to_builtins(s)
    if s.memory is not None:
        d["memory"] = memory_json(s.memory)
    return d


def _journal(j: messages.JournalStatus) -> str:
    if j.state == "off":
        return "off"
    text = (
        f"{j.state} {j.path} (segment {j.segment}, {format_size(j.segment_bytes)}), "
        f"{plural(j.events_written, 'event')} written, {j.events_durable:,} durable ({j.durability})"
    )
    if j.snapshot_index is not None:
        text += f"; snapshot at event {j.snapshot_index:,}"
    if j.max_bytes:
        text += f"; {format_size(j.kept_bytes)} kept of a {format_size(j.max_bytes)} bound"
    if j.pruned_segments:
        text += f" ({plural(j.pruned_segments, 'older segment')}, {format_size(j.pruned_bytes)}, deleted: "
        text += f"from segment {j.first_segment} on)"
    if j.error:
        text += f"; error: {j.error}"
    return text


def status_rows(s: messages.StatusReply) -> list[tuple[str, str]]:
    taken = plural(s.events, "event")
    rows: list[tuple[str, str]] = [("service", f"pid {s.pid}, up {s.uptime_s:.0f} s, {taken} taken")]
    e = s.engine
    if e is not None:
        port = f", port {e.port}" if e.port is not None else ""
        rank = f", data-parallel rank {e.index} of {e.data_parallel}" if e.data_parallel > 1 else ""
        rows.append(("engine", f"{e.model}, pid {e.pid}{port}{rank}, {e.engine}, kvcached {e.kvcached}"))
    m = s.memory
    if m is not None:
        rows.append(("memory", memory_line(m)))
        if m.floor_pages:
            rows.append(("floor", f"{format_size(m.floor_bytes)}: {m.floor_why} (kvctl limit --force goes below)"))
        rows.append(("shrink", m.reason if m.shrink_pending else "none pending"))
        if m.page_holds is not None:
            rows.append(("held", holds_text(m.held_pages, m.page_holds)))
        b = m.budget
        if b is not None:
            size = "no bound" if b.size is None else format_size(b.size)
            waits = f" ({format_size(b.unapplied)} of unmaps its workers have not applied yet)" if b.unapplied else ""
            used = f"{format_size(b.used)} used of {size}"
            rows.append(("budget", f"{b.name}: {used}, {format_size(b.share)} by this engine{waits}"))
    if s.pinned_by_kind:
        rows.append(("pinned by", ", ".join(f"{k} {n}" for k, n in sorted(s.pinned_by_kind.items()))))
    if s.violations_by_invariant:
        rows.append(("violated", ", ".join(f"{k} x{n}" for k, n in sorted(s.violations_by_invariant.items()))))
    f = s.flight
    if f is not None:
        dumps = f"; saved: {', '.join(f.dumps)}" if f.dumps else ""
        rows.append(("flight rec.", f"events {f.first_event:,}..{f.first_event + f.events:,} kept{dumps}"))
    lg = s.ledger
    if lg is None:
        rows.append(("ledger", "no replica (replica=False): page counts and pins are not available"))
    else:
        rows += [
            ("ledger", f"event {lg.index:,}, build {lg.build:,}, policy {lg.policy}"),
            (
                "pages",
                f"{lg.num_pages:,} total, {lg.mapped_pages:,} mapped, {lg.pinned_pages:,} pinned, "
                f"{lg.releasable_pages:,} releasable",
            ),
            ("jobs", f"{lg.outstanding_jobs:,} outstanding"),
            ("violations", f"{lg.violations:,}"),
        ]
        if lg.lossy:
            rows.append(("gaps", f"{plural(lg.dropped_events, 'event')} dropped: the view may be off by as much"))
    h = s.handoff
    rows += [
        ("journal", _journal(s.journal)),
        (
            "hand-off",
            f"{h.queued:,} of {h.capacity:,} queued; {h.dropped:,} dropped in {plural(h.gaps, 'gap')}, "
            f"{plural(h.episodes, 'overflow episode')}",
        ),
        (
            "live view",
            f"{plural(s.clients, 'client')}, {plural(s.dropped_clients, 'slow client')} dropped, "
            f"{plural(s.evicted_clients, 'idle one')} let go",
        ),
    ]
    return rows


def budget_line(u: BudgetUsage) -> str:
    size = "no size set" if u.size is None else format_size(u.size)
    engines = ", ".join(f"pid {e.pid} {format_size(e.bytes)}{'' if e.alive else ' (dead)'}" for e in u.engines)
    return f"budget {u.name}: {format_size(u.used)} used of {size}" + (f" ({engines})" if engines else "")
