#!/usr/bin/env bash
# Compile kvcached's hot path with mypyc into DIR (a copy of the package), without touching the
# work tree: the modules `pip install .` compiles (kvcached.ledger.compiled.COMPILED_MODULES, as
# setup.py reads it). Used by the benchmarks (pure vs compiled, side by side) and by the test
# command (the ledger's, the manager's and the page-aware pool's tests run against this build too).
#   build-compiled.sh DIR
set -euo pipefail
out=${1:?usage: build-compiled.sh DIR}
if [ -n "${2:-}" ]; then
    echo "usage: build-compiled.sh DIR" >&2
    exit 2
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
mapfile -t modules < <(cd "$root" && PYTHONDONTWRITEBYTECODE=1 .venv/bin/python -c 'import setup; print("\n".join(setup.compiled_sources()))')
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
ls kvcached/ledger/*.so kvcached/vllm/engine_core/*.so >/dev/null
