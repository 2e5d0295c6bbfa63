"""Runs one case: a native server, then a kvcached one, each through the seed's phases and stop.

The servers are the end-to-end tests' (``kvcached.vllm.testing.e2e.Server``, SGLang's
``SglangServer``): one process group each on 127.0.0.1, its log in the case's folder, stopped by
SIGINT to the group and SIGKILL after 90 s, what is left of its tree recorded. They run one after
the other, so that a GPU holds one model at a time, as the seed's CI runs a case. On a CPU the KV
cache and the CPU tier have fixed sizes (the tiny models' 64 and 128 MiB); on a GPU the engine
sizes its KV cache from the case's flags and the CPU tier is ``cpu_tier_bytes``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from kvcached.vllm.testing.e2e import Completion, Server, ServerConfig

from . import checks, elastic, limit, phases
from .cases import Case


class Options(msgspec.Struct, frozen=True):
    out: Path
    on_cpu: bool
    python: dict[str, str]  # engine -> the interpreter that has it
    policy: str = "ledger"
    settings: dict[str, str] = {}  # KVCACHED_* for the kvcached servers
    exact: bool = False
    cpu_tier_bytes: int = 4 << 30
    ready_s: float = 900.0


MiB = 1 << 20
# The seed's server flags per engine on a GPU (its "Every ... server" lines), less what the
# server class already passes (host, port, seed, prompt-token details, cache report).
GPU_FLAGS = {
    "vllm": ("--enable-prefix-caching", "--async-scheduling", "--compilation-config.backend=eager"),
    "sglang": (),
}


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 onto 2 for a while: stdout is the check table's alone, and the tokenizer
    trainer (Rust, under ``tokenizers``) writes its progress to fd 1 itself."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def model_path(case: Case, models: Path) -> str:
    """The path (or Hugging Face id) the servers load; a tiny model is built under ``models`` once."""
    if not case.tiny:
        return case.model.path
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Writing model shards" bar
    with _stdout_to_stderr():
        return _build_tiny(case, models)


def _build_tiny(case: Case, models: Path) -> str:
    kind = case.model.path.removeprefix("tiny:")
    where = models / f"{case.engine}-{kind}"
    if kind == "llama":
        from kvcached.testing.tiny_model import build

        return str(build(where))
    if case.engine == "sglang" and kind == "deepseek_v2":
        from kvcached.sglang.testing.serve import tiny_mla

        return str(tiny_mla(where))
    from kvcached.testing.tiny_kinds import build as build_kind

    return str(build_kind(where, kind))


def _config(case: Case, model: str, kvcached: bool, opts: Options, journal: Path | None) -> ServerConfig:
    flags = [*case.flags, *case.model.flags]
    if case.tp > 1:
        flags += ["--tensor-parallel-size" if case.engine == "vllm" else "--tp-size", str(case.tp)]
    if case.kv_dtype:
        flags += ["--kv-cache-dtype", case.kv_dtype]
    if not kvcached:
        flags += case.native_flags
    if not opts.on_cpu:
        flags += GPU_FLAGS[case.engine]
    env: dict[str, str] = {}
    if kvcached:
        env = {"KVCACHED_LEDGER_POLICY": opts.policy, **dict(case.settings), **opts.settings}
        if journal is not None:
            env["KVCACHED_LEDGER_JOURNAL"] = str(journal)
            env["KVCACHED_DUMP_DIR"] = str(journal.parent / "dumps")
        if opts.on_cpu:
            env.setdefault("KVCACHED_BACKEND", "host")
    return ServerConfig(
        model=model,
        kvcached=kvcached,
        env=env,
        kv_cache_bytes=64 * MiB if opts.on_cpu else None,
        cpu_offload_bytes=128 * MiB if opts.on_cpu else opts.cpu_tier_bytes,
        max_model_len=2048 if case.tiny else 8192,
        extra_args=tuple(flags),
        enforce_eager=opts.on_cpu,
        on_cpu=opts.on_cpu,
    )


def _server(case: Case, config: ServerConfig, log: Path, opts: Options) -> Server:
    python = opts.python[case.engine]
    if case.engine == "sglang":
        from kvcached.sglang.testing.server import SglangServer

        return SglangServer(config, log, python=python)
    return Server(config, log, python=python)


def serve(case: Case, model: str, kvcached: bool, opts: Options) -> checks.Served:
    """Start one server, run the phases, stop it; never raises for what the server does."""
    label = f"{case.name}" if kvcached else case.name.replace("-kv", "-native", 1)
    folder = opts.out / label
    folder.mkdir(parents=True, exist_ok=True)
    journal = folder / "journal.kvj" if kvcached else None
    config = _config(case, model, kvcached, opts, journal)
    server = _server(case, config, folder / "serve.log", opts)
    (folder / "cmd.txt").write_text(" ".join(server.argv()) + "\n")
    done: dict[str, list[Completion]] = {}
    reset = alive = ready = False
    server.start()
    try:
        ready = server.wait_ready(opts.ready_s)
        if ready:
            done, reset = phases.run(server, phases.TINY if case.tiny else phases.SEED)
            alive = server.proc is not None and server.proc.poll() is None
    finally:
        server.stop()
    return checks.Served(
        case=label,
        engine=case.engine,
        kvcached=kvcached,
        ready=ready,
        phases=done,
        reset_ok=reset,
        alive_after_load=alive,
        exit_seconds=server.exit_seconds,
        left_behind=server.left_behind,
        log_before_stop=server.log(before_stop=True) if server.log_path.exists() else "",
    )


def run_case(case: Case, opts: Options, say: Callable[[str], None]) -> tuple[list[checks.Check], dict[str, object]]:
    """The case's checks and what it saw, for summary.json."""
    model = model_path(case, opts.out / "models")
    if case.scenario == "limit":
        return _run_limit(case, model, opts, say)
    if case.scenario == "elastic":
        return elastic.run(case, model, opts.out / case.name, opts.python, say)
    return _run_basic(case, model, opts, say)


def _run_basic(
    case: Case, model: str, opts: Options, say: Callable[[str], None]
) -> tuple[list[checks.Check], dict[str, object]]:
    """Native's server checks, then kvcached's, then the comparisons and the journal."""
    say(f"{case.name}: native server ({case.model.path})")
    native = serve(case, model, False, opts)
    say(f"{case.name}: kvcached server (policy {opts.policy})")
    ours = serve(case, model, True, opts)
    found = [*checks.server_checks(native), *checks.server_checks(ours)]
    found += checks.compare(case.name, native, ours, exact=opts.exact)
    journal = opts.out / case.name / "journal.kvj"
    if ours.ready:
        found.append(checks.journal_check(case.name, journal))
    return found, {"case": case, "servers": {s.case: {"ready": s.ready, "phases": s.phases} for s in (native, ours)}}


def python_for(engine: str) -> str:
    """The interpreter for ``engine``'s servers: ``KVCACHED_<ENGINE>_PYTHON`` if set, else this one."""
    return os.environ.get(f"KVCACHED_{engine.upper()}_PYTHON") or sys.executable


def _run_limit(
    case: Case, model: str, opts: Options, say: Callable[[str], None]
) -> tuple[list[checks.Check], dict[str, object]]:
    folder = opts.out / case.name
    folder.mkdir(parents=True, exist_ok=True)
    journal = folder / "journal.kvj"

    def server_for(env: dict[str, str]) -> Server:
        config = _config(case, model, True, opts, journal)
        config.env.update(env)
        server = _server(case, config, folder / "serve.log", opts)
        (folder / "cmd.txt").write_text(" ".join(server.argv()) + "\n")
        return server

    found, part = limit.run(case, server_for, say)
    if found[0].ok:  # the server started
        found.append(checks.journal_check(case.name, journal))
    return found, part
