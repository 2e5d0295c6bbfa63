"""``kvctl status`` and ``kvctl limit`` over HTTP, on vLLM's own port, as a vLLM endpoint plugin.

In Kubernetes an operator reaches a pod's service, not a Unix socket on its host; upstream
kvcached's PR #324 proposes ``/kvcache/status`` and ``/kvcache/limit`` on the API server for that.
vLLM's endpoint plugins (the ``vllm.endpoint_plugins`` entry point group, vLLM PR #47454, in
vLLM 0.32 onward) add routes to its FastAPI app without patching it, and vLLM loads one only
when ``VLLM_PLUGINS`` names it, because a route widens what the network reaches: so
``VLLM_PLUGINS=kvcached`` turns these on (it also names kvcached's general plugin). On an older
vLLM there are no routes; ``kvctl`` on the host and ``/metrics`` remain.

The routes are under ``/v1`` so that vLLM's ``--api-key`` (or ``VLLM_API_KEY``) guards them:
its ``AuthenticationMiddleware`` checks the bearer token on ``/v1``, ``/v2``, ``/inference`` and
``/cohere`` only (vLLM's ``GUARDED_PREFIX``). Reading is as open as the server; changing a
limit on a server without a key is refused (403), since anyone who reached the port could shrink
its memory. The engines are those of this ``vllm serve`` (``metrics.Collector``), each asked
over its ledger socket as ``kvctl`` asks it:

    GET  /v1/kvcached/status   -> {"engines": [{"engine": {...}, "memory": {...} | null, "up": true}]}
    POST /v1/kvcached/limit    {"size": "2G" | 2147483648 | "none", "engine": 0, "force": false}

A refused or unreachable engine is one line under ``error`` (400 bad input, 403 no key, 404 no
such engine, 409 the engine refused, 502 it did not answer, 503 kvcached is not on this server).
"""

from __future__ import annotations

import os
from typing import Any, Final

import msgspec

from ...service import live, messages
from ...settings import parse_limit
from . import metrics

PREFIX: Final = "/v1/kvcached"
LIMIT_TIMEOUT: Final = 10.0  # seconds per engine, as kvctl's default


class LimitBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A limit as ``kvctl limit`` takes it: bytes, a size with a unit, or ``none``."""

    size: int | str | None
    engine: int | None = None  # vLLM's engine index (the ``engine`` label); None: every engine
    force: bool = False


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def size_of(value: int | str | None) -> int | None:
    """Bytes, or None for no limit, read as ``kvctl limit`` reads its argument (JSON's null and a
    number too); a negative or unreadable size is an ``HttpError`` (400)."""
    if value is None:
        return None
    try:
        return parse_limit(str(value))
    except ValueError as exc:
        raise HttpError(400, f"size {value!r}: {exc}") from None


def _engines() -> list[tuple[str, messages.EngineInfo, messages.StatusReply | None]]:
    collector = metrics.collector()
    if collector is None:
        raise HttpError(503, "kvcached is not active on this API server (no engine of it registered)")
    return collector.found()


def status() -> dict[str, Any]:
    """Each engine of this server: who it is and its memory (None where it did not answer)."""
    rows = []
    for _, info, st in _engines():
        memory = None if st is None or st.memory is None else msgspec.to_builtins(st.memory)
        rows.append({"engine": msgspec.to_builtins(info), "memory": memory, "up": st is not None})
    return {"engines": rows}


def keyed(args: Any) -> bool:
    """Whether vLLM guards ``/v1`` with an API key here (its rule: ``--api-key``, else
    ``VLLM_API_KEY``; ``init_entrypoints_middleware``)."""
    keys = list(getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY", "")])
    return any(keys)


def set_limit(body: LimitBody, args: Any) -> dict[str, Any]:
    """The limit on each engine asked for, as ``kvctl limit`` sets it; each engine's memory after."""
    if not keyed(args):
        raise HttpError(
            403, "setting a limit over HTTP needs vLLM's --api-key (or VLLM_API_KEY); on the host, use kvctl limit"
        )
    size = size_of(body.size)
    targets = [(path, info) for path, info, _ in _engines() if body.engine is None or info.index == body.engine]
    if not targets:
        raise HttpError(404, f"engine {body.engine}: no such engine on this server")
    request = messages.Request(op="limit", size=-1 if size is None else size, force=body.force)
    rows = []
    for path, info in targets:
        try:
            reply = live.request(path, request, timeout=LIMIT_TIMEOUT)
        except live.LiveViewError as exc:
            refused = isinstance(exc, live.RefusedError)
            raise HttpError(409 if refused else 502, f"engine {info.index}: {exc}") from None
        if not isinstance(reply, messages.LimitReply):
            raise HttpError(502, f"engine {info.index}: answered a {type(reply).__name__}, not a limit")
        rows.append({"engine": info.index, "memory": msgspec.to_builtins(reply.memory)})
    return {"engines": rows}


class Plugin:
    """vLLM's ``EndpointPlugin`` protocol (``vllm.plugins.endpoint_plugins.interface``)."""

    name: Final = "kvcached"
    required_tasks: Final = None  # any server: kvcached's engines are what the routes need

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter
        from fastapi.responses import JSONResponse

        router = APIRouter(prefix=PREFIX)
        args = getattr(app.state, "args", None)  # vLLM's build_app sets it before plugins attach

        def answer(work: Any) -> Any:
            try:
                return JSONResponse(work())
            except HttpError as exc:
                return JSONResponse({"error": str(exc)}, status_code=exc.status)

        # Plain functions: FastAPI runs them in its thread pool, so a socket round trip to an
        # engine never blocks the server's event loop.
        def get_status() -> Any:
            return answer(status)

        def post_limit(payload: dict[str, Any]) -> Any:
            def work() -> dict[str, Any]:
                try:
                    body = msgspec.convert(payload, LimitBody)
                except msgspec.ValidationError as exc:
                    raise HttpError(400, f"the body: {exc}") from None
                return set_limit(body, args)

            return answer(work)

        router.add_api_route("/status", get_status, methods=["GET"])
        router.add_api_route("/limit", post_limit, methods=["POST"])
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        return None  # the routes find their engines through the metrics collector, per request


def plugin() -> Plugin:
    """The entry point's factory (``pyproject.toml``: ``vllm.endpoint_plugins``)."""
    return Plugin()
