#!/usr/bin/env bash
# Compile the ledger's hot path with mypyc into DIR (a copy of the package), without touching
# the work tree. Used by the benchmarks (pure vs compiled, side by side) and by the test
# command (the ledger's tests run against the compiled build too).
#   build-compiled.sh DIR           the ledger, as setup.py compiles it
#   build-compiled.sh DIR --engine  also what runs on vLLM's scheduler step: the manager, the page
#                                   allocator, the page-aware pool, the bridge and the recorder
set -euo pipefail
out=${1:?usage: build-compiled.sh DIR [--engine]}
root="$(cd "$(dirname "$0")/.." && pwd)"
modules=(kvcached/ledger/ledger.py kvcached/ledger/checks.py kvcached/ledger/tables.py kvcached/ledger/queries.py)
if [ "${2:-}" = "--engine" ]; then
    modules+=(kvcached/kv_cache_manager.py kvcached/page_allocator.py kvcached/ledger/recorder.py
        kvcached/vllm_bridge/bridge.py kvcached/vllm_bridge/block_pool.py)
elif [ -n "${2:-}" ]; then
    echo "usage: build-compiled.sh DIR [--engine]" >&2
    exit 2
fi
rm -rf "$out" && mkdir -p "$out"
cp -r "$root/kvcached" "$out/"
find "$out" -name '__pycache__' -prune -exec rm -rf {} +
cd "$out"
# vLLM is not in the build environment: its modules are typed Any, as in the project's mypy settings.
"$root/.venv/bin/mypyc" --ignore-missing-imports "${modules[@]}" >build.log 2>&1 || {
    echo "mypyc failed; see $out/build.log" >&2
    exit 1
}
rm -rf build
ls kvcached/ledger/*.so >/dev/null
