"""How an event and a moment read in kvreplay's timelines (``show``, ``show --at``).

One spelling for the events of a timeline, the one of witnesses and ``kvctl tail``
(``describe``), with a job's block lists cut per pool as a flat one is, and a stamped build
boundary's wall-clock time; and one reading of the times an operator types, local as a
dashboard shows them. Kept apart from ``show`` so that ``show --at`` (``at``) uses it too
without an import cycle.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math

from kvcached.ledger.events import BuildBoundary, Event, JobBuilt, JobKind, describe, short


def wall(unix: float) -> str:
    """A Unix time as a dashboard shows it: local time, with its offset, to the millisecond."""
    return dt.datetime.fromtimestamp(unix).astimezone().isoformat(sep=" ", timespec="milliseconds")


def when(text: str) -> float:
    """An argparse ``type`` for ``--at``: ISO 8601 (``2026-12-03T14:05:00``, ``...+01:00``, a
    space for the ``T``; without an offset it is local time, as a dashboard shows it) or a Unix
    time (``1796306700.5``); the Unix time it names."""
    try:
        unix = float(text)
    except ValueError:
        try:
            moment = dt.datetime.fromisoformat(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give a time as 2026-12-03T14:05:00 (local), with an offset (+01:00, Z), or in Unix seconds"
            ) from None
        try:
            # NOTE: a time at the calendar's ends moves out of it on the way to UTC or the local
            # zone (year 1 at UTC-12 is year 0): datetime raises ValueError or OverflowError then,
            # and the platform's localtime OSError.
            unix = (moment if moment.tzinfo else moment.astimezone()).timestamp()
        except (ValueError, OverflowError, OSError):
            unix = math.nan
        if not 0 <= unix < _LAST:
            raise argparse.ArgumentTypeError(f"{text!r}: outside the times a journal can hold (1970 to 2242)") from None
        return unix
    if not math.isfinite(unix) or not 0 <= unix < _LAST:
        raise argparse.ArgumentTypeError(f"{text!r}: not a Unix time (seconds since 1970, before the year 2242)")
    return unix


_LAST = 2**33  # Unix seconds: the year 2242, far beyond any journal, within every platform's calendar


def describe_event(ev: Event, clock_base: float = 0.0) -> str:
    """``describe``'s spelling, the one of witnesses and ``kvctl tail``, with a job's block lists
    shortened per pool as describe shortens a flat one, and a boundary's wall-clock time."""
    if isinstance(ev, JobBuilt):
        # Python's spelling of a tuple of tuples, as describe() writes an uncut one: ``((1, 2),)``
        # for one pool, ``((1, 2), (3,))`` for two.
        pools = ", ".join(short(ids) for ids in ev.blocks) + ("," if len(ev.blocks) == 1 else "")
        kind = JobKind(ev.kind).name.lower()
        return f"JobBuilt(job={ev.job}, kind={kind}, req={ev.req}, blocks=({pools}), workers={ev.workers})"
    if isinstance(ev, BuildBoundary) and ev.at_us is not None and clock_base:
        return f"BuildBoundary(build={ev.build}) at {wall(clock_base + ev.at_us / 1e6)}"
    return describe(ev)
