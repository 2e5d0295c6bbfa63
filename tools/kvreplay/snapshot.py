"""``kvreplay snapshot``: save the ledger after N events, so that later replays start there.

A trace of ten million events takes seconds to replay; looking at what happened near its end
should not. A snapshot is the ``LedgerSnapshot`` of ``Ledger.snapshot()`` encoded as msgpack
(msgspec, typed on decode, never pickle): the ledger's inputs-derived state, its violations so
far and ``index``, the number of events it follows. ``--from-snapshot`` on check, show, stats
and plot restores it and skips that many events of the trace. Snapshots take the recorded
decisions: a replay with re-derived decisions interleaves events of its own, so its event count
no longer matches the trace's, and a snapshot of it could not say where in the trace it is.
"""

from __future__ import annotations

import argparse

import kvcli
import msgspec

from kvcached.ledger.events import Policy
from kvcached.ledger.ledger import Ledger

from .tracefile import ReplayError, Trace, write_snapshot


def take(path: str, at: int, out: str, policy: str | None = None, progress: bool = True) -> Ledger:
    if at < 0:
        raise ReplayError(f"--at {at}: an event count cannot be negative")
    with Trace(path, progress=progress) as trace:
        lg = Ledger(trace.header, trace.policy(policy))
        for batch in trace.batches(0, "replaying"):
            room = at - lg.index
            lg.apply_all(batch[:room] if room < len(batch) else batch)
            if lg.index >= at:
                break
        if lg.index < at:
            raise ReplayError(f"{path}: --at {at} is past the end of the trace ({kvcli.plural(lg.index, 'event')})")
    write_snapshot(lg, out)
    return lg


def cmd_snapshot(args: argparse.Namespace) -> int:
    lg = take(args.trace, args.at, args.output, args.policy, not args.no_progress)
    if args.json:
        doc = {"file": args.output, "events": lg.index, "build": lg.build, "violations": len(lg.violations)}
        print(msgspec.json.encode(doc).decode())
        return 0
    print(
        f"wrote {args.output}: the ledger after the first {kvcli.plural(lg.index, 'event')} (build {lg.build} open, "
        f"{kvcli.plural(len(lg.violations), 'violation')} so far); continue with --from-snapshot {args.output}"
    )
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "snapshot",
        help="save the ledger after the first N events, for --from-snapshot",
        description="Replay the first N events of TRACE (recorded decisions) and write the ledger's state to SNAP "
        "(msgpack of LedgerSnapshot). check, show, stats and plot accept --from-snapshot SNAP and continue from it.",
    )
    p.add_argument("trace", metavar="TRACE", help="a kvcached journal (.kvj)")
    p.add_argument(
        "--at",
        type=kvcli.whole(0, "a number of events"),
        required=True,
        metavar="N",
        help="how many events the snapshot follows",
    )
    p.add_argument("-o", "--output", required=True, metavar="SNAP", help="where to write the snapshot")
    p.add_argument("--policy", choices=[p.value for p in Policy], help="policy to replay under (default: recorded)")
    p.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    p.add_argument("--json", action="store_true", help="what was written, as JSON: file, events, build, violations")
    p.set_defaults(func=cmd_snapshot)
