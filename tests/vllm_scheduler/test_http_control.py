"""kvctl's status and limit over HTTP (``api_server.http``), on the app vLLM's own ``build_app`` makes.

vLLM's parser reads the server's flags, ``build_app`` loads the endpoint plugin through the
``vllm.endpoint_plugins`` entry point (named in ``VLLM_PLUGINS``, as vLLM requires) and puts its
``--api-key`` middleware in front; behind the routes is an engine's ledger socket over a real
manager (``live_engine``), found the way ``/metrics`` finds the server's engines.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm.plugins.endpoint_plugins", reason="vLLM before 0.32 has no endpoint plugins")
from starlette.testclient import TestClient

from kvcached.vllm.api_server import metrics
from kvcached.vllm.testing.live_engine import LiveEngine

PAGE = 64 << 10
KEY = "a-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _build(argv: list[str]) -> Any:
    """vLLM's API server app for ``vllm serve`` with ``argv`` (its own parser and ``build_app``)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    # The parser's module moved between releases (launchers/ in 0.32, common/ in 0.34).
    for name in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args"):
        try:
            make_arg_parser = importlib.import_module(name).make_arg_parser
            break
        except ImportError:
            continue
    # NOTE: vLLM's ``suppress_logging`` (vllm/logger.py) calls ``logging.disable`` without a
    # ``finally``: where the parse raises inside it, logging stays off for every later test.
    disabled = logging.root.manager.disable
    try:
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    except RuntimeError as exc:  # vLLM's GPU wheel sizes its device config from a GPU
        pytest.skip(f"vLLM's parser needs a device here: {exc}")
    finally:
        logging.disable(disabled)
    from vllm.entrypoints.launchers.app import build_app

    return build_app(args, supported_tasks=("generate",))


class Served:
    """Two engines of this "server" (this process's pid as ``vllm serve``'s), and its app for argv."""

    def __init__(self, engines: list[LiveEngine]) -> None:
        self.engines = engines

    def __call__(self, argv: list[str]) -> TestClient:
        return TestClient(_build(argv))


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    monkeypatch.setenv("VLLM_PLUGINS", "kvcached")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("KVCACHED_LEDGER_SOCKET", raising=False)
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    engines = [LiveEngine(folder, page=PAGE, index=i, api_pid=os.getpid()) for i in (0, 1)]
    monkeypatch.setattr(metrics, "_collector", metrics.Collector(os.getpid(), folder=str(folder)))
    try:
        yield Served(engines)
    finally:
        for e in engines:
            e.close()


def test_the_routes_are_behind_vllm_s_api_key_and_report_each_engine(served) -> None:
    client = served(["--api-key", KEY])
    assert client.get("/v1/kvcached/status").status_code == 401  # vLLM's middleware, not ours
    assert client.post("/v1/kvcached/limit", json={"size": "none"}).status_code == 401
    got = client.get("/v1/kvcached/status", headers=AUTH)
    assert got.status_code == 200, got.text
    rows = got.json()["engines"]
    assert [r["engine"]["index"] for r in rows] == [0, 1] and all(r["up"] for r in rows)
    assert rows[0]["memory"]["num_pages"] == 16 and rows[0]["memory"]["limit_pages"] == 16


def test_a_limit_set_over_http_is_the_engine_s_limit(served) -> None:
    client = served(["--api-key", KEY])
    got = client.post("/v1/kvcached/limit", json={"size": "256K", "engine": 1}, headers=AUTH)
    assert got.status_code == 200, got.text
    assert [(r["engine"], r["memory"]["limit_pages"]) for r in got.json()["engines"]] == [(1, 4)]
    limits = [r["memory"]["limit_pages"] for r in client.get("/v1/kvcached/status", headers=AUTH).json()["engines"]]
    assert limits == [16, 4]  # engine 0 untouched
    got = client.post("/v1/kvcached/limit", json={"size": 8 * PAGE}, headers=AUTH)  # every engine
    assert [r["memory"]["limit_pages"] for r in got.json()["engines"]] == [8, 8]
    got = client.post("/v1/kvcached/limit", json={"size": "none"}, headers=AUTH)
    assert [r["memory"]["limit_pages"] for r in got.json()["engines"]] == [16, 16]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"size": "2Gx"}, 400, "size '2Gx'"),
        ({"size": -5}, 400, "a negative size"),
        ({"size": "1G", "engine": 7}, 404, "engine 7: no such engine"),
        ({"size": "1G", "pages": 3}, 400, "the body"),
        ({"size": True}, 400, "the body"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(served, body: dict[str, Any], status: int, words: str) -> None:
    client = served(["--api-key", KEY])
    got = client.post("/v1/kvcached/limit", json=body, headers=AUTH)
    assert got.status_code == status, got.text
    error = got.json()["error"]
    assert words in error and "\n" not in error
    limits = [r["memory"]["limit_pages"] for r in client.get("/v1/kvcached/status", headers=AUTH).json()["engines"]]
    assert limits == [16, 16]


def test_a_limit_below_the_floor_is_refused_by_the_engine_unless_forced(served) -> None:
    control = served.engines[0].control
    control.floor_pages, control.floor_why = 8, "one request of max_model_len 512 needs 32 blocks on 8 pages"
    client = served(["--api-key", KEY])
    got = client.post("/v1/kvcached/limit", json={"size": "256K", "engine": 0}, headers=AUTH)
    assert got.status_code == 409, got.text
    assert "below this engine's floor of 512 KiB" in got.json()["error"] and "--force" in got.json()["error"]
    assert served.engines[0].manager.state().limit == 16  # nothing changed
    got = client.post("/v1/kvcached/limit", json={"size": "256K", "engine": 0, "force": True}, headers=AUTH)
    assert got.status_code == 200 and got.json()["engines"][0]["memory"]["limit_pages"] == 4


def test_without_an_api_key_reading_is_open_and_a_limit_is_refused(served) -> None:
    client = served([])
    assert client.get("/v1/kvcached/status").status_code == 200
    got = client.post("/v1/kvcached/limit", json={"size": "256K"})
    assert got.status_code == 403 and "--api-key" in got.json()["error"]
    limits = [r["memory"]["limit_pages"] for r in client.get("/v1/kvcached/status").json()["engines"]]
    assert limits == [16, 16]


def test_vllm_loads_the_routes_only_where_vllm_plugins_names_kvcached(served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_PLUGINS")
    client = served(["--api-key", KEY])
    assert client.get("/v1/kvcached/status", headers=AUTH).status_code == 404
