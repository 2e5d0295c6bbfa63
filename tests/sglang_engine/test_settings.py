"""The reserve and floor settings, honoured under SGLang as under vLLM.

``KVCACHED_MIN_RESERVED_PAGES`` / ``KVCACHED_MAX_RESERVED_PAGES`` (empty pages kept mapped after
requests end), ``KVCACHED_MAX_RESERVED_BYTES`` (the reserve within those bytes) and
``KVCACHED_MIN_KV_CACHE_MB`` (the floor a starting engine waits for on a shared budget), read by
SGLang's plugin (``plugin.config_from``) and applied by the engine through the same core
function as vLLM's (``kvcached.engine.reserve``).
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from kvcached.errors import KvcachedError, LimitRefusedError
from kvcached.service.config import service_config
from kvcached.settings import Settings
from kvcached.sglang.engine import SglangConfig
from kvcached.sglang.plugin import config_from
from kvcached.sglang.testing.stack import HiCacheStack

PAGE = 4096
PAGE_COST = PAGE * 4  # a page in each of 2 layers' K and V regions
SLOTS_A_PAGE = 64  # 2 heads x 8 x fp32 = 64 B a slot


def _config(env: dict[str, str], **machine: object) -> SglangConfig:
    """The plugin's config from ``env``, on this machine's host pages, without the live service."""
    served = config_from(Settings.from_env({"ENABLE_KVCACHED": "1", **env}))
    return msgspec.structs.replace(
        served, backend="host", page_bytes=PAGE, page_bytes_set=True, journal_service=None, clock=False, **machine
    )


def _reserve(stacks: list[HiCacheStack], env: dict[str, str]) -> tuple[int, int]:
    """Empty pages mapped (the padding page aside) before the first request, and once requests
    that took four pages have ended."""
    stack = HiCacheStack(_config(env))
    stacks.append(stack)
    stack.step()
    ahead = stack.mapped_pages - 1
    slots = stack.allocator.alloc(4 * SLOTS_A_PAGE)
    assert slots is not None
    stack.allocator.free(slots)
    stack.step()
    return ahead, stack.mapped_pages - 1


def test_the_reserve_pages_are_kept_as_set(stacks) -> None:
    assert _reserve(stacks, {"KVCACHED_MIN_RESERVED_PAGES": "0", "KVCACHED_MAX_RESERVED_PAGES": "0"}) == (0, 0)
    assert _reserve(stacks, {"KVCACHED_MIN_RESERVED_PAGES": "2", "KVCACHED_MAX_RESERVED_PAGES": "3"}) == (2, 3)


def test_the_reserve_stays_within_its_bytes(stacks) -> None:
    env = {"KVCACHED_MIN_RESERVED_PAGES": "3", "KVCACHED_MAX_RESERVED_PAGES": "3"}
    assert _reserve(stacks, env) == (3, 3)
    assert _reserve(stacks, {**env, "KVCACHED_MAX_RESERVED_BYTES": str(PAGE_COST)}) == (1, 1)


def test_the_floor_is_what_a_starting_engine_needs_of_the_budget(tmp_path, stacks) -> None:
    budget = {"budget": "floor", "budget_bytes": 8 * PAGE_COST, "budget_dir": str(tmp_path), "join_wait_s": 0.0}
    first = HiCacheStack(_config({}, **budget))  # its floor: the padding page
    stacks.append(first)
    assert first.engine.floor_pages == 1
    # A MiB is 64 pages of 16 KiB, asked of a budget of 8 (a claim is capped at the budget's
    # size) where the first engine holds 6: refused at once (no wait), naming the floor.
    with pytest.raises(KvcachedError, match="free for this engine's 128 KiB"):
        stacks.append(HiCacheStack(_config({"KVCACHED_MIN_KV_CACHE_MB": "1"}, **budget)))
    second = HiCacheStack(_config({}, **budget))  # without the setting, its one page fits
    stacks.append(second)
    assert second.engine.floor_pages == 1


def test_a_limit_below_the_floor_is_refused_unless_forced(tmp_path, stacks) -> None:
    """``kvctl limit`` under SGLang keeps the floor as under vLLM (``kvcached.engine.control``):
    below ``KVCACHED_MIN_KV_CACHE_MB`` only with ``--force``."""
    env = {"ENABLE_KVCACHED": "1", "KVCACHED_MIN_KV_CACHE_MB": "1"}  # 64 pages of 16 KiB
    live = service_config(Settings.from_env(env), str(tmp_path / "live.sock"))
    stack = HiCacheStack(msgspec.structs.replace(_config(env), journal_service=live))
    stacks.append(stack)
    control = stack.engine.control
    assert control is not None and control.memory().floor_pages == 64
    with pytest.raises(
        LimitRefusedError,
        match=r"below this engine's floor of 1 MiB "
        r"\(KVCACHED_MIN_KV_CACHE_MB is 1; SGLang's padding slot 0 keeps its page\)",
    ):
        control.set_limit(63 * PAGE_COST)
    assert control.memory().limit_pages != 63
    forced = threading.Thread(target=control.set_limit, args=(2 * PAGE_COST,), kwargs={"force": True})
    forced.start()
    for _ in range(6000):  # the scheduler's next step after the request applies it
        stack.step()
        if control.memory().limit_pages == 2:
            break
        time.sleep(0.01)
    forced.join()
    assert control.memory().limit_pages == 2
