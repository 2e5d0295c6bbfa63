#!/usr/bin/env bash
# The memory backends' GPU checks, in one run on the GPU machine: the gpu-marked tests, then the map/unmap
# benchmark, everything teed into $OUT/gpu_check.log (the bench's JSON also lands in $OUT). Expects python3 with
# a CUDA torch, cuda-python (cuda-bindings) and pytest; needs no network and no msgspec. Takes well under a
# minute on an H200; each step has its own timeout so a hang cannot eat the device budget. The gpu tests include
# tests/gpu/test_step_channel_cuda.py: tensor parallel's CUDA path (two spawned rank processes, each on its own VMM
# range, following the scheduler's page decisions carried with each step), and tests/gpu/test_sglang_cuda.py: the
# SGLang engine's per-layer K and V on CUDA pages, a HiCache backup's copy on a side stream with a real CUDA event,
# pending across /flush_cache (legacy: unmapped under it; ledger: kept until the event is done). That one imports the
# ledger service, so it needs anyio beside msgspec: carry both (.whl/, for the image's python, e.g.
# `pip download msgspec anyio sniffio idna --only-binary :all: --python-version 3.12 -d .whl`). Where the image has
# SGLang itself, tests/sglang_engine runs too (kvcached under SGLang's own pool, allocator, host pool and controller).
#
# pytest runs with a throwaway ini and --noconftest on purpose: the project's pyproject options (asyncio_mode,
# plugins) and any conftest the CPU suite grows must not be able to break or skip this run.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export OUT
# msgspec (the ledger's one dependency) is not in the GPU image: install the wheels carried in .whl/.
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1
export KVCACHED_REQUIRE_GPU=1
PY="${PYTHON:-python3}"

main() {
    echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) in $PWD"
    nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv 2>&1 || true
    "$PY" - <<'PY'
import sys
import torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.is_available() and torch.cuda.get_device_name(0))
import numpy  # torch needs it to read __cuda_array_interface__
print("numpy", numpy.__version__)
import kvcached.backends
from kvcached.backends.cuda import load_driver
cu = load_driver()
import cuda.bindings
print("cuda-bindings", getattr(cuda.bindings, "__version__", "?"), "driver module", cu.__name__)
leaked = [m for m in ("msgspec", "kvcached.ledger") if m in sys.modules]
print("imports of kvcached.backends pull in:", leaked or "neither msgspec nor the ledger")
sys.exit(1 if leaked else 0)
PY
    local rc_env=$?

    echo "== pytest -m gpu tests/gpu"
    local ini
    ini="$(mktemp -d)/pytest.ini"
    printf '[pytest]\nmarkers =\n    gpu: needs a CUDA GPU and cuda-python\n' >"$ini"
    timeout 240 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider -c "$ini" --rootdir=. --noconftest -rs \
        --durations=5
    local rc_tests=$?

    echo "== SGLang's own classes (tests/sglang_engine), where the image has SGLang"
    local rc_sglang=0
    if "$PY" -c "import sglang.srt.managers.cache_controller" >/dev/null 2>&1; then
        timeout 300 "$PY" -m pytest -q tests/sglang_engine -p no:cacheprovider -c "$ini" --rootdir=. --noconftest -rs \
            -k "not serve"
        rc_sglang=$?
    else
        echo "SGLang is not in this image: tests/sglang_engine not run (tests/gpu/test_sglang_cuda.py ran above)"
    fi

    echo "== benchmarks/bench_backend_cuda.py"
    timeout 120 "$PY" benchmarks/bench_backend_cuda.py
    local rc_bench=$?

    echo "== gpu_check: env rc=$rc_env tests rc=$rc_tests sglang rc=$rc_sglang bench rc=$rc_bench"
    [ "$rc_env" -eq 0 ] && [ "$rc_tests" -eq 0 ] && [ "$rc_sglang" -eq 0 ] && [ "$rc_bench" -eq 0 ]
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
