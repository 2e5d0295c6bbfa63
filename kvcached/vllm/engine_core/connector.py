"""kvcached's OffloadingConnector: vLLM's, with its scheduler-side calls told to the engine's bridge.

vLLM builds its KV connector with ``KVConnectorFactory.get_connector_class``, which takes the
class named ``kv_connector`` from the module ``kv_transfer_config.kv_connector_module_path``
before its own registry: the documented way to bring one's own connector. kvcached's startup
patch (``api_server.startup``) points that path here for an ``OffloadingConnector`` without one,
so every process of the server builds this subclass, under vLLM's own name, instead of kvcached
shadowing methods on vLLM's object. Until the engine attaches its bridge (``install_bridge``) each
override is vLLM's method exactly; after, the bridge records the call's events around vLLM's
method (``bridge.Bridge``). The worker side, the connector's other scheduler calls and its
metrics are vLLM's, inherited.
"""

from __future__ import annotations

import types
from typing import Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector as VllmOffloadingConnector,
)

from ..patches import CONNECTOR_CALLS


class Bridge(Protocol):
    """What the connector calls on ``bridge.Bridge`` (named so, without importing it: that
    module imports this one when it attaches)."""

    def on_new_request(self, request: Any) -> Any: ...
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any: ...
    def build_connector_meta(self, scheduler_output: Any) -> Any: ...
    def update_connector_output(self, connector_output: Any) -> Any: ...
    def has_pending_push_work(self) -> bool: ...


class OffloadingConnector(VllmOffloadingConnector):  # type: ignore[misc,unused-ignore]
    """vLLM's ``OffloadingConnector``, reporting its scheduler-side calls to ``kvcached_bridge``."""

    kvcached_bridge: Bridge | None = None

    def on_new_request(self, request: Any) -> Any:
        bridge = self.kvcached_bridge
        if bridge is None:
            return super().on_new_request(request)
        return bridge.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        bridge = self.kvcached_bridge
        if bridge is None:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        return bridge.get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        bridge = self.kvcached_bridge
        if bridge is None:
            return super().build_connector_meta(scheduler_output)
        return bridge.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> Any:
        bridge = self.kvcached_bridge
        if bridge is None:
            return super().update_connector_output(connector_output)
        return bridge.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        bridge = self.kvcached_bridge
        if bridge is None:
            return bool(super().has_pending_push_work())
        return bridge.has_pending_push_work()

    def vllm_calls(self) -> dict[str, Any]:
        """vLLM's own scheduler-side methods of this connector, bound: what the bridge wraps."""
        base = VllmOffloadingConnector
        return {name: types.MethodType(getattr(base, name), self) for name in CONNECTOR_CALLS}
