"""The main job: `vllm serve` with kvcached and CPU offloading, against native vLLM, on this machine.

Starts vLLM's CPU build twice on a tiny llama made on the spot, once native and once with
``ENABLE_KVCACHED=1`` (the ``ledger`` policy, kvcached PR #598's reproduction settings, a journal), both
with the same offloading flags, and sends each kvcached PR #598's validation load: prompts sharing a
long prefix, half with one output token, twice, with a prefix-cache reset between, so that the
second pass loads its prefix back from the CPU tier. It prints, per request, whether kvcached's
greedy tokens and top-5 logprobs equal native's and where the prefix came from, the worker's
resident memory of both servers, and then replays the journal with kvreplay (clean) beside the
golden journal of the same load under ``legacy`` (the freed-block copy).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvcached.testing.e2e import ACTIVE_LINE, Completion, Server, rss_bytes, validation_config, validation_prompts
from kvcached.testing.tiny_model import build


def serve(model: str, out: Path, kvcached: bool, console: Console) -> tuple[list[Completion], int, str]:
    name = "kvcached" if kvcached else "native"
    cfg = validation_config(model, "ledger" if kvcached else None, out / "serve.ledger.kvj")
    with console.status(f"starting the {name} server (vLLM CPU build)..."):
        server = Server(cfg, out / f"{name}.log").start()
        if not server.wait_ready():
            server.stop()
            raise SystemExit(f"the {name} server did not start; its log: {server.log_path}")
    try:
        console.print(f"{name}: ready after {server.ready_after:.0f} s (log {server.log_path})")
        outputs: list[Completion] = []
        with console.status(f"{name}: two passes of {len(validation_prompts())} prompts, prefix cache reset between"):
            for _ in range(2):
                outputs += [server.complete(p, n) for p, n in validation_prompts()]
                if not server.reset_prefix_cache():
                    raise SystemExit(f"{name}: the prefix-cache reset failed")
        time.sleep(0.5)
        rss = rss_bytes(server.worker_pid())
    finally:
        server.stop()
    active = next((line for line in server.log().splitlines() if ACTIVE_LINE in line), "")
    return outputs, rss, active[active.find(ACTIVE_LINE) :] if active else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--out", default="demo_out", help="model, logs and journal go here (default demo_out)")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    journal = out / "serve.ledger.kvj"
    journal.unlink(missing_ok=True)
    console = Console()
    with console.status("building the tiny llama (random weights, local tokenizer)..."):
        model = str(build(out / "model"))
    native, native_rss, _ = serve(model, out, False, console)
    ours, ours_rss, active = serve(model, out, True, console)
    console.print(f"kvcached said: {active}", markup=False)

    table = Table(title="kvcached (ledger) against native vLLM, same prompts and flags")
    columns = ("pass", "request", "output tokens", "same tokens", "top-5 logprobs", "cached tokens (native / kvcached)")
    for col in columns:
        table.add_column(col)
    prompts = validation_prompts()
    same = 0
    for i, (a, b) in enumerate(zip(native, ours, strict=True)):
        eq = a.tokens == b.tokens and b.max_logprob_diff(a) == 0.0 and a.cached_tokens == b.cached_tokens
        same += eq
        table.add_row(
            str(i // len(prompts) + 1),
            str(i % len(prompts)),
            str(len(b.tokens)),
            "yes" if a.tokens == b.tokens else "[red]NO[/red]",
            f"max diff {b.max_logprob_diff(a):.3g}",
            f"{a.cached_tokens} / {b.cached_tokens}",
        )
    console.print(table)
    console.print(f"{same} of {len(native)} completions identical to native vLLM (tokens, logprobs, cached tokens)")
    console.print(
        f"worker resident memory after the run: native {native_rss >> 20} MiB, kvcached {ours_rss >> 20} MiB "
        "(kvcached's KV pages come and go with the blocks in use)"
    )
    root = Path(__file__).resolve().parents[2]
    console.rule("the journal of this run, replayed (ledger)")
    rc_ok = subprocess.run([sys.executable, "-m", "kvreplay.cli", "check", "--no-progress", str(journal)]).returncode
    legacy = root / "traces" / "serve-validation.legacy.kvj"
    if legacy.exists():
        console.rule("the same load served under legacy (golden journal): the freed-block copy")
        subprocess.run([sys.executable, "-m", "kvreplay.cli", "check", "--no-progress", "--limit", "1", str(legacy)])
    return 0 if same == len(native) and rc_ok == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
