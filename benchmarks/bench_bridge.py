"""What kvcached costs vLLM's scheduler step: ratios to vLLM alone with confidence intervals,
and instruction counts that do not drift.

vLLM 0.33's ``schedule()`` + ``update_from_output()`` is on the critical path of every token
vLLM serves, and it is what kvcached's bridge, ledger and page-aware pool add to. This machine
is shared and busy: timed one after the other, the same variant swings by 30% between runs. So
every variant gets its own real vLLM ``Scheduler`` (with its real ``OffloadingConnector``, built
by ``kvcached.vllm.testing.harness``), all of them in one process, driven with the same requests,
and they are stepped *interleaved*: alternation ``i`` runs step ``i`` of every variant, in a
rotating order, so that whatever the machine does in that second hits all variants alike. Each
alternation gives one ratio per variant (its step time over vLLM alone's same step); the report
is the geometric mean of those ratios with a 95% interval (normal on the log ratios) and their
median with a 95% bootstrap interval. Variants:

* ``vllm``: vLLM's own scheduler and block pool, no kvcached;
* ``bridge``: the connector bridge feeding the ledger, vLLM's own pool, no journal;
* ``bridge+journal``: the same, journaled by the ledger service as the plugin configures it;
* ``kvcached``: the bridge and the page-aware pool over kvcached's manager, no journal (what
  ``ENABLE_KVCACHED=1`` runs by default);
* ``kvcached+all``: that, with the ledger service a served engine runs (``engine_core.served.
  service_config``: journal, live socket, replica, flight recorder).

Only the two scheduler calls are timed; the harness's worker side (its connectors, byte copies
and the model stand-in's sampling; no forward pass) runs between them untimed, and a ledger
service is let drain between steps, untimed, so that its thread does not run inside another
variant's timed step (in a server it runs during the forward pass). Workloads: ``decode-256``
and ``decode-1024`` (that many running requests, 64-token prompts, decode steady state) and
``prefill`` (a stream of 256- to 1536-token prompts, half behind one of 8 shared 512-token
prefixes, 16 to 48 output tokens: chunked prefill, prefix hits, offloading loads). The
page-aware pool is built as the plugin builds it (5..10 reserved pages) with 32 blocks a page
(a 2 MiB page of one layer of an 8B llama's 64 KiB blocks) and no cap on the prefix cache, so
that every variant schedules the same tokens (the report counts steps where they differ).

Each kvcached variant also reports its page maps and unmaps over the measured steps
(``kvcached.engine.steps``): how many steps made none, the ops in all, the most in one step.

``--callgrind`` also counts the instructions of the same steps under valgrind's callgrind:
one process per workload, instrumentation off until the schedulers are warm, collection on only
inside ``operator.call`` (the timed calls go through it) and one dump per variant. Counts are
deterministic, so they need no interval. Run with the vLLM environment:

    .venv-vllm/bin/python benchmarks/bench_bridge.py [--alternations 200] [--callgrind]

``--variants vllm,kvcached`` builds and steps only those (vLLM alone is always the base), and
``--alternations 0`` with ``--callgrind`` only counts instructions (no timed run): the quick
loop for a change to the kvcached variant's step.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import operator
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VARIANTS = ("vllm", "bridge", "bridge+journal", "kvcached", "kvcached+all")
# The variants this run builds and steps (``--variants``); vLLM alone, the base, always first.
selected: tuple[str, ...] = VARIANTS
BLOCKS_PER_PAGE = 32


@dataclass(frozen=True)
class Workload:
    name: str
    max_num_seqs: int
    num_gpu_blocks: int
    initial: int  # requests queued before the warm-up (decode) ...
    per_step: int  # ... or arriving at every step (prefill)
    warmup: int  # steps after every initial request runs


WORKLOADS = {
    "decode-256": Workload("decode-256", 256, 16384, 256, 0, 5),
    "decode-1024": Workload("decode-1024", 1024, 32768, 1024, 0, 5),
    "prefill": Workload("prefill", 256, 32768, 0, 6, 40),
}


class Requests:
    """The same requests, in the same order, for every variant's harness."""

    def __init__(self, w: Workload, model: Any) -> None:
        self.w = w
        self.model = model
        self._prefixes = [model.prompt(512, 1_000_000 + k) for k in range(8)]

    def initial(self) -> list[tuple[str, list[int], int]]:
        return [(f"d{i}", self.model.prompt(64, i), 100_000) for i in range(self.w.initial)]

    def arriving(self, step: int) -> list[tuple[str, list[int], int]]:
        out = []
        rng = random.Random(step)
        for k in range(self.w.per_step):
            n = step * self.w.per_step + k
            length = rng.randrange(256, 1537)
            if rng.random() < 0.5:
                prompt = self._prefixes[rng.randrange(8)] + self.model.prompt(max(1, length - 512), n)
            else:
                prompt = self.model.prompt(length, n)
            out.append((f"p{n}", prompt, rng.randrange(16, 49)))
        return out


class Variant:
    """One variant: a harness (real Scheduler + OffloadingConnector) and kvcached under it."""

    def __init__(self, name: str, w: Workload, tmp: str, timer: Callable[..., Any]) -> None:
        from kvcached.vllm.testing.harness import Harness, HarnessConfig

        self.name = name
        self.engine: Any = None
        self.backends: list[Any] = []
        self._tmp = tmp
        cfg = HarnessConfig(
            max_num_seqs=w.max_num_seqs,
            max_num_batched_tokens=8192,
            num_gpu_blocks=w.num_gpu_blocks,
            max_model_len=4096,
            cpu_bytes_to_use=128 << 20,
            kvcached_connector=name != "vllm",  # vLLM alone: vLLM's own connector class
        )
        self.h = Harness(cfg, on_scheduler_built=self._built)
        self.h.model.forward = lambda *a, **k: None  # type: ignore[method-assign]  # no forward pass
        for tw in self.h.transfer_workers:
            tw.observers.clear()  # no byte-level check of the loads: not what is measured
        self.step_s = 0.0
        self.steps = 0
        self.scheduled: list[int] = []  # tokens scheduled per step, to compare the variants
        s = self.h.scheduler
        for call in ("schedule", "update_from_output"):
            setattr(s, call, self._timed(getattr(s, call), timer))

    def _timed(self, fn: Callable[..., Any], call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call(fn, *a, **kw)  # operator.call: what callgrind collects inside
            finally:
                self.step_s += time.perf_counter() - t0

        return timed

    def _built(self, scheduler: Any) -> None:
        from kvcached.backends.host import HostBackend
        from kvcached.kv_cache_manager import KVGeometry
        from kvcached.service.ledger_service import ServiceConfig
        from kvcached.vllm.engine_core.engine import EngineConfig, assemble

        if self.name == "vllm":
            return
        paged = self.name.startswith("kvcached")
        journal = f"{self._tmp}/{self.name}.kvj"
        service = None
        if self.name == "bridge+journal":  # as the plugin journals (kvcached/vllm/engine_core/served.py)
            service = ServiceConfig(journal=journal, replica=False, snapshot_every=0, flush_interval=0.005)
        elif self.name == "kvcached+all":  # a served engine's service: journal, socket, replica, flight recorder
            from kvcached.service.config import service_config
            from kvcached.settings import Settings

            settings = Settings(journal=journal, dump_dir=self._tmp)
            service = service_config(settings, f"{self._tmp}/{self.name}.sock")
        nb = scheduler.kv_cache_config.num_blocks
        block_bytes = scheduler.kv_cache_config.kv_cache_tensors[0].size // nb
        g = KVGeometry(num_blocks=nb, block_bytes=block_bytes, page_bytes=BLOCKS_PER_PAGE * block_bytes)
        self.backends = [HostBackend(page_bytes=g.page_bytes)] if paged else []
        config = EngineConfig(page_aware=paged, min_reserved_pages=5, max_reserved_pages=10, journal_service=service)
        self.engine = assemble(scheduler, g, self.backends, config)

    def add(self, reqs: list[tuple[str, list[int], int]]) -> None:
        for rid, prompt, max_tokens in reqs:
            self.h.add_request(prompt=prompt, max_tokens=max_tokens, request_id=rid)

    def step(self, requests: Requests) -> float:
        """One engine step (arrivals first); returns the scheduler calls' seconds."""
        if requests.w.per_step:
            self.add(requests.arriving(self.steps))
        self.step_s = 0.0
        record = self.h.step()
        self.steps += 1
        self.scheduled.append(sum(record.num_scheduled_tokens.values()) if record is not None else -1)
        self.settle()
        return self.step_s

    def settle(self) -> None:
        """Wait (untimed) until the ledger service has taken every event of the step."""
        if self.engine is None or self.engine.service is None:
            return
        svc, target = self.engine.service.service, self.engine.ledger.tables.index
        deadline = time.monotonic() + 10
        while svc.index < target and time.monotonic() < deadline:
            p = svc.producer
            if p._sleeping:  # a benchmark may poke the hand-off's private wake-up
                p._wake()
            time.sleep(0.0002)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.h.close()
        for b in self.backends:
            b.close()


@contextlib.contextmanager
def variants(w: Workload, timer: Callable[..., Any]) -> Iterator[tuple[list[Variant], Requests]]:
    tmp = tempfile.mkdtemp(prefix="kvcached-bench-bridge-")
    vs: list[Variant] = []
    try:
        for name in selected:
            vs.append(Variant(name, w, tmp, timer))
        requests = Requests(w, vs[0].h.model)
        first = requests.initial()
        for v in vs:
            v.add(first)
        # Warm-up, untimed: every initial request admitted and prefilled, then a few steps.
        for v in vs:
            while len(v.h.scheduler.running) < w.initial:
                v.step(requests)
            for _ in range(w.warmup):
                v.step(requests)
        yield vs, requests
    finally:
        for v in vs:
            v.close()
        shutil.rmtree(tmp, ignore_errors=True)


def measure(w: Workload, alternations: int) -> dict[str, Any]:
    with variants(w, operator.call) as (vs, requests):
        gc.collect()
        gc.freeze()  # as vLLM's engine core does once it is up
        times: dict[str, list[float]] = {v.name: [] for v in vs}
        warm_steps = [v.steps for v in vs]
        ops_before = {v.name: v.engine.page_ops.snapshot() for v in vs if v.name.startswith("kvcached")}
        for i in range(alternations):
            k = i % len(vs)
            for v in vs[k:] + vs[:k]:  # rotating order: no variant always runs first
                times[v.name].append(v.step(requests))
        base = vs[0].scheduled
        differ = {
            v.name: sum(a != b for a, b in zip(v.scheduled[ws:], base[warm_steps[0] :], strict=False))
            for v, ws in zip(vs, warm_steps, strict=True)
        }
        running = len(vs[0].h.scheduler.running)
        ops = {n: page_ops_window(h, v.engine.page_ops.snapshot()) for v in vs if (h := ops_before.get(n := v.name))}
        gc.unfreeze()
    return {"times": times, "differ": differ, "running": running, "alternations": alternations, "page_ops": ops}


def page_ops_window(before: Any, after: Any) -> str:
    """Page maps and unmaps per step over the measured steps (``kvcached.engine.steps``), in words:
    how many steps made none, and the most any step's bucket allows."""
    counts = [b - a for a, b in zip(before.counts, after.counts, strict=True)]
    steps, ops = sum(counts), after.sum - before.sum
    if not steps:
        return "no step"
    top = max(i for i, n in enumerate(counts) if n)
    most = f"at most {after.bounds[top]:g}" if top < len(after.bounds) else f"over {after.bounds[-1]:g}"
    return f"{counts[0]} of {steps} steps mapped and unmapped no page; {ops} ops in all, {most} in a step"


# --- statistics ------------------------------------------------------------------------------


def geo_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of the ratios and its 95% interval (normal on the logs; n is large)."""
    logs = [math.log(r) for r in ratios]
    m = statistics.fmean(logs)
    half = 1.96 * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def median_interval(ratios: list[float], resamples: int = 2000) -> tuple[float, float, float]:
    """Median of the ratios and its 95% percentile-bootstrap interval (seeded)."""
    rng = random.Random(0)
    n = len(ratios)
    meds = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(resamples))
    return statistics.median(ratios), meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


# --- callgrind --------------------------------------------------------------------------------

_CG_C = r"""
#include <valgrind/callgrind.h>
void kvc_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void kvc_cg_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""


def _client_requests(tmp: str) -> Any:
    """A tiny library issuing callgrind's client requests (start instrumenting, dump)."""
    src, lib = os.path.join(tmp, "cg.c"), os.path.join(tmp, "libkvccg.so")
    with open(src, "w") as f:
        f.write(_CG_C)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
    return ctypes.CDLL(lib)


def callgrind_child(w: Workload, steps: int, lib_path: str) -> None:
    lib = ctypes.CDLL(lib_path)
    with variants(w, operator.call) as (vs, requests):
        gc.collect()
        gc.freeze()
        for v in vs:  # one more warm step each, so that every code path is translated
            v.step(requests)
        lib.kvc_cg_start()
        lib.kvc_cg_dump(b"warm")
        for v in vs:  # counts do not drift: one variant after another, each over its own steps
            for _ in range(steps):
                v.step(requests)
            lib.kvc_cg_dump(v.name.encode())
        gc.unfreeze()


def callgrind(w: Workload, steps: int, tmp: str) -> dict[str, float]:
    lib = os.path.join(tmp, "libkvccg.so")
    if not os.path.exists(lib):
        _client_requests(tmp)
    out = os.path.join(tmp, f"cg-{w.name}.out")
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        "--toggle-collect=_operator_call",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-P",
        os.path.abspath(__file__),
        "--callgrind-child",
        w.name,
        str(steps),
        lib,
        "--variants",
        ",".join(selected),
    ]
    env = dict(os.environ, PYTHONHASHSEED="0")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(Path(__file__).resolve().parent.parent))
    if proc.returncode != 0:
        raise SystemExit(f"callgrind run failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    per_step: dict[str, float] = {}
    for name in sorted(os.listdir(tmp)):
        if not name.startswith(f"cg-{w.name}.out."):
            continue
        label, total = "", 0
        with open(os.path.join(tmp, name)) as f:
            for line in f:
                if line.startswith("desc: Trigger: Client Request: "):
                    label = line.split(": ", 3)[-1].strip()
                elif line.startswith("totals:"):
                    total = int(line.split()[1])
        if label in selected:
            per_step[label] = total / steps
    return per_step


# --- the report -------------------------------------------------------------------------------


def report(w: Workload, m: dict[str, Any] | None, ir: dict[str, float] | None) -> None:
    if m is None:  # --alternations 0: instruction counts only
        assert ir is not None
        print(f"\n{w.name}: instructions only")
        print(f"{'variant':14}  {'Mi instr/step':>13}  {'instr ratio':>11}")
        for name in selected:
            n = ir.get(name, float("nan"))
            print(f"{name:14}  {n / 1e6:13.2f}  {n / ir['vllm']:11.3f}")
        return
    times = m["times"]
    base = times["vllm"]
    cv = statistics.stdev(base) / statistics.fmean(base)
    print(
        f"\n{w.name}: {m['running']} running at the end, {m['alternations']} alternations "
        f"(vllm step time: median {1e3 * statistics.median(base):.2f} ms, CV {100 * cv:.0f}%)"
    )
    head = f"{'variant':14} {'median ms':>9}  {'geo-mean ratio [95% CI]':>26}  {'median ratio [95% boot]':>26}"
    if ir:
        head += f"  {'Mi instr/step':>13}  {'instr ratio':>11}"
    print(head)
    for name in selected:
        t = times[name]
        ratios = [a / b for a, b in zip(t, base, strict=True)]
        g, glo, ghi = geo_interval(ratios) if name != "vllm" else (1.0, 1.0, 1.0)
        md, mlo, mhi = median_interval(ratios) if name != "vllm" else (1.0, 1.0, 1.0)
        line = (
            f"{name:14} {1e3 * statistics.median(t):9.2f}  {g:8.3f} [{glo:.3f}, {ghi:.3f}]   "
            f"{md:8.3f} [{mlo:.3f}, {mhi:.3f}]  "
        )
        if ir:
            line += f"  {ir.get(name, float('nan')) / 1e6:13.2f}  {ir.get(name, float('nan')) / ir['vllm']:11.3f}"
        if m["differ"].get(name):
            line += f"  ({m['differ'][name]} steps scheduled other tokens than vllm)"
        print(line)
    for name, words in m.get("page_ops", {}).items():
        print(f"{name}: page ops over the measured steps: {words}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--alternations", type=int, default=200, help="timed alternations (0: --callgrind only)")
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"which variants to build and step, of {', '.join(VARIANTS)} (vllm, the base, always runs)",
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--callgrind", action="store_true", help="also count instructions (minutes per workload)")
    ap.add_argument(
        "--cg-steps",
        type=int,
        default=16,
        help="steps per variant under callgrind (16: one whole block cycle of the decode workloads, whose "
        "requests, admitted together, cross a 16-token block boundary in the same step)",
    )
    ap.add_argument("--json", help="write the raw step times here")
    ap.add_argument("--cg-out", help="keep callgrind's files here (for callgrind_annotate), not in a temporary folder")
    ap.add_argument(
        "--build",
        choices=("compiled", "pure"),
        default="compiled",
        help="compiled: kvcached as pip install builds it (scripts/build-compiled.sh); pure: the source tree",
    )
    ap.add_argument("--callgrind-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global selected
    chosen = {n.strip() for n in args.variants.split(",") if n.strip()}
    if chosen - set(VARIANTS):
        print(f"bench_bridge: variants are {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    selected = tuple(n for n in VARIANTS if n in chosen or n == "vllm")
    if args.callgrind_child:
        name, steps, lib = args.callgrind_child
        callgrind_child(WORKLOADS[name], int(steps), lib)
        return 0
    if args.build != "pure" and BUILD_ENV not in os.environ:
        return _rerun_compiled()
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    timed = args.alternations > 0
    if unknown or not names or (timed and args.alternations < 10) or not (timed or args.callgrind):
        print(
            f"bench_bridge: workloads are {', '.join(WORKLOADS)} and alternations >= 10 (or 0 with --callgrind)",
            file=sys.stderr,
        )
        return 2
    if args.callgrind and shutil.which("valgrind") is None:
        print("bench_bridge: --callgrind needs valgrind on PATH", file=sys.stderr)
        return 2
    import kvcached.ledger.ledger as ledger_module

    compiled = [m for m in _compiled_names() if _is_compiled(m)]
    print(f"kvcached from {Path(ledger_module.__file__).parent.parent}; compiled: {', '.join(compiled) or 'none'}")
    raw = {}
    with contextlib.ExitStack() as stack:
        if args.cg_out:
            os.makedirs(args.cg_out, exist_ok=True)
            cgtmp = args.cg_out
        else:
            cgtmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvcached-cg-"))
        for n in names:
            w = WORKLOADS[n]
            ir = callgrind(w, args.cg_steps, cgtmp) if args.callgrind else None
            m = measure(w, args.alternations) if timed else None
            raw[n] = {"times": m["times"] if m else None, "instructions_per_step": ir}
            report(w, m, ir)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f)
    print("\nratio: step time over vllm's same step, per alternation; schedule()+update_from_output() only")
    return 0


BUILD_ENV = "KVCACHED_BENCH_BUILD"


def _compiled_names() -> tuple[str, ...]:
    from kvcached.ledger.compiled import COMPILED_MODULES  # the one list, as pip install compiles it

    return COMPILED_MODULES


def _is_compiled(module: str) -> bool:
    import importlib

    return not str(getattr(importlib.import_module(module), "__file__", "")).endswith(".py")


def _rerun_compiled() -> int:
    """Build kvcached with mypyc into a temporary folder and run this script against it."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="kvcached-bench-build-") as tmp:
        subprocess.run(["bash", str(root / "scripts/build-compiled.sh"), f"{tmp}/b"], check=True)
        env = dict(os.environ, PYTHONPATH=f"{tmp}/b", **{BUILD_ENV: f"{tmp}/b"})
        return subprocess.run([sys.executable, "-P", os.path.abspath(__file__), *sys.argv[1:]], env=env).returncode


if __name__ == "__main__":
    if BUILD_ENV not in os.environ:  # else the build's copy of kvcached is on PYTHONPATH
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
