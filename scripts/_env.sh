# Sourced by the README's commands: make .venv (once) with kvcached and what its tests need.
# torch is pinned to 2.13.0 because this machine kind carries its CPU wheel on disk; a plain
# `torch` would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.kvcached-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/_env.sh -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -m pip install -q -e '.[test,dev]' 2>&1 | grep -v '^WARNING: Location' || true
    .venv/bin/python -c 'import kvcached, kvreplay, msgspec, anyio, torch' 
    touch "$stamp"
fi
