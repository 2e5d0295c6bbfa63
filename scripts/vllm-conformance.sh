#!/usr/bin/env bash
# vLLM's own tests (0.30.0 to 0.34.0) as kvcached's conformance suite: vLLM's tests of its block
# pool, KV cache managers, prefix caching, scheduler and OffloadingConnector, run in .venv-vllm
# twice: on vLLM alone, then with kvcached's page-aware pool and bridge under every BlockPool and
# Scheduler they build (tests/vllm_upstream/kvcached_conformance.py; known_failures.txt beside
# it lists what cannot pass, with why).
#
# vLLM's wheel holds no tests, so they come from vLLM's source distribution on the package index
# pip is configured with (pip's own finder and session: its index, extra indexes, find-links,
# certificates and proxy), checked against the sha256 below, fetched once
# into .cache/vllm-VERSION-tests/; only the test files listed here are extracted, and nothing of
# vLLM is kept in this repository. The runs are offline: HF_HUB_OFFLINE=1 with a stand-in hub
# config for facebook/opt-125m (the model vLLM's scheduler tests build their config from), and
# VLLM_TARGET_DEVICE=cpu (vLLM's CUDA wheel finds no device here otherwise).
#
# Usage: scripts/vllm-conformance.sh [alone|kvcached|both] [pytest args...]   (default: both)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
# The environment's vLLM decides the release whose tests run (KVCACHED_VLLM_PYTHON: another
# environment's interpreter, as scripts/compat.sh passes); each release's sdist is pinned here.
PY=${KVCACHED_VLLM_PYTHON:-$ROOT/.venv-vllm/bin/python}
sdist_sha256() {
    case $1 in
        0.33.0) echo f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112 ;;
        0.32.0) echo d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad ;;
        0.34.0) echo fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113 ;;
        0.31.0) echo dde46f1efbe846e5bd0c5c4ec6ec71842c42254c7ff3d9bebb2a57028715d380 ;;
        0.30.0) echo 5f8f4e890c042ffa1c3e103f81c35e2d96f60a0a175ac43a4adbae7006bef62b ;;
        *) return 1 ;;
    esac
}

MODE=${1:-both}
case $MODE in
    alone | kvcached | both) shift || true ;;
    -*) MODE=both ;;
    *)
        echo "vllm-conformance.sh: unknown mode '$MODE' (alone, kvcached or both)" >&2
        exit 2
        ;;
esac
if [ ! -x "$PY" ]; then
    echo "vllm-conformance.sh: $PY is missing; run scripts/test.sh once to build .venv-vllm" >&2
    exit 2
fi
VERSION=$("$PY" -c 'import vllm; print(vllm.__version__.split("+")[0])')
if ! SHA256=$(sdist_sha256 "$VERSION"); then
    echo "vllm-conformance.sh: no pinned source distribution for vLLM $VERSION (in $PY); add its sha256 here" >&2
    exit 2
fi
CACHE=.cache/vllm-$VERSION-tests

# What is extracted from the sdist: support files, then the tests run (all of each file).
SUPPORT=(
    pyproject.toml
    tests/__init__.py
    tests/utils.py
    tests/v1/__init__.py
    tests/v1/core/__init__.py
    tests/v1/core/utils.py
    tests/v1/kv_connector/__init__.py
    tests/v1/kv_connector/unit/__init__.py
    tests/v1/kv_connector/unit/conftest.py
    tests/v1/kv_connector/unit/utils.py
)
# vLLM's CUDA wheel finds no device here unless told it targets the CPU (0.34's CPU platform also
# asks for triton-cpu, which kvcached_conformance.py stands in for: these tests run no kernel).
DEVICE_ENV=(VLLM_TARGET_DEVICE=cpu)
# Support files a release's tests import beyond those (0.34's offloading tests: its spec-decode helpers).
case $VERSION in
    0.34.*) SUPPORT+=(tests/v1/spec_decode/__init__.py tests/v1/spec_decode/utils.py) ;;
esac
TESTS=(
    # the block pool and prefix caching
    tests/v1/core/prefix_cache/
    tests/v1/core/test_prefix_caching.py
    tests/v1/core/test_prefix_replay.py
    # the KV cache managers
    tests/v1/core/test_single_type_kv_cache_manager.py
    tests/v1/core/test_kv_sharing.py
    tests/v1/core/test_swa_inflight_window_free.py
    tests/v1/core/test_deferred_block_free.py
    tests/v1/core/test_mamba_align_chunk_split.py
    tests/v1/core/test_contiguous_kv_packing.py
    # the scheduler
    tests/v1/core/test_scheduler.py
    tests/v1/core/test_async_scheduler.py
    tests/v1/core/test_priority_preemption_bug.py
    tests/v1/core/test_priority_scheduler_random.py
    tests/v1/core/test_worker_slot_overflow.py
    tests/v1/core/test_scheduler_e2e.py
    tests/v1/core/test_reset_prefix_cache_e2e.py
    # the OffloadingConnector (its scheduler side and the spec it drives)
    tests/v1/kv_connector/unit/offloading_connector/
)
# Tests a release does not have yet (0.30's sdist has no prefix-replay test).
case $VERSION in
    0.30.*) TESTS=("${TESTS[@]/tests\/v1\/core\/test_prefix_replay.py/}") ;;
esac
TESTS=($(printf '%s\n' "${TESTS[@]}" | grep -v '^$'))

fetch() {
    local stamp=$CACHE/.complete
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$SHA256 ${SUPPORT[*]} ${TESTS[*]}" ]; then
        return 0
    fi
    echo "--- fetching vLLM $VERSION's tests from its source distribution (the index pip is configured with)"
    rm -rf "$CACHE.part"
    mkdir -p "$CACHE.part"
    "$PY" - "$VERSION" "$SHA256" "$CACHE.part" "${SUPPORT[@]}" "${TESTS[@]}" <<'EOF'
import hashlib, logging, sys, tarfile, tempfile
from pathlib import Path

logging.getLogger("pip").setLevel(logging.ERROR)  # its notes on index folders this machine lacks

version, sha256, dest, *wanted = sys.argv[1:]
name = f"vllm-{version}.tar.gz"
# NOTE: `pip download vllm==X --no-binary :all:` finds this file but then builds its metadata,
# which needs vLLM's whole build toolchain; pip's finder alone (what that command runs first,
# configured as it would be) gives the link without building anything.
try:
    from pip._internal.commands import create_command

    cmd = create_command("download")
    options, _ = cmd.parse_args(["--no-deps", "--no-binary", ":all:", f"vllm=={version}"])
    with cmd.main_context():
        session = cmd.get_default_session(options)
        finder = cmd._build_package_finder(options=options, session=session, ignore_requires_python=True)
        links = [c.link for c in finder.find_all_candidates("vllm") if c.link.filename == name]
        if not links:
            sys.exit(f"vllm-conformance.sh: the index pip is configured with does not serve {name}")
        url = links[0].url
        digest = hashlib.sha256()
        tmp = tempfile.TemporaryFile()
        with session.get(url, stream=True, timeout=600) as r:
            r.raise_for_status()
            for chunk in r.iter_content(1 << 20):
                digest.update(chunk)
                tmp.write(chunk)
except (ImportError, AttributeError, TypeError) as e:  # pip's internals moved
    sys.exit(f"vllm-conformance.sh: this pip's finder cannot be used ({type(e).__name__}: {e}); upgrade pip")
except OSError as e:  # requests' errors are OSErrors
    sys.exit(f"vllm-conformance.sh: downloading {name} failed: {e}")
with tmp:
    if digest.hexdigest() != sha256:
        sys.exit(f"vllm-conformance.sh: {name} from {url} has sha256 {digest.hexdigest()}, expected {sha256}")
    tmp.seek(0)
    prefix = f"vllm-{version}/"
    found = set()
    with tarfile.open(fileobj=tmp, mode="r:gz") as tar:
        for m in tar:
            rel = m.name[len(prefix):] if m.name.startswith(prefix) else None
            if rel is None or not m.isfile() or ".." in Path(rel).parts:
                continue
            hit = next((w for w in wanted if rel == w or (w.endswith("/") and rel.startswith(w))), None)
            if hit is None:
                continue
            found.add(hit)
            out = Path(dest, rel)
            out.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(m)
            assert src is not None
            out.write_bytes(src.read())
    missing = [w for w in wanted if w not in found]
    if missing:
        sys.exit(f"vllm-conformance.sh: {name} lacks {', '.join(missing)}")
EOF
    PYTHONPATH=$ROOT/tests/vllm_upstream "$PY" -c \
        'import sys, kvcached_conformance as k; k.write_hub_stand_in(sys.argv[1])' "$CACHE.part/hf"
    echo "$SHA256 ${SUPPORT[*]} ${TESTS[*]}" >"$CACHE.part/.complete"
    rm -rf "$CACHE"
    mv "$CACHE.part" "$CACHE"
}

run_pass() {
    local label=$1
    shift
    local start rc=0
    start=$(date +%s)
    echo "--- vLLM $VERSION's own tests: $label"
    (
        cd "$CACHE" &&
            env "${DEVICE_ENV[@]}" HF_HOME=$PWD/hf HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
                PYTHONPATH=$ROOT/tests/vllm_upstream \
                "$PY" -m pytest -q -p no:cacheprovider -p kvcached_conformance -rfE "$@" "${TESTS[@]}"
    ) || rc=$?
    echo "--- $label: exit $rc, $(($(date +%s) - start)) s"
    return $rc
}

fetch
case $MODE in
    alone) run_pass "vLLM alone" "$@" ;;
    kvcached) run_pass "with kvcached's page-aware pool and bridge" --kvcached "$@" ;;
    both)
        # The two passes share nothing but the files they read: at once, on a core each, their
        # output shown in order.
        logs=$(mktemp -d -t kvcached-conformance.XXXXXXXX)
        trap 'rm -rf -- "$logs"' EXIT
        rc=0 rc_alone=0
        run_pass "vLLM alone" "$@" >"$logs/alone" 2>&1 &
        alone=$!
        run_pass "with kvcached's page-aware pool and bridge" --kvcached "$@" >"$logs/kvcached" 2>&1 || rc=$?
        wait "$alone" || rc_alone=$?
        cat -- "$logs/alone" "$logs/kvcached"
        if [ "$rc_alone" -ne 0 ]; then
            exit "$rc_alone"
        fi
        exit "$rc"
        ;;
esac
