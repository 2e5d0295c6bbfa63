"""Journal decode speed: events/s of reading a trace (frames, CRCs, typed msgspec decode), no ledger.

The bounds the format puts on event fields (``events.NonNeg``: an int64, so that a build number
or an index fits the ledger's int64 arrays) are checked by msgspec while it decodes; this
measures what they cost, apart from the ledger's replay (``bench_replay.py`` measures both
together, where decode is a small share). Two figures, each the median of ``--runs`` (the best
run beside it, as on a shared machine the spread comes from other tenants):

* ``read``: ``JournalReader`` over a recorded synthetic trace (``synth.workload`` with decisions
  derived under ``ledger``, frames of 65,536 events), file to events;
* ``decode``: the typed decode of the same frame payloads, already in memory;
* ``unbounded``: the same decode with the int64 upper bounds taken off (the format before they
  were added: ``ge`` only), interleaved run by run with ``decode`` in one process so that both
  see the same machine; ``bound_cost`` is the median over runs of decode's time over unbounded's
  in the same run, minus one (paired, so that a slow spell of the machine cancels out).

    python benchmarks/bench_decode.py [--events 1000000] [--runs 7] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec

from kvcached.ledger.events import EVENT_TYPES, INT64_MAX, Event
from kvcached.ledger.journal import JournalReader, JournalWriter, encode_batch
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.simulate import derive
from kvcached.testing import synth

BATCH = 65536


def _unbounded(cls: type) -> type:
    """``cls`` with the same tag and layout, its int fields bounded below only."""

    def loosen(t: Any) -> Any:
        if get_origin(t) is Annotated:
            base, *metas = get_args(t)
            if base is int:
                m = metas[0]
                return Annotated[int, msgspec.Meta(ge=m.ge)] if m.le == INT64_MAX else t
        return t

    cfg = cls.__struct_config__
    fields = [(f.name, loosen(f.type)) for f in msgspec.structs.fields(cls)]
    return msgspec.defstruct(
        cls.__name__, fields, tag=cfg.tag, tag_field=cfg.tag_field, array_like=True, frozen=True, gc=False
    )


def _rates(n: int, runs: int, once: object) -> dict[str, float]:
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        once()  # type: ignore[operator]
        rates.append(n / (time.perf_counter() - t0))
    return {"eps": statistics.median(rates), "best_eps": max(rates)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    h = synth.header()
    stream = derive(Ledger(h), synth.workload(7, preempt_every=0))
    batches = [list(itertools.islice(stream, BATCH)) for _ in range(-(-args.events // BATCH))]
    payloads = [encode_batch(b) for b in batches]
    n = sum(map(len, batches))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.kvj")
        with JournalWriter.create(path, h) as w:
            for p, b in zip(payloads, batches, strict=True):
                w.append_encoded(p, len(b))

        def read() -> None:
            for _ in JournalReader(path).batches():
                pass

        decoders = {
            "decode": msgspec.msgpack.Decoder(list[Event]),
            "unbounded": msgspec.msgpack.Decoder(list[Union[tuple(map(_unbounded, EVENT_TYPES))]]),  # type: ignore[misc]  # noqa: UP007
        }
        times: dict[str, list[float]] = {k: [] for k in decoders}
        for i in range(args.runs):
            # Each goes first every other run: the second of a pair pays for freeing the first's events.
            for name, d in sorted(decoders.items(), reverse=bool(i % 2)):
                t0 = time.perf_counter()
                for p in payloads:
                    d.decode(p)
                times[name].append(time.perf_counter() - t0)
        result: dict[str, Any] = {"events": n, "read": _rates(n, args.runs, read)}
        for name, ts in times.items():
            result[name] = {"eps": n / statistics.median(ts), "best_eps": n / min(ts)}
        pairs = zip(times["decode"], times["unbounded"], strict=True)
        result["bound_cost"] = statistics.median(a / b for a, b in pairs) - 1
    if args.json:
        print(json.dumps(result))
    else:
        for part in ("read", "decode", "unbounded"):
            r = result[part]
            print(f"{part:>9}: {r['eps'] / 1e6:.2f} M events/s (best {r['best_eps'] / 1e6:.2f}) over {n:,} events")
        print(f"the int64 bounds cost {result['bound_cost']:+.1%} of the decode time (median of paired runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
