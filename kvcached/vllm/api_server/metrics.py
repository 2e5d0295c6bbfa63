"""kvcached's series on vLLM's ``/metrics``, read from each engine core's live view at scrape time.

vLLM serves ``/metrics`` from its API server process with ``prometheus_client``; the pages,
pins and violations live in the engine core processes. vLLM's route for a KV connector's own
series (``KVConnectorBase.build_prom_metrics`` fed by ``get_kv_connector_stats``, which the
OffloadingConnector uses for ``vllm:kv_offload_*``) exists only with a connector configured and
would mean replacing the OffloadingConnector's class methods; kvcached runs without one too.
So the API server registers one custom collector (``prometheus_client``'s documented way to
expose values owned elsewhere) that, on each scrape, asks the engine cores this API server
started (found by ``EngineInfo.api_pid`` among the sockets in the live view's directory) for
their ``status`` over the same socket ``kvctl`` uses. A scrape costs one round trip per engine,
a few ms; nothing runs between scrapes, and an engine that does not answer in time is skipped
for that scrape (``vllm:kvcached_engine_up`` 0), never failing vLLM's own series.

Names and labels follow vLLM's (``vllm:`` prefix, ``model_name`` and ``engine`` labels, base
units, ``_total`` counters); docs/operating.md lists them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any, Final

from ...service import live, messages

log = logging.getLogger("vllm.kvcached")

SCRAPE_TIMEOUT: Final = 1.0  # seconds per engine: Prometheus' own scrape timeout is 10 s
_installed: list[Any] = []


def install(api_pid: int) -> None:
    """Registers the collector in this process's registry (once)."""
    if _installed:
        return
    try:
        from prometheus_client import REGISTRY

        registry = REGISTRY
        try:  # vLLM's registry (a multiprocess one when it runs several API servers)
            from vllm.v1.metrics.prometheus import get_prometheus_registry

            registry = get_prometheus_registry()
        except ImportError:
            pass
        collector = Collector(api_pid)
        registry.register(collector)
    except Exception as exc:  # metrics are worth a warning, never a failed start
        log.warning("[kvcached] metrics: not registered with /metrics: %s", exc)
        return
    _installed.append(collector)


class Collector:
    """A ``prometheus_client`` collector of the engines started by API server ``api_pid``."""

    def __init__(self, api_pid: int, folder: str | None = None) -> None:
        self.api_pid = api_pid
        self.folder = folder
        self._foreign: set[tuple[str, int]] = set()  # sockets (path, inode) of other servers' engines

    def describe(self) -> list[Any]:
        return []  # no fixed set: engines come and go (prometheus_client then skips the duplicate check)

    def statuses(self) -> Iterator[messages.StatusReply]:
        for path in live.known_sockets(self.folder):
            try:
                key = (path, os.stat(path).st_ino)
            except OSError:
                continue
            if key in self._foreign:
                continue
            try:
                reply = live.request(path, messages.Request(op="status"), timeout=SCRAPE_TIMEOUT)
            except live.LiveViewError:
                continue
            if not isinstance(reply, messages.StatusReply) or reply.engine is None:
                continue
            if reply.engine.api_pid != self.api_pid:
                self._foreign.add(key)
                continue
            yield reply

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["model_name", "engine"]

        def gauge(name: str, doc: str, extra: list[str] | None = None) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"vllm:kvcached_{name}", doc, labels=labels + (extra or []))

        def counter(name: str, doc: str, extra: list[str] | None = None) -> CounterMetricFamily:
            return CounterMetricFamily(f"vllm:kvcached_{name}", doc, labels=labels + (extra or []))

        up = gauge("engine_up", "1 while the engine core's ledger service answers")
        limit = gauge("memory_limit_bytes", "The engine's KV memory limit (kvctl limit)")
        capacity = gauge("capacity_bytes", "The KV memory vLLM sized its block table for (virtual)")
        mapped = gauge("mapped_bytes", "KV memory mapped now (in use and reserved pages)")
        pages = gauge("pages", "Pages by state", ["state"])
        pinned = gauge("pinned_pages", "Pages kept by a pin, by pin kind", ["kind"])
        waiting = gauge("shrink_waiting_pages", "Pages a pending shrink waits for, by what keeps them", ["reason"])
        jobs = gauge("outstanding_jobs", "Offloading jobs built and not yet reported by every worker")
        violations = counter("violations", "Invariant violations the ledger saw", ["invariant"])
        events = counter("events", "Ledger events the service took from the scheduler")
        written = counter("journal_events_written", "Ledger events written to the journal")
        dropped = counter("events_dropped", "Ledger events dropped by a full hand-off (journaled as gaps)")
        maps = counter("page_maps", "Pages mapped (each in every layer and worker)")
        unmaps = counter("page_unmaps", "Pages unmapped")
        for st in self.statuses():
            eng = st.engine
            assert eng is not None
            lv = [eng.model, str(eng.pid)]
            up.add_metric(lv, 1)
            events.add_metric(lv, st.events)
            written.add_metric(lv, st.journal.events_written)
            dropped.add_metric(lv, st.handoff.dropped)
            for inv, n in sorted(st.violations_by_invariant.items()):
                violations.add_metric([*lv, inv], n)
            for kind in ("job", "grace", "window"):
                pinned.add_metric([*lv, kind], st.pinned_by_kind.get(kind, 0))
            if st.ledger is not None:
                jobs.add_metric(lv, st.ledger.outstanding_jobs)
                maps.add_metric(lv, st.ledger.maps)
                unmaps.add_metric(lv, st.ledger.unmaps)
                pages.add_metric([*lv, "pinned"], st.ledger.pinned_pages)
                pages.add_metric([*lv, "releasable"], st.ledger.releasable_pages)
            m = st.memory
            if m is not None:
                limit.add_metric(lv, m.limit_bytes)
                capacity.add_metric(lv, m.capacity_bytes)
                mapped.add_metric(lv, m.mapped_bytes)
                pages.add_metric([*lv, "mapped"], m.mapped_pages)
                pages.add_metric([*lv, "in_use"], m.in_use_pages)
                pages.add_metric([*lv, "reserved"], m.reserved_pages)
                for reason, n in sorted(m.waiting_on.items()):
                    waiting.add_metric([*lv, reason], n)
        yield from (up, limit, capacity, mapped, pages, pinned, waiting, jobs, violations, events, written, dropped)
        yield from (maps, unmaps)
