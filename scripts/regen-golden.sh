#!/usr/bin/env bash
# Regenerate the golden traces: run the real-vLLM scenarios under both policies, keep their
# journals in traces/, and write each one's expected report (`kvreplay check --json`).
# A golden file changes only with a reason in the commit message.
source "$(dirname "$0")/_env.sh"
ensure_vllm_env
GOLDEN=(finish-in-write-step finished-store-next-build sliding-window preempt-shrink tp2-late-report random-workload-1)
.venv-vllm/bin/python -m kvcached.vllm.testing.scenarios --capture traces "${GOLDEN[@]}"
# SGLang 0.5.23's pool, allocator, host pool and HiCacheController with kvcached.
ensure_sglang_env
.venv-sglang/bin/python -m kvcached.sglang.testing.scenarios --capture traces
# The served pair: `vllm serve` (vLLM's CPU build) with kvcached, kvcached PR #598's validation load.
ensure_cpu_env
KVCACHED_CAPTURE_DIR=traces .venv-cpu/bin/python -m pytest -q -p no:cacheprovider tests/serve/test_serve_e2e.py \
    -k "legacy_shows or ledger_journal"
KVCACHED_CAPTURE_DIR=traces .venv-cpu/bin/python -m pytest -q -p no:cacheprovider tests/serve/test_model_kinds.py \
    -k "served_like_native"
for trace in traces/*.kvj; do
    rc=0
    .venv/bin/kvreplay check --json "$trace" >"${trace%.kvj}.check.json" || rc=$?
    # Exit 1 is a violation (a report on stdout) or a trace that cannot be used (nothing there).
    [ "$rc" -le 1 ] && [ -s "${trace%.kvj}.check.json" ] || { echo "kvreplay check failed on $trace" >&2; exit 1; }
done
ls -l traces
