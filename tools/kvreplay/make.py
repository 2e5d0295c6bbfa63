"""Example traces to try kvreplay on: the built-in scenarios and the synthetic workload.

Golden traces come from real vLLM runs; until one is at hand, and for benchmarks, these give a
newcomer real journals in seconds. Each is "recorded" the way the bridge would record it: the
inputs of a scenario or of ``synth.workload`` with the map/unmap decisions the most eager
allocator takes under the chosen policy (``simulate.derive``), the header's policy set to match,
written with ``JournalWriter`` like the live journal service does. ``--inputs-only`` leaves the
decisions out, for trying ``--derive``.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Iterable, Iterator

import kvcli
import msgspec

from kvcached.ledger.events import DECISIONS, Event, Header, Policy
from kvcached.ledger.journal import JournalWriter
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.simulate import derive
from kvcached.testing import synth
from kvcached.testing.seed_cases import SCENARIOS

BATCH = 4096


def write(path: str, header: Header, events: Iterable[Event], policy: Policy, inputs_only: bool = False) -> int:
    """Writes ``events`` (inputs) with decisions derived under ``policy``; returns the event count."""
    h = msgspec.structs.replace(header, policy=policy)
    stream: Iterator[Event] = derive(Ledger(h), events)
    if inputs_only:
        stream = (ev for ev in stream if type(ev) not in DECISIONS)
    with JournalWriter.create(path, h) as w:
        # Frames of a few thousand events, as the journal service writes them.
        while batch := list(itertools.islice(stream, BATCH)):
            w.append(batch)
        return w.events_written


class Saved(msgspec.Struct, frozen=True):
    """One trace ``demo --save`` wrote (its ``--json`` prints a list of them)."""

    file: str
    scenario: str
    policy: str
    events: int

    def line(self) -> str:
        return f"wrote {self.file}: {kvcli.plural(self.events, 'event')}, decisions derived under {self.policy}"


def save_scenarios(directory: str, names: list[str]) -> list[Saved]:
    os.makedirs(directory, exist_ok=True)
    written = []
    for name in names or list(SCENARIOS):
        sc = SCENARIOS[name]()
        for policy in Policy:
            path = os.path.join(directory, f"{name}.{policy.value}.kvj")
            written.append(Saved(path, name, policy.value, write(path, sc.header, sc.events, policy)))
    return written


def cmd_synth(args: argparse.Namespace) -> int:
    events = itertools.islice(synth.workload(args.seed, preempt_every=args.preempt_every), args.events)
    header = msgspec.structs.replace(synth.header(), meta={**synth.header().meta, "seed": str(args.seed)})
    n = write(args.output, header, events, Policy(args.policy), args.inputs_only)
    how = "no decisions" if args.inputs_only else f"decisions derived under {args.policy}"
    what = f"{kvcli.plural(args.events, 'input')} of the synthetic workload, seed {args.seed}"
    if args.json:
        doc = {
            "file": args.output,
            "events": n,
            "inputs": args.events,
            "seed": args.seed,
            "policy": None if args.inputs_only else args.policy,
        }
        print(msgspec.json.encode(doc).decode())
        return 0
    print(f"wrote {args.output}: {kvcli.plural(n, 'event')} ({what}; {how})")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "synth",
        help="write a synthetic serving workload as a trace, to try kvreplay on or to benchmark it",
        description="Write N input events of the synthetic serving workload (kvcached.testing.synth) to OUT, with "
        "the map/unmap decisions of the most eager allocator under --policy (legacy shows freed-block copies).",
    )
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="the trace to write")
    p.add_argument(
        "--events",
        type=kvcli.whole(1, "a number of events", 10**9),
        default=200_000,
        metavar="N",
        help="input events (default 200000)",
    )
    p.add_argument("--policy", choices=[p.value for p in Policy], default="legacy", help="default: legacy")
    p.add_argument("--seed", type=kvcli.whole(0, "a seed"), default=7, help="workload seed (default 7)")
    p.add_argument("--inputs-only", action="store_true", help="record no decisions (replay with --derive)")
    # The generator's preemption can pick a request that finishes in the same step and then
    # fails after about 500,000 events; off by default until it is fixed.
    p.add_argument(
        "--preempt-every",
        type=kvcli.whole(0, "a number of steps"),
        default=0,
        metavar="STEPS",
        help="preempt a running request every STEPS steps (default 0: never)",
    )
    p.add_argument("--json", action="store_true", help="what was written, as JSON: file, events, seed, policy")
    p.set_defaults(func=cmd_synth)
