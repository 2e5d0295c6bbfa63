#!/usr/bin/env bash
# The main job: `vllm serve` (vLLM's CPU build) with kvcached and CPU offloading on, against
# native vLLM with the same flags, on kvcached PR #598's validation load (a correctness table);
# then two kvcached engines on one memory budget smaller than their two KV caches, each growing
# into what the other gave back, against native vLLM (a memory timeline, demo_out/elastic.png);
# then the run's journal replayed with kvreplay beside the golden journal of the same load under
# `legacy`; last, the short version of benchmarks/bench_multi_llm.py (two models, four arms:
# static caches, static + CPU offloading, one budget, one budget + CPU offloading: TTFT under
# bursty load, demo_out/multi_llm.png). Makes .venv and
# .venv-cpu on first use (about 2 minutes), then runs in about 16 minutes on a 2-core machine
# (--skip-elastic: the correctness part only, about 5).
#
#   bash scripts/demo.sh               # the served run (model, logs, journal, plot in demo_out/)
#   bash scripts/demo.sh trace [NAME]  # replay a golden trace only (default finish-in-write-step)
source "$(dirname "$0")/_env.sh"
if [ "${1:-}" = trace ]; then
    trace=${2:-finish-in-write-step}
    echo "== $trace, captured under legacy (unmap a page as soon as it is empty):"
    .venv/bin/kvreplay check "traces/$trace.legacy.kvj" --limit 1 && { echo "expected a violation under legacy" >&2; exit 1; }
    echo
    echo "== the same scenario captured under ledger (pages stay mapped while a copy may read them):"
    .venv/bin/kvreplay check "traces/$trace.ledger.kvj"
    echo
    echo "== the legacy run's inputs replayed under both policies, side by side:"
    exec .venv/bin/kvreplay compare "traces/$trace.legacy.kvj"
fi
ensure_cpu_env
.venv-cpu/bin/python -m kvcached.vllm.testing.demo --out demo_out "$@"
case " $* " in
*" --skip-elastic "*) ;;
*)  # several models, four arms: the short version (about 6 minutes)
    echo
    echo "== two models, four arms (static, static+offload, kvcached, kvcached+offload), bursty load:"
    exec .venv-cpu/bin/python benchmarks/bench_multi_llm.py --short --out demo_out ;;
esac
