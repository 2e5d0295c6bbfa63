#!/usr/bin/env bash
# Compile the ledger's hot path with mypyc into DIR (a copy of the package), without touching
# the work tree. Used by the benchmark (pure vs compiled, side by side) and by the test
# command (the ledger's tests run against the compiled build too).
set -euo pipefail
out=${1:?usage: build-compiled.sh DIR}
root="$(cd "$(dirname "$0")/.." && pwd)"
rm -rf "$out" && mkdir -p "$out"
cp -r "$root/kvcached" "$out/"
find "$out" -name '__pycache__' -prune -exec rm -rf {} +
cd "$out"
"$root/.venv/bin/mypyc" kvcached/ledger/ledger.py kvcached/ledger/checks.py kvcached/ledger/tables.py \
    kvcached/ledger/queries.py >build.log 2>&1 || {
    echo "mypyc failed; see $out/build.log" >&2
    exit 1
}
rm -rf build
ls kvcached/ledger/*.so >/dev/null
