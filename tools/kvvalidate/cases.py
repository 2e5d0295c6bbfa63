"""The validation matrix as data: kvcached PR #598's cases (its GPU CI, ``seed-basic`` and
``seed-weekly``) and this machine's (``cpu``: tiny random-weight models of the same kinds).

A case is one engine serving one model under kvcached, compared with a native server of the same
engine launched with the same flags (the seed: "each kvcached case is compared with the native case
of the same engine and model"). The seed's ``kv_c1``/``kv_c0`` pair (contiguous and non-contiguous
KV layout) is one case here: kvcached follows the layout of the KV tensors the engine allocates
(``kvcached.settings.SCOPES``, ``KVCACHED_CONTIGUOUS_LAYOUT``), so under either engine there is one
kvcached layout to validate, the engine's own.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

Engine = Literal["vllm", "sglang"]


class Model(msgspec.Struct, frozen=True):
    """A model the cases serve: a Hugging Face id at the seed's revision, or ``tiny:KIND`` (a
    random-weight model of that kind, built here by ``kvcached.testing``)."""

    short: str  # the seed's short name, used in case names (qwen05b, dsv2lite, ...)
    path: str
    revision: str = ""
    kind: str = "full attention"  # what the engine builds for it, in words
    flags: tuple[str, ...] = ()  # both engines (e.g. --trust-remote-code)


class Case(msgspec.Struct, frozen=True):
    name: str
    engine: Engine
    model: Model
    flags: tuple[str, ...]  # the seed's case flags, kvcached and native alike
    tp: int = 1
    kv_dtype: str = ""  # "" is the model's dtype; else the engine's --kv-cache-dtype value
    native_flags: tuple[str, ...] = ()  # the native server's alone (vLLM's Qwen3.5 --block-size 1024)
    gpu_only: str = ""  # why the CPU path cannot serve it ("" where it can)
    known: str = ""  # a limit kvcached has today that makes the case fail, in one line
    scenario: Literal["basic", "limit", "elastic"] = "basic"  # which of the seed's tests
    partner: str = ""  # the elastic case's server B's engine (A's is ``engine``)
    # KVCACHED_* the kvcached server gets (before --set's): a tiny model's page size, so that a
    # page holds a block or a few, as a 2 MiB page holds a real model's, and memory can move.
    settings: tuple[tuple[str, str], ...] = ()

    @property
    def tiny(self) -> bool:
        return self.model.path.startswith("tiny:")


def _m(short: str, path: str, revision: str, kind: str, *flags: str) -> Model:
    return Model(short, path, revision, kind, flags)


# The seed's models (its "Cases" table: id @ revision).
QWEN05B: Final = _m("qwen05b", "Qwen/Qwen2.5-0.5B-Instruct", "7ae5576", "full attention")
QWEN35_4B: Final = _m("qwen35_4b", "Qwen/Qwen3.5-4B", "851bf6e", "8 full + 24 Gated DeltaNet layers")
GEMMA4E2B: Final = _m("gemma4e2b", "google/gemma-4-E2B-it", "3e22461", "full + sliding window, cross-layer KV sharing")
DSV2LITE: Final = _m("dsv2lite", "deepseek-ai/DeepSeek-V2-Lite-Chat", "8586474", "MLA", "--trust-remote-code")
GEMMA4_12B: Final = _m("gemma4_12b", "google/gemma-4-12B-it", "707f0a3", "full + sliding window")
QWEN35_9B: Final = _m("qwen35_9b", "Qwen/Qwen3.5-9B", "c202236", "8 full + 24 Gated DeltaNet layers")

# The seed's case flags per engine and batch limit.
_VLLM = ("--dtype", "bfloat16", "--max-model-len", "8192")
_SGLANG = ("--dtype", "bfloat16", "--context-length", "8192")
_SGLANG_HYBRID = "SGLang's hybrid pools (sliding window, linear attention) are refused by kvcached here"


def _vllm(model: Model, seqs: int, util: str) -> tuple[str, ...]:
    return (*_VLLM, "--max-num-seqs", str(seqs), "--gpu-memory-utilization", util)


def _sglang(model: Model, seqs: int, frac: str) -> tuple[str, ...]:
    return (*_SGLANG, "--max-running-requests", str(seqs), "--mem-fraction-static", frac)


def _gpu_case(engine: Engine, model: Model, *, tp: int = 1, kv_dtype: str = "") -> Case:
    small = model is QWEN05B
    seqs = 32 if small else 16
    if engine == "vllm":
        flags = _vllm(model, seqs, "0.8" if small else "0.9")
        native = ("--block-size", "1024") if model.short.startswith("qwen35") else ()
    else:
        flags = _sglang(model, seqs, "0.8" if small else "0.85")
        native = ()
    suffix = (f"-tp{tp}" if tp > 1 else "") + ("-fp8kv" if kv_dtype else "")
    hybrid = engine == "sglang" and model.short.startswith(("qwen35", "gemma4"))
    return Case(
        name=f"{engine}-{model.short}-kv{suffix}",
        engine=engine,
        model=model,
        flags=flags,
        tp=tp,
        kv_dtype=kv_dtype,
        native_flags=native,
        gpu_only="the real model's weights and CUDA kernels",
        known=_SGLANG_HYBRID if hybrid else "",
    )


# MiB of one page per layer region holding a block of the tiny model (tests/serve/test_model_kinds.py
# sizes them alike): vLLM's llama block is 128 tokens x 2 KiB per layer, SGLang's region is K or V.
_TINY_PAGE_MB = {
    ("vllm", "llama"): "0.25",
    ("sglang", "llama"): "0.125",
    ("vllm", "qwen2"): "0.0625",
    ("vllm", "gemma3"): "0.0625",
    ("vllm", "gpt_oss"): "0.0625",
    ("vllm", "mistral"): "0.0625",
    ("vllm", "qwen3_next"): "0.125",
    ("vllm", "deepseek_v2"): "0.140625",
}


def _tiny(engine: Engine, kind: str, what: str) -> Case:
    page = _TINY_PAGE_MB.get((engine, kind))
    settings = (("KVCACHED_PAGE_SIZE_MB", page),) if page else ()
    model = Model(f"tiny_{kind}", f"tiny:{kind}", kind=what)
    return Case(f"{engine}-tiny_{kind}-kv", engine, model, (), settings=settings)


def _fp8(case: Case, dtype: str, page_mb: str) -> Case:
    """``case`` with an fp8 KV cache: half the bytes per block, so half the page for one block."""
    name = f"{case.name}-fp8kv"
    return msgspec.structs.replace(case, name=name, kv_dtype=dtype, settings=(("KVCACHED_PAGE_SIZE_MB", page_mb),))


def _limit(case: Case) -> Case:
    """The seed's limit case on ``case``'s engine, model and flags: one kvcached server."""
    name = f"limit-{case.engine}-{case.model.short}"
    return msgspec.structs.replace(case, name=name, scenario="limit", known="", native_flags=())


def _elastic(a: Engine, b: Engine) -> Case:
    """The seed's elastic case at tiny scale (``kvcached.sglang.testing.mixed``): A and B on one budget."""
    tiny = Model("tiny_llama", "tiny:llama", kind="full attention")
    name = f"elastic-{a}-tiny_llama+{b}-tiny_llama"
    return Case(name, a, tiny, (), scenario="elastic", partner=b)


MATRICES: Final[dict[str, tuple[Case, ...]]] = {
    # The seed's basic correctness run: both engines, three models, TP 1, the model's dtype.
    "seed-basic": tuple(
        _gpu_case(engine, model) for engine in ("sglang", "vllm") for model in (QWEN05B, QWEN35_4B, GEMMA4E2B)
    ),
    # The seed's weekly run: TP 2 (two GPUs) and fp8 KV cache.
    "seed-weekly": (
        *(_gpu_case("vllm", m, tp=2) for m in (QWEN05B, DSV2LITE, GEMMA4_12B, QWEN35_9B)),
        *(_gpu_case("sglang", m, tp=2) for m in (QWEN05B, DSV2LITE, QWEN35_9B)),
        _gpu_case("vllm", QWEN05B, kv_dtype="fp8"),
        _gpu_case("sglang", QWEN05B, kv_dtype="fp8_e4m3"),
    ),
    # The seed's limit cases: one kvcached server, its limit lowered under load and restored.
    "seed-limit": tuple(_limit(_gpu_case(engine, QWEN05B)) for engine in ("sglang", "vllm")),
    # What this machine serves: tiny models of the seed's kinds, on each engine's CPU path.
    "cpu": (
        _tiny("vllm", "llama", "full attention"),
        _tiny("sglang", "llama", "full attention"),
        _tiny("vllm", "qwen2", "full attention, Qwen2"),
        _tiny("vllm", "gemma3", "full + sliding window"),
        _tiny("vllm", "gpt_oss", "full + sliding window, MoE"),
        _tiny("vllm", "mistral", "sliding window"),
        _tiny("vllm", "deepseek_v2", "MLA"),
        _tiny("vllm", "qwen3_next", "full + Gated DeltaNet"),
        _tiny("sglang", "deepseek_v2", "MLA"),
        _fp8(_tiny("vllm", "llama", "full attention"), "fp8", "0.125"),
        _fp8(_tiny("sglang", "llama", "full attention"), "fp8_e4m3", "0.0625"),
        _limit(_tiny("vllm", "llama", "full attention")),
        _limit(_tiny("sglang", "llama", "full attention")),
        _elastic("vllm", "sglang"),
        _elastic("sglang", "sglang"),
        _elastic("vllm", "vllm"),
    ),
}


def find(names: list[str]) -> list[Case]:
    """The cases called ``names`` (a case's name or a matrix's), in order, each once; a name that
    is neither raises ``KeyError`` naming it."""
    by_name = {c.name: c for cases in MATRICES.values() for c in cases}
    out: list[Case] = []
    for name in names:
        found = MATRICES.get(name) or ((by_name[name],) if name in by_name else None)
        if found is None:
            raise KeyError(name)
        out += [c for c in found if c not in out]
    return out
