#!/usr/bin/env bash
# The release as a user gets it: `python -m build` makes the sdist and, from it, the wheel; the wheel is installed
# (not editable, with the `replay` extra) into a fresh venv and the tools run from there: kvreplay checks a golden
# trace, kvsim and kvctl answer. Twice: with the C compiler (the hot path must be compiled) and with it hidden
# (CC=false: the build must fall back to pure Python with one loud line, and still install and run). The compiled
# pass also runs the sdist's own tests (the torch- and vLLM-free ones) against the installed wheel.
#   check-wheel.sh            both builds
#   check-wheel.sh compiled   or: pure
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TRACE=traces/finish-in-write-step.ledger.kvj
tmp=$(mktemp -d -t kvcached-wheel.XXXXXXXX)
trap 'rm -rf -- "$tmp"' EXIT

one() {  # one NAME [VAR=VALUE...]: build with the given environment, install, run the tools
    local name=$1 out=$tmp/$1 t0=$SECONDS
    shift
    mkdir -p "$out"
    # The sdist is made in the tree (its egg-info): under the lock scripts/_env.sh's editable installs take.
    if ! flock "$ROOT/.venv/.source-tree.lock" env "$@" "$ROOT/.venv/bin/python" -m build --outdir "$out/dist" "$ROOT" \
        >"$out/build.log" 2>&1; then
        tail -40 "$out/build.log" >&2
        echo "check-wheel: $name: python -m build failed" >&2
        return 1
    fi
    local whl sdist
    whl=$(ls "$out"/dist/*.whl)
    sdist=$(ls "$out"/dist/*.tar.gz)
    local built=$((SECONDS - t0))
    python3 -m venv "$out/venv"
    "$out/venv/bin/python" -m pip install -q "$whl[replay]" >"$out/install.log" 2>&1 || {
        cat "$out/install.log" >&2
        echo "check-wheel: $name: the wheel does not install" >&2
        return 1
    }
    # Run from elsewhere, so that nothing of the checkout can stand in for the installed package.
    (
        cd "$out"
        "$out/venv/bin/kvreplay" check "$ROOT/$TRACE" >/dev/null
        "$out/venv/bin/kvsim" --help >/dev/null
        "$out/venv/bin/kvctl" --version
        "$out/venv/bin/kvreplay" --version >/dev/null
        "$out/venv/bin/kvsim" --version >/dev/null
        "$out/venv/bin/kvvalidate" list seed-basic >/dev/null
        "$out/venv/bin/python" - "$name" "$whl" "$sdist" <<'PY'
import sys, tarfile, zipfile
name, whl, sdist = sys.argv[1:]
files = zipfile.ZipFile(whl).namelist()
need = ["kvcached/py.typed", "kvcached/__init__.pyi", "kvsim/on_vllm/execute.py", "kvreplay/cli.py",
        "kvctl/cli.py", "kvsim/cli.py", "kvvalidate/cli.py", "kvcached/vllm/engine_core/connector.py"]
missing = [n for n in need if n not in files]
licence = [n for n in files if n.endswith(".dist-info/licenses/LICENSE")]
assert not missing and licence, ("the wheel lacks", missing, "LICENSE" if not licence else "")
members = tarfile.open(sdist).getnames()
for part in ("traces/finish-in-write-step.ledger.kvj", "tests/test_layout.py", "scripts/import_graph.py", "LICENSE"):
    assert any(m.endswith(part) for m in members), f"the sdist lacks {part}"
from kvcached.ledger.compiled import compiled_status
slow = compiled_status()
assert (slow is None) == (name == "compiled"), (name, slow)
print(f"check-wheel: {name}: {'compiled' if slow is None else 'pure Python'}, wheel {len(files)} files")
PY
    )
    if [ "$name" = compiled ]; then
        sdist_tests "$out" "$sdist" || return 1
    fi
    if [ "$name" = pure ]; then
        grep -q "kvcached: building pure Python" "$out/build.log" || {
            echo "check-wheel: pure: the build did not say it fell back to pure Python" >&2
            return 1
        }
    fi
    echo "check-wheel: $name: built in ${built} s, wheel $(du -k "$whl" | cut -f1) KiB, installed and ran in $((SECONDS - t0 - built)) s"
}

sdist_tests() {  # sdist_tests OUT SDIST: the sdist's own tests (those needing neither torch nor vLLM) against the
    # installed wheel: pytest's script, not `python -m pytest`, so that the unpacked source is not on sys.path, and
    # KVCACHED_EXPECT_COMPILED=1 so that the session fails if anything but the compiled wheel was imported.
    local out=$1 sdist=$2 t0=$SECONDS src
    mkdir -p "$out/src"
    tar -xzf "$sdist" -C "$out/src"
    src=$(ls -d "$out"/src/*/)
    "$out/venv/bin/python" -m pip install -q "pytest>=8" "pytest-asyncio>=0.23" "hypothesis>=6.100" "pyyaml>=6" \
        >>"$out/install.log" 2>&1 || { cat "$out/install.log" >&2; return 1; }
    (cd "$src" && KVCACHED_EXPECT_COMPILED=1 "$out/venv/bin/pytest" -q -p no:cacheprovider -m "not vllm and not gpu" \
        --ignore=tests/serve --ignore=tests/vllm_scheduler --ignore=tests/vllm_upstream --ignore=tests/gpu \
        --ignore=tests/test_backend_host.py --ignore=tests/test_kv_cache_manager.py tests >"$out/sdist-tests.log" 2>&1) || {
        tail -30 "$out/sdist-tests.log" >&2
        echo "check-wheel: the sdist's tests failed against the installed wheel" >&2
        return 1
    }
    echo "check-wheel: the sdist's tests against the wheel: $(tail -1 "$out/sdist-tests.log" | tr -d '=') in $((SECONDS - t0)) s"
}

case ${1:-both} in
    compiled) one compiled ;;
    pure) one pure CC=false ;;
    both) one compiled && one pure CC=false ;;
    *) echo "usage: check-wheel.sh [compiled|pure|both]" >&2; exit 2 ;;
esac
