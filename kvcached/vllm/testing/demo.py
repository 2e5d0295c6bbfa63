"""The main job: `vllm serve` with kvcached and CPU offloading, against native vLLM, on this machine.

Two parts, on vLLM's CPU build and a tiny llama made on the spot. **Correct** (``correct_part``):
one validation load on native vLLM and on vLLM with kvcached, compared request by request.
**Elastic** (``elastic_part``): two kvcached engines name one memory budget smaller than their two
KV caches (``kvcached.vllm.testing.elastic``). Last, the correct part's journal is replayed with
kvreplay (``main``).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvcached.testing.tiny_model import build
from kvcached.vllm.testing import elastic
from kvcached.vllm.testing.e2e import (
    ACTIVE_LINE,
    Completion,
    Server,
    kv_resident_bytes,
    rss_bytes,
    validation_config,
    validation_prompts,
)

MiB = 1 << 20


def _start(servers: dict[str, Server], console: Console) -> None:
    with console.status(f"starting {' and '.join(servers)} (vLLM CPU build)..."):
        for s in servers.values():
            s.start()
        for name, s in servers.items():
            if not s.wait_ready(timeout=elastic.STARTUP_S):
                for t in servers.values():
                    t.stop()
                raise SystemExit(f"the {name} server did not start; its log: {s.log_path}")
    for name, s in servers.items():
        console.print(f"{name}: ready after {s.ready_after:.0f} s (log {s.log_path})")


def _passes(server: Server) -> list[Completion]:
    outputs: list[Completion] = []
    for _ in range(2):
        outputs += [server.complete(p, n) for p, n in validation_prompts()]
        if not server.reset_prefix_cache():
            raise SystemExit("the prefix-cache reset failed")
    return outputs


def correct_part(native: Server, ours: Server, console: Console) -> tuple[int, int]:
    """The validation load on both; the table and the KV memory lines; (identical, total).

    NOTE: vLLM is started natively and with ``ENABLE_KVCACHED=1`` (the ``ledger`` policy, kvcached
    PR #598's reproduction settings, a journal), with the same offloading flags. Each gets kvcached
    PR #598's validation load: prompts sharing a long prefix, half with one output token, twice,
    with a prefix-cache reset between, so that the second pass loads its prefix back from the CPU
    tier. A table says, per request, whether kvcached's greedy tokens and top-5 logprobs equal
    native's and where the prefix came from; then each worker's KV memory.
    """
    with console.status(f"two passes of {len(validation_prompts())} prompts each, prefix cache reset between"):
        theirs, mine = _passes(native), _passes(ours)
    time.sleep(0.5)
    ours_kv = kv_resident_bytes(ours.worker_pid())
    rss = {"native": rss_bytes(native.worker_pid()), "kvcached": rss_bytes(ours.worker_pid())}
    active = next((line for line in ours.log().splitlines() if ACTIVE_LINE in line), "")
    console.print(f"kvcached said: {active[active.find(ACTIVE_LINE) :]}", markup=False)

    table = Table(title="kvcached (ledger) against native vLLM, same prompts and flags")
    cols = ("pass", "request", "output tokens", "same tokens", "top-5 logprobs", "cached tokens (native / kvcached)")
    for col in cols:
        table.add_column(col)
    n = len(validation_prompts())
    same = 0
    for i, (a, b) in enumerate(zip(theirs, mine, strict=True)):
        same += a.tokens == b.tokens and b.max_logprob_diff(a) == 0.0 and a.cached_tokens == b.cached_tokens
        table.add_row(
            str(i // n + 1),
            str(i % n),
            str(len(b.tokens)),
            "yes" if a.tokens == b.tokens else "[red]NO[/red]",
            f"max diff {b.max_logprob_diff(a):.3g}",
            f"{a.cached_tokens} / {b.cached_tokens}",
        )
    console.print(table)
    console.print(f"{same} of {len(theirs)} completions identical to native vLLM (tokens, logprobs, cached tokens)")
    kv = native.config.kv_cache_bytes
    assert kv is not None  # the demo's servers are sized (validation_config)
    console.print(
        f"KV memory of the workers after the run: native vLLM {kv // MiB} MiB (its whole KV cache, allocated "
        f"at start and held for good), kvcached {ours_kv / MiB:.1f} MiB resident (its KV pages mapped now: "
        "this run keeps no prefix cache, so the idle engine has given its pages back)."
    )
    console.print(
        f"[dim]Whole worker RSS: native {rss['native'] // MiB} MiB, kvcached {rss['kvcached'] // MiB} MiB: "
        "the model, Python, torch's and the allocator's buffers; kvcached's worker also runs kvcached's code "
        "and its KV file mappings are counted as shared memory. KV memory is the line above.[/dim]"
    )
    return same, len(theirs)


def elastic_part(model: str, out: Path, native: Server, console: Console) -> bool:
    """Two engines on one budget (``kvcached.vllm.testing.elastic``), against ``native``.

    NOTE: the first is loaded, then limited while idle (``kvctl limit``), and gives its pages
    back; the second is loaded and grows into them; the first serves again. Then the first fills
    the budget and is killed with SIGKILL, and the second maps its share. No request may fail and
    every completion must equal the native server's. A timeline of each worker's resident KV
    bytes beside the budget and two native engines is printed and drawn (``elastic.png``).
    """
    console.rule("two kvcached engines, one budget")
    console.print(
        f"A and B: {elastic.KV_BYTES // MiB} MiB of KV each as vLLM sizes it, one budget of "
        f"{elastic.BUDGET_BYTES // MiB} MiB (KVCACHED_BUDGET); two native engines would hold "
        f"{2 * elastic.KV_BYTES // MiB} MiB from start."
    )
    runtime = Path(tempfile.mkdtemp(prefix="kvcached-demo-"))  # kvctl sees these two engines only
    try:
        with console.status("A and B: starting, then the five phases..."):
            run = elastic.run_elastic(
                model,
                out,
                runtime,
                budget="demo",
                cpu_tier=native.config.cpu_offload_bytes or elastic.CPU_TIER,
                say=lambda line: console.print("  " + line, markup=False),
            )
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    with console.status("native: the same prompts"):
        ref = elastic.native_completions(native)
    rows = elastic.compare(run.completions, ref)
    failed = sum(not c.ok for cs in run.completions.values() for c in cs)
    same = sum(r[2] and r[3] == 0.0 for r in rows)
    over = [s for s in run.samples if s.size is None or s.used > s.size]

    table = Table(title="memory timeline (end of each phase; resident KV bytes of each worker)")
    for col in ("phase", "t (s)", "A", "B", "A + B", "budget used / size", "two native engines"):
        table.add_column(col, justify="right" if col != "phase" else "left")
    for name, t, ra, rb, both, used, size in elastic.timeline_rows(run.samples):
        table.add_row(
            name,
            f"{t:.0f}",
            f"{ra // MiB} MiB",
            f"{rb // MiB} MiB",
            f"{both // MiB} MiB",
            f"{used // MiB} / {size // MiB} MiB",
            f"{2 * elastic.KV_BYTES // MiB} MiB",
        )
    console.print(table)
    peak = max(sum(s.resident.values()) for s in run.samples)
    after = run.seen.get("b_mapped_dead_share_after_s")
    console.print(
        f"{len(rows)} requests, {failed} failed; {same} of {len(rows)} completions identical to native vLLM "
        f"(tokens, top-5 logprobs); budget exceeded in {len(over)} of {len(run.samples)} samples (every 0.2 s); "
        f"peak KV resident in A + B {peak // MiB} MiB, where two native engines hold "
        f"{2 * elastic.KV_BYTES // MiB} MiB; A's share mapped by B "
        + ("[red]not within the bound[/red]" if after is None else f"{after:.1f} s after A's SIGKILL")
    )
    png = out / "elastic.png"
    if elastic.plot(run.samples, png):
        console.print(f"timeline drawn in {png}")
    else:
        console.print("matplotlib is not installed: no plot (pip install 'kvcached[test]')")
    every = sum(map(len, elastic.PHASES.values()))
    return failed == 0 and same == len(rows) == every and not over and after is not None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", default="demo_out", help="model, logs, journal and plot go here (default demo_out)")
    ap.add_argument("--skip-elastic", action="store_true", help="the correct part only (about half the time)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    journal = out / "serve.ledger.kvj"
    journal.unlink(missing_ok=True)
    console = Console()
    t0 = time.monotonic()
    with console.status("building the tiny llama (random weights, local tokenizer)..."):
        model = str(build(out / "model"))
    native = Server(validation_config(model, None), out / "native.log")
    ours = Server(validation_config(model, "ledger", journal), out / "kvcached.log")
    _start({"native": native, "kvcached": ours}, console)
    ok_elastic = True
    try:
        try:
            same, total = correct_part(native, ours, console)
        finally:
            ours.stop()
        if not args.skip_elastic:
            ok_elastic = elastic_part(model, out, native, console)
    finally:
        native.stop()
    # Last, the correct part's journal is replayed with kvreplay (clean), beside the golden
    # journal of the same load under ``legacy`` (the freed-block copy).
    root = Path(__file__).resolve().parents[2]
    console.rule("the journal of the correct part, replayed (ledger)")
    rc_ok = subprocess.run([sys.executable, "-m", "kvreplay.cli", "check", "--no-progress", str(journal)]).returncode
    legacy = root / "traces" / "serve-validation.legacy.kvj"
    if legacy.exists():
        console.rule("the same load served under legacy (golden journal): the freed-block copy")
        subprocess.run([sys.executable, "-m", "kvreplay.cli", "check", "--no-progress", "--limit", "1", str(legacy)])
    console.print(f"the main job took {time.monotonic() - t0:.0f} s")
    return 0 if same == total and rc_ok == 0 and ok_elastic else 1


if __name__ == "__main__":
    sys.exit(main())
