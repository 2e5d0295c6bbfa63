"""Data-parallel ranks as kvcached sees them, without vLLM: which rank and how many, each rank's
own file names, and what kvctl shows of them (served end to end in tests/serve/test_dp_e2e.py)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest

from kvcached.service.messages import EngineInfo, StatusReply
from kvcached.vllm.api_server.startup import DP_SIZE_ENV
from kvcached.vllm.engine_core import ranks
from kvctl import engines, render


def scheduler(*, index: int | None, size: int) -> SimpleNamespace:
    """What vLLM leaves in an engine core's config: a dense model's rank has its size reset to 1
    (``ParallelConfig.reconfigure_for_independent_dp_rank``) and keeps ``data_parallel_index``."""
    par = SimpleNamespace(data_parallel_size=size, data_parallel_rank=0)
    if index is not None:
        par.data_parallel_index = index
    return SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=par))


def test_rank_paths_differ_per_rank_and_keep_one_rank_s_name() -> None:
    assert ranks.rank_path("/j/run.kvj", 0, 1) == "/j/run.kvj"
    names = {ranks.rank_path("/j/run.kvj", r, 3) for r in range(3)}
    assert names == {"/j/run.kvj.dp0", "/j/run.kvj.dp1", "/j/run.kvj.dp2"}
    # A socket keeps its suffix: kvctl and the metrics collector find sockets by it.
    assert ranks.rank_path("/r/ledger-7.sock", 1, 2) == "/r/ledger-7.dp1.sock"


def test_the_size_comes_from_the_config_or_from_the_api_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DP_SIZE_ENV, raising=False)
    dense = scheduler(index=1, size=1)
    assert (ranks.engine_index(dense), ranks.data_parallel_size(dense)) == (1, 1)
    monkeypatch.setenv(DP_SIZE_ENV, "2")  # what startup's create_engine_config left for the engine cores
    assert ranks.data_parallel_size(dense) == 2
    moe = scheduler(index=3, size=4)  # a MoE model's ranks keep the size
    assert (ranks.engine_index(moe), ranks.data_parallel_size(moe)) == (3, 4)
    for junk in ("", "x", "-2", "1"):
        monkeypatch.setenv(DP_SIZE_ENV, junk)
        assert ranks.data_parallel_size(dense) == 1


def _found(status_reply: Callable[..., StatusReply], index: int, size: int) -> engines.Found:
    info = EngineInfo(
        model="tiny",
        pid=100 + index,
        api_pid=99,
        port=8000,
        socket=f"/r/ledger-{100 + index}.dp{index}.sock",
        started_unix=0.0,
        policy="ledger",
        engine="vLLM 0.32.0",
        kvcached="-",
        index=index,
        data_parallel=size,
    )
    status = status_reply(pid=info.pid, engine=info)
    return engines.Found(socket=info.socket, alive=True, status=status)


def test_kvctl_names_each_rank(status_reply: Callable[..., StatusReply]) -> None:
    cells = [engines._cells(_found(status_reply, r, 2)) for r in range(2)]
    assert [c[0] for c in cells] == ["tiny [dp 0/2]", "tiny [dp 1/2]"]
    assert engines._cells(_found(status_reply, 0, 1))[0] == "tiny"  # one engine: no rank to name
    status = _found(status_reply, 1, 2).status
    assert status is not None
    rows = dict(render.status_rows(status))
    assert "data-parallel rank 1 of 2" in rows["engine"], rows
    one = _found(status_reply, 0, 1).status
    assert one is not None and "data-parallel" not in dict(render.status_rows(one))["engine"]
