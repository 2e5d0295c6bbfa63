"""The seed's limit case: an operator lowers a kvcached server's limit, and it holds.

kvcached PR #598's "Limit tests", on one kvcached server: 3 greedy probes; a fill (24 distinct
1,500-word prompts, one output token, 8 at a time); the limit lowered to the idle usage plus a
quarter of what the fill added; a load under it (100 distinct 150-word prompts, 16 output tokens,
8 at a time, then 4 distinct 1,200-word prompts one at a time); the limit restored and the fill
repeated with new prompts; the probes again. The KV usage is the engine's own count of mapped
pages, asked over its ledger socket as ``kvctl status`` asks (``kvcached.service.live``), sampled
every 0.2 s while the load runs.

NOTE: kvcached refuses a limit below an engine's floor (one request of ``max_model_len``) unless
forced; where the seed's target is below it (a tiny model's cache is a few floors), the limit is
forced and the check's detail says so. ``limit_released_idle`` waits for the condition (the usage
within the limit) up to ``RELEASE_S``, longer than the seed's 30 s because this machine may be
loaded, and reports the seconds it took.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

import msgspec

from kvcached.service import live, messages
from kvcached.vllm.testing.e2e import Completion, Server

from . import checks, phases
from .cases import Case

RELEASE_S: Final = 120.0
SAMPLE_S: Final = 0.2


class Words(msgspec.Struct, frozen=True):
    fill: int
    short: int
    long: int
    probe_tokens: int


SEED: Final = Words(fill=1500, short=150, long=1200, probe_tokens=32)
TINY: Final = Words(fill=250, short=25, long=200, probe_tokens=8)


def _status(sock: str) -> messages.MemoryStatus:
    reply = live.request(sock, messages.Request(op="status"), timeout=30)
    assert isinstance(reply, messages.StatusReply) and reply.memory is not None
    return reply.memory


def _limit(sock: str, size: int | None, force: bool) -> messages.MemoryStatus:
    req = messages.Request(op="limit", size=-1 if size is None else size, force=force)
    reply = live.request(sock, req, timeout=60)
    assert isinstance(reply, messages.LimitReply)
    return reply.memory


def _burst(server: Server, prompts: list[tuple[str, int]], at_once: int) -> list[Completion]:
    with ThreadPoolExecutor(at_once) as pool:
        return list(pool.map(lambda pn: server.complete(*pn, logprobs=0), prompts))


def _prompts(tag: str, n: int, words: int, tokens: int) -> list[tuple[str, int]]:
    return [(phases.filler(words, f"{tag} {i}"), tokens) for i in range(n)]


class _Sampler(threading.Thread):
    """The largest mapped size seen while a load runs."""

    def __init__(self, sock: str) -> None:
        super().__init__(daemon=True)
        self.sock, self.peak, self.errors = sock, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.peak = max(self.peak, _status(self.sock).mapped_bytes)
            except live.LiveViewError:
                self.errors += 1
            self.done.wait(SAMPLE_S)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def run(
    case: Case, server_for: Callable[[dict[str, str]], Server], say: Callable[[str], None]
) -> tuple[list[checks.Check], dict[str, object]]:
    """The limit case on the server ``server_for(extra_env)`` makes; its checks and summary part."""
    words = TINY if case.tiny else SEED
    runtime = tempfile.mkdtemp(prefix="kvv-")  # short: a Unix socket path has 108 bytes
    sock = os.path.join(runtime, "ledger.sock")
    server = server_for({"KVCACHED_LEDGER_SOCKET": sock})
    name = case.name
    found: list[checks.Check] = []
    seen: dict[str, object] = {}

    def check(check_name: str, ok: bool, detail: str = "") -> None:
        found.append(checks.Check(name, check_name, ok, detail))

    probes = _prompts("probe", 3, 40, words.probe_tokens)
    say(f"{name}: kvcached server, the limit case")
    server.start()
    alive = False
    try:
        ready = server.wait_ready(900.0)
        check("server_ready", ready)
        if ready:
            before = [server.complete(p, n) for p, n in probes]
            idle = _status(sock).mapped_bytes
            fill = _burst(server, _prompts("fill", 24, words.fill, 1), 8)
            filled = _status(sock)
            grew = filled.mapped_bytes - idle
            check(
                "limit_cache_filled",
                all(c.ok for c in fill) and grew > 0,
                f"{_mib(idle)} -> {_mib(filled.mapped_bytes)}",
            )
            target = idle + max(grew, 0) // 4
            force = target < filled.floor_bytes
            try:
                lowered = _limit(sock, target, force)
                set_ok = True
            except live.LiveViewError as e:
                lowered, set_ok = filled, False
                seen["limit_error"] = str(e)
            forced = f", forced below the floor of {_mib(filled.floor_bytes)}" if force else ""
            # What the usage is judged against is what was asked, in whole pages; an engine whose
            # own limit is not that one fails limit_set rather than being judged by its own word.
            page = filled.page_bytes
            limit = min(lowered.limit_bytes, -(-target // page) * page)
            if set_ok and abs(lowered.limit_bytes - target) >= page:
                set_ok = False
                seen["limit_error"] = f"asked {_mib(target)}, the engine's limit is {_mib(lowered.limit_bytes)}"
            t0 = time.monotonic()
            st = _status(sock)
            while st.mapped_bytes > limit and time.monotonic() - t0 < RELEASE_S:
                time.sleep(0.3)
                st = _status(sock)
            took = time.monotonic() - t0
            check(
                "limit_released_idle",
                set_ok and st.mapped_bytes <= limit,
                f"{_mib(st.mapped_bytes)} of a {_mib(limit)} limit{forced}, after {took:.1f} s",
            )
            sampler = _Sampler(sock)
            sampler.start()
            load = _burst(server, _prompts("short", 100, words.short, 16), 8)
            load += [server.complete(p, n, logprobs=0) for p, n in _prompts("long", 4, words.long, 16)]
            sampler.done.set()
            sampler.join()
            check("limit_requests_ok", all(c.ok for c in load), f"{sum(not c.ok for c in load)} of {len(load)} failed")
            held = sampler.peak <= limit and sampler.errors == 0
            check("limit_held_under_load", set_ok and held, f"peak {_mib(sampler.peak)} of {_mib(limit)}")
            try:
                _limit(sock, None, False)
            except live.LiveViewError as e:
                set_ok = False
                seen["restore_error"] = str(e)
            check("limit_set", set_ok, str(seen.get("limit_error") or seen.get("restore_error") or ""))
            again = _burst(server, _prompts("refill", 24, words.fill, 1), 8)
            regrown = _status(sock).mapped_bytes
            check(
                "limit_raised_regrows",
                all(c.ok for c in again) and regrown > limit,
                f"{_mib(regrown)} after the refill",
            )
            after = [server.complete(p, n) for p, n in probes]
            same = [a.tokens == b.tokens and a.ok for a, b in zip(before, after, strict=True)]
            check("probe_unchanged", all(same), f"{same.count(False)} of 3 probes changed")
            alive = server.proc is not None and server.proc.poll() is None
            check("server_alive", alive)
            seen.update(idle=idle, filled=filled.mapped_bytes, limit=limit, peak=sampler.peak, regrown=regrown)
    finally:
        server.stop()
        with contextlib.suppress(OSError):
            os.rmdir(runtime)  # the engine removes its socket on a clean exit; else the folder stays
    shut = checks.Served(
        case=name,
        engine=case.engine,
        kvcached=True,
        ready=False,
        phases={},
        reset_ok=False,
        alive_after_load=alive,
        exit_seconds=server.exit_seconds,
        left_behind=server.left_behind,
        log_before_stop=server.log(before_stop=True) if server.log_path.exists() else "",
    )
    found += checks.shutdown_checks(shut)
    return found, {"case": case, "bytes": seen}
