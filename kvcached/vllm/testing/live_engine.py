"""One engine as an operator reaches it, without vLLM's scheduler: its ledger service on a socket,
over a real manager on the host backend, steered by the engine core's own ``LiveControl``.

``kvctl`` (tests/test_operate.py) and the HTTP routes (``api_server.http``) talk to exactly this
in a served engine core; here nothing schedules, so a limit is applied at once and the memory
report is the manager's.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ...backends.host import HostBackend
from ...engine.steps import OpsPerStep
from ...kv_cache_manager import KVCacheManager, KVGeometry
from ...ledger.events import Policy
from ...service import messages
from ...service.ledger_service import BackgroundService, ServiceConfig
from ..engine_core.control import LiveControl


class _Core:
    """What ``LiveControl`` needs of ``engine_core.engine.Engine``, over the manager alone."""

    offloading = True
    wake = None
    budget = None  # no KVCACHED_BUDGET
    page_log = None  # no step channel: the manager's backend holds the memory

    def __init__(self, manager: KVCacheManager, service: BackgroundService) -> None:
        self.lock = threading.RLock()
        self.manager, self.service = manager, service
        self.page_ops = OpsPerStep(manager.allocator.ops)  # nothing steps it: no step counted

    def set_limit_bytes(self, n: int | None) -> None:
        m = self.manager
        m.set_limit_pages(m.geometry.num_pages if n is None else n // m.geometry.page_bytes)


class LiveEngine:
    """A socket ``folder/ledger-<pid>.sock`` (pid: this process's, plus ``index``) answering as an
    engine core of ``vllm serve`` pid ``api_pid`` does; ``close`` stops it and frees the memory."""

    def __init__(
        self,
        folder: str | Path,
        *,
        page: int,
        num_blocks: int = 64,
        index: int = 0,
        api_pid: int | None = None,
        model: str = "tiny-llama",
    ) -> None:
        geo = KVGeometry(num_blocks=num_blocks, block_bytes=page // 4, page_bytes=page)
        self.manager = KVCacheManager.standalone(geo, HostBackend(page_bytes=page), policy=Policy.LEDGER)
        self.socket = str(Path(folder) / f"ledger-{os.getpid() + index}.sock")
        header = self.manager.recorder.ledger.header
        self.service = BackgroundService.start(header, ServiceConfig(socket=self.socket, flight_events=64))
        self.manager.recorder.sink = self.service.producer
        info = messages.EngineInfo(
            model=model,
            pid=os.getpid() + index,
            api_pid=api_pid,
            port=8123,
            socket=self.socket,
            started_unix=0.0,
            policy="ledger",
            engine="vLLM -",
            kvcached="-",
            index=index,
        )
        core = _Core(self.manager, self.service)
        self.control = LiveControl(core, info, page)  # type: ignore[arg-type]
        self.service.service.control = self.control

    def close(self) -> None:
        self.service.close()
        self.manager.backend.close()
