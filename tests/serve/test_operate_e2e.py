"""Operating a real ``vllm serve`` (vLLM's CPU build): kvctl, a limit under load, /metrics, SIGKILL.

One kvcached server with the journal off (the default: the live service, its replica and the
flight recorder run anyway) and one native server with the same flags. While the kvcached one
serves, ``kvctl`` (a separate process, as an operator runs it) finds it, answers ``status``,
``pins`` and ``why``; ``kvctl limit`` halves its KV memory while a request runs: the worker's
resident memory follows, no request fails, and every completion equals native vLLM's (greedy
tokens, top-5 logprobs). The limit is raised back, ``/metrics`` shows kvcached's series
agreeing with ``kvctl status --json``, and after a SIGKILL ``kvctl list`` reports nothing alive.
The legacy server's flight-recorder dump is checked in test_serve_e2e.py, on its validation run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvcached.testing.tiny_model import build, corpus
from kvcached.vllm.testing.e2e import ERROR_SIGNATURES, Completion, Server, ServerConfig, kv_resident_bytes, rss_bytes

pytestmark = pytest.mark.vllm

MiB = 1 << 20
KV = 128 * MiB
API_KEY = "operate-key"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build(tmp_path_factory.mktemp("tiny-llama-op")))


def _kvctl_run(runtime: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("KVCACHED_LEDGER_SOCKET", None)
    return subprocess.run(
        [sys.executable, "-m", "kvctl.cli", *argv], capture_output=True, text=True, env=env, timeout=60
    )


def _kvctl(runtime: Path, *argv: str, check: bool = True) -> Any:
    r = _kvctl_run(runtime, *argv)
    if check:
        assert r.returncode == 0, r.stderr
    if "--json" in argv:
        return json.loads(r.stdout)
    return r.stdout


def _fill_prompts() -> list[str]:
    # ~1,200 distinct tokens each: a few fill the 128 MiB KV cache, then stay in the prefix cache.
    return [" ".join(corpus(80, seed=300 + i))[:5000] for i in range(8)]


def _steady_prompts() -> list[tuple[str, int]]:
    return [(" ".join(corpus(20, seed=500 + i))[:1200], 8) for i in range(10)]


def _series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, value = line.rpartition(" ")
            out[labels] = float(value)
    return out


def _serve(model: str, out: Path, kvcached: bool, runtime: Path) -> tuple[list[Completion], dict[str, Any]]:
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    if kvcached:
        env.update(KVCACHED_MIN_RESERVED_PAGES="0", KVCACHED_MAX_RESERVED_PAGES="0", KVCACHED_DUMP_DIR=str(out))
        env.update(VLLM_PLUGINS="kvcached")  # and kvctl's status and limit over HTTP (api_server.http)
    cfg = ServerConfig(
        model=model,
        kvcached=kvcached,
        env=env,
        kv_cache_bytes=KV,
        cpu_offload_bytes=16 * MiB,
        api_key=API_KEY if kvcached else None,
    )
    seen: dict[str, Any] = {}
    outputs: list[Completion] = []
    server = Server(cfg, out / f"operate-{'kvcached' if kvcached else 'native'}.log").start()
    try:
        assert server.wait_ready(), server.log()[-3000:]
        worker = server.worker_pid()
        seen["rss_start"], seen["kv_start"] = rss_bytes(worker), kv_resident_bytes(worker)
        for p in _fill_prompts():
            outputs.append(server.complete(p, 2))
        seen["rss_full"], seen["kv_full"] = rss_bytes(worker), kv_resident_bytes(worker)
        steady = _steady_prompts()
        for i, (p, n) in enumerate(steady):
            if kvcached and i == 2:
                # Under load: a request runs while the operator halves the limit.
                done: list[Completion] = []

                def one(p: str = p, n: int = n, done: list[Completion] = done) -> None:
                    done.append(server.complete(p, n))

                t = threading.Thread(target=one)
                t.start()
                time.sleep(0.05)
                seen["limit"] = _kvctl(runtime, "limit", str(_engine_pid(runtime)), f"{KV // 2 // MiB}M", "--json")
                seen["status_during"] = _kvctl(runtime, "status", "--json")
                seen["pins_during"] = _kvctl(runtime, "pins", "--json")
                seen["list_during"] = _kvctl(runtime, "list", "--json")
                t.join()
                outputs += done
                continue
            outputs.append(server.complete(p, n))
        if kvcached:
            time.sleep(1.0)
            seen["rss_limited"], seen["kv_limited"] = rss_bytes(worker), kv_resident_bytes(worker)
            seen["status_limited"] = _kvctl(runtime, "status", "--json")
            seen["too_low"] = _kvctl_run(runtime, "limit", "1M")  # below one request of max_model_len
            seen["status_after_refusal"] = _kvctl(runtime, "status", "--json")
            seen["why"] = _kvctl(runtime, "why", "0", "--json")
            seen["raised"] = _kvctl(runtime, "limit", "none", "--json")
            # The same over HTTP on vLLM's port, behind its --api-key: the engine's own answers.
            seen["http_unauthorized"] = server.get("/v1/kvcached/status", auth=False)
            seen["http_status"] = server.get("/v1/kvcached/status")
            seen["http_too_low"] = server.post("/v1/kvcached/limit", {"size": "1M"})
            seen["http_limit"] = server.post("/v1/kvcached/limit", {"size": f"{KV // 2 // MiB}M", "engine": 0})
            seen["status_http_limited"] = _kvctl(runtime, "status", "--json")
            seen["http_raised"] = server.post("/v1/kvcached/limit", {"size": "none"})
            outputs += [server.complete(p, n) for p, n in steady[:3]]
            time.sleep(0.5)
            with urllib.request.urlopen(server.url + "/metrics", timeout=10) as r:
                seen["metrics"] = r.read().decode()
            seen["status_idle"] = _kvctl(runtime, "status", "--json")
            seen["log"] = server.log()
            assert server.proc is not None
            os.killpg(server.proc.pid, signal.SIGKILL)  # what a crash or the OOM killer does
            server.proc.wait()
            time.sleep(1.0)
            seen["list_after_kill"] = _kvctl(runtime, "list", "--json")
            seen["list_all_after_kill"] = _kvctl(runtime, "list", "--all", "--json")
        else:
            outputs += [server.complete(p, n) for p, n in steady[:3]]
    finally:
        server.stop()
    return outputs, seen


def _engine_pid(runtime: Path) -> int:
    engines = _kvctl(runtime, "list", "--json")
    assert len(engines) == 1, engines
    return int(engines[0]["status"]["pid"])


@pytest.fixture(scope="module")
def served(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("operate")
    runtime = tmp_path_factory.mktemp("rt")  # XDG_RUNTIME_DIR of both servers and kvctl: no other engine seen
    native, _ = _serve(model, out, False, runtime)
    ours, seen = _serve(model, out, True, runtime)
    return {"native": native, "kvcached": ours, "seen": seen}


def test_kvctl_finds_and_answers_a_served_engine(served: dict[str, Any]) -> None:
    seen = served["seen"]
    (engine,) = seen["list_during"]
    st = engine["status"]
    assert engine["alive"] and "tiny-llama" in st["engine"]["model"] and st["engine"]["port"] is not None
    assert st["journal"]["state"] == "off" and st["ledger"] is not None  # the replica runs without a journal
    assert seen["status_during"]["memory"]["limit_bytes"] <= KV // 2
    assert "rows" in seen["pins_during"]
    assert "page" in json.dumps(seen["why"])


def test_a_halved_limit_under_load_gives_memory_back_and_changes_no_output(served: dict[str, Any]) -> None:
    seen, native, ours = served["seen"], served["native"], served["kvcached"]
    assert all(c.ok for c in ours), [c.status for c in ours]
    for i, (a, b) in enumerate(zip(native, ours, strict=True)):
        assert b.tokens == a.tokens, f"request {i}: {b.text!r} != native {a.text!r}"
        assert b.max_logprob_diff(a) == 0.0, f"request {i}: top-5 logprobs differ"
    full, limited = seen["kv_full"], seen["kv_limited"]
    rss = [seen[k] // MiB for k in ("rss_start", "rss_full", "rss_limited")]
    print(
        f"worker KV resident MiB: start {seen['kv_start'] // MiB}, full {full // MiB}, "
        f"after a limit of {KV // 2 // MiB} MiB: {limited // MiB}; whole RSS MiB: {rss}"
    )
    assert full > KV // 2, "the load did not fill the KV cache beyond the limit"
    mem = seen["status_limited"]["memory"]
    assert not mem["shrink_pending"] and mem["mapped_bytes"] <= KV // 2, mem
    # The worker's own KV memory, not the scheduler's opinion of it: what its mappings hold.
    assert limited <= KV // 2, "the worker's memory did not follow the limit"
    assert seen["raised"]["limit_bytes"] >= KV - mem["page_bytes"]


def test_a_limit_below_one_request_is_refused_and_changes_nothing(served: dict[str, Any]) -> None:
    """A served engine's floor is what one request of its max_model_len needs (vLLM's
    own count per KV cache group); a limit under it is one line and exit 1, and the limit stays."""
    seen = served["seen"]
    mem = seen["status_limited"]["memory"]
    assert mem["floor_bytes"] > 1 * MiB and "one request of max_model_len" in mem["floor_why"], mem
    r = seen["too_low"]
    assert r.returncode == 1 and r.stdout == "" and r.stderr.count("\n") == 1, (r.returncode, r.stderr)
    assert "1 MiB is below this engine's floor of" in r.stderr and "--force" in r.stderr
    assert seen["status_after_refusal"]["memory"]["limit_bytes"] == mem["limit_bytes"]


def test_metrics_carry_kvcached_series_that_agree_with_kvctl(served: dict[str, Any]) -> None:
    seen = served["seen"]
    text, st = seen["metrics"], seen["status_idle"]
    mapped = _series(text, "vllm:kvcached_mapped_bytes")
    assert len(mapped) == 1 and next(iter(mapped.values())) == st["memory"]["mapped_bytes"], (mapped, st["memory"])
    limit = _series(text, "vllm:kvcached_memory_limit_bytes")
    assert next(iter(limit.values())) == st["memory"]["limit_bytes"]
    assert _series(text, "vllm:kvcached_engine_up") and _series(text, "vllm:kvcached_page_maps_total")
    assert "vllm:kvcached_pages{" in text and 'state="in_use"' in text
    bad = [line for line in seen["log"].splitlines() if ERROR_SIGNATURES.search(line)]
    assert not bad, bad[:5]


def test_a_killed_engine_is_not_listed_as_alive(served: dict[str, Any]) -> None:
    seen = served["seen"]
    assert seen["list_after_kill"] == []
    assert [e["alive"] for e in seen["list_all_after_kill"]] == [False]


def test_status_and_limit_over_http_are_behind_vllm_s_api_key_and_are_the_engine_s(served: dict[str, Any]) -> None:
    seen = served["seen"]
    assert seen["http_unauthorized"][0] == 401  # vLLM's own middleware guards /v1
    code, status = seen["http_status"]
    assert code == 200, status
    (row,) = status["engines"]
    assert row["up"] and "tiny-llama" in row["engine"]["model"] and row["engine"]["index"] == 0
    assert row["memory"]["num_pages"] == seen["status_limited"]["memory"]["num_pages"]
    code, refused = seen["http_too_low"]
    assert code == 409 and "below this engine's floor" in refused["error"], refused
    code, limited = seen["http_limit"]
    assert code == 200, limited
    (mine,) = limited["engines"]
    assert mine["memory"]["limit_pages"] * mine["memory"]["page_bytes"] <= KV // 2
    assert seen["status_http_limited"]["memory"]["limit_bytes"] <= KV // 2  # kvctl sees what HTTP set
    code, raised = seen["http_raised"]
    assert code == 200 and raised["engines"][0]["memory"]["limit_pages"] == row["memory"]["num_pages"], raised
