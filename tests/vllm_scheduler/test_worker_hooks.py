"""The worker's hooks against the installed vLLM's own functions.

vLLM 0.34's V2 runner calls ``allocate_kv_cache(cfg, device, layout, kernel_block_sizes,
allocate=...)`` (``attn_utils.init_kv_cache``); before 0.34 there was no ``allocate``. The patch
table picks the hook's form per release: the form in force must take every parameter vLLM's
function takes, serve vLLM's plain allocation (``allocate=None``) on kvcached pages, and refuse,
in one logged line, a buffer maker of vLLM's own (its extensible KV cache). A worker where no
runner kvcached knows is loaded refuses rather than serving without page decisions.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import pytest

pytest.importorskip("vllm.v1.worker.utils")
pytestmark = pytest.mark.vllm

from vllm.v1.worker import utils  # noqa: E402

from kvcached.errors import ConfigError  # noqa: E402
from kvcached.settings import Settings  # noqa: E402
from kvcached.vllm import patches  # noqa: E402
from kvcached.vllm.worker import kv_memory, step_receiver  # noqa: E402

FORMS = ("KV cache on kvcached pages", "KV cache on kvcached pages (allocate=)")


def _hook() -> Any:
    row = patches.holding(*FORMS)
    return patches._factory(row)(utils.allocate_kv_cache, Settings.from_env({}))


def test_the_hook_in_force_takes_what_vllms_allocate_kv_cache_takes() -> None:
    theirs = list(inspect.signature(utils.allocate_kv_cache).parameters)
    ours = list(inspect.signature(_hook(), follow_wrapped=False).parameters)
    assert ours == theirs, f"vLLM {patches.vllm_version()}: {theirs}, kvcached's hook: {ours}"


def test_vllms_plain_allocation_is_served_on_kvcached_pages(monkeypatch) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(kv_memory, "allocate", lambda *a, **kw: calls.append(a) or {"layer": "views"})
    hook = _hook()
    kw = {"allocate": None} if "allocate" in inspect.signature(utils.allocate_kv_cache).parameters else {}
    assert hook("cfg", "cpu", "layout", [16], **kw) == {"layer": "views"}
    assert calls == [("cfg", "cpu", "layout", [16])]


def test_a_buffer_maker_of_vllms_own_is_refused_in_one_line(monkeypatch, caplog) -> None:
    if "allocate" not in inspect.signature(utils.allocate_kv_cache).parameters:
        pytest.skip("allocate= arrived in vLLM 0.34")
    monkeypatch.setattr(kv_memory, "allocate", lambda *a, **kw: pytest.fail("served despite allocate="))

    def extensible(nbytes: int) -> Any:  # stands for vLLM's ExtensibleKVCache's maker
        raise AssertionError("never called")

    with caplog.at_level(logging.ERROR, logger="vllm.kvcached"), pytest.raises(ConfigError) as e:
        _hook()("cfg", "cpu", "layout", [16], allocate=extensible)
    assert "\n" not in str(e.value) and "enable_extensible_kv_cache=False" in str(e.value)
    assert [r.getMessage() for r in caplog.records] == [
        "[kvcached] refused: " + str(e.value).removeprefix("kvcached: ")
    ]


def test_a_worker_without_a_known_runner_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(patches, "install", lambda when, context: None)
    monkeypatch.setattr(patches, "installed", lambda: ["v1.worker.utils.allocate_kv_cache"])
    monkeypatch.setattr(step_receiver, "WorkerPages", lambda backend, plan: object())
    with pytest.raises(ConfigError, match="no model runner it knows is loaded") as e:
        step_receiver.install_worker(object(), object())  # type: ignore[arg-type]
    assert "\n" not in str(e.value)


def test_the_extensible_kv_cache_is_turned_off_and_an_explicit_one_refused() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from kvcached.vllm.api_server.startup import take_kv_sizing

    args = EngineArgs(model="m")
    if not hasattr(args, "enable_extensible_kv_cache"):
        take_kv_sizing(args)  # before vLLM 0.34: nothing to change
        return
    take_kv_sizing(args)
    assert args.enable_extensible_kv_cache is False and args.gpu_memory_utilization == pytest.approx(0.92)
    given = EngineArgs(model="m", gpu_memory_utilization=0.5)
    take_kv_sizing(given)
    assert given.gpu_memory_utilization == 0.5  # the user's value stands
    with pytest.raises(ConfigError, match="--enable-extensible-kv-cache") as e:
        take_kv_sizing(EngineArgs(model="m", enable_extensible_kv_cache=True))
    assert "\n" not in str(e.value)
