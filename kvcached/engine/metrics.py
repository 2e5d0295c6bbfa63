"""kvcached's series on an engine's ``/metrics``, read from each engine's live view at scrape time.

Both engines serve ``/metrics`` from their HTTP server process with ``prometheus_client``; the
pages, pins and violations live in the engine processes (vLLM's engine cores, SGLang's
schedulers). So the HTTP server's wing adds one custom collector (``Collector``) that, on each
scrape, asks the engines its server started for their ``status`` over the socket ``kvctl`` uses.
The series are declared once, in ``SERIES``, under one name and label set for both engines (a
dashboard and its alerts serve either); docs/operating.md lists every series. How the collector
reaches ``/metrics`` is each wing's (``kvcached.vllm.api_server.metrics``,
``kvcached.sglang.metrics``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any, Final

from ..errors import ConfigError
from ..ledger.findings import INVARIANTS
from ..service import live, messages
from .releases import Releases

SCRAPE_TIMEOUT: Final = 1.0  # seconds per engine: Prometheus' own scrape timeout is 10 s
PREFIX: Final = "vllm:kvcached_"
# What an operator joins and alerts on (docs/operating.md lists every series):
# - labels are vLLM's: ``model_name`` and ``engine``, the engine index vLLM's own
#   ``PrometheusStatLogger`` puts on ``vllm:kv_cache_usage_perc``, so the two join on both. The
#   engine core's pid and socket are labels of ``vllm:kvcached_info`` only, so a restart does not
#   start new series for every gauge;
# - an engine that answered once and stops answering stays: ``engine_up`` 0 and its info series
#   (an absent series fires no alert);
# - ``violations_total`` has a series per invariant from the first scrape, at 0, so that
#   ``increase(...[5m]) > 0`` sees the first violation (a counter born at 1 is never an increase);
# - ``pages{state}`` partitions the engine's virtual pages, so one label's values sum to
#   ``capacity``: ``in_use`` (a block allocated), ``pinned`` (empty, kept mapped by a pin),
#   ``reserved`` (empty, mapped as a reserve, free to go) and ``unmapped``.
LABELS: Final = ("model_name", "engine")
PIN_KINDS: Final = ("job", "grace", "window")
PAGE_STATES: Final = ("in_use", "pinned", "reserved", "unmapped")

# name (after PREFIX) -> (type, help, labels beyond model_name and engine; the budget_* series
# have only ``budget``: a budget is shared by engines). Counters are exposed with ``_total``.
SERIES: Final[dict[str, tuple[str, str, tuple[str, ...]]]] = {
    "info": (
        "gauge",
        "1 per engine: kvcached's version and setup, the engine process's pid and socket, the serving engine",
        (
            "version",
            "policy",
            "backend",
            "page_bytes",
            "layer_page_bytes",
            "compiled",
            "pid",
            "socket",
            "budget",
            "vllm_version",
            "tested",
            "serving",
        ),
    ),
    "engine_up": ("gauge", "1 while the engine core's ledger service answers, 0 once it stops", ()),
    "memory_limit_bytes": ("gauge", "The engine's KV memory limit (kvctl limit)", ()),
    "capacity_bytes": ("gauge", "The KV memory vLLM sized its block table for (virtual)", ()),
    "mapped_bytes": ("gauge", "KV memory mapped now (in use, pinned and reserved pages)", ()),
    "pages": ("gauge", "Pages by state; the states partition the capacity", ("state",)),
    "shrink_pending": ("gauge", "1 while the engine is over its limit, waiting for pages to empty", ()),
    "shrink_waiting_pages": ("gauge", "Pages a pending shrink waits for, by what keeps them", ("reason",)),
    "pinned_pages": ("gauge", "Pages kept by a pin, by pin kind (a page with two kinds counts twice)", ("kind",)),
    "outstanding_jobs": ("gauge", "Offloading jobs built and not yet reported by every worker", ()),
    "violations": ("counter", "Invariant violations the ledger saw", ("invariant",)),
    "events": ("counter", "Ledger events the service took from the scheduler", ()),
    "journal_events_written": ("counter", "Ledger events written to the journal", ()),
    "events_dropped": ("counter", "Ledger events dropped by a full hand-off (journaled as gaps)", ()),
    "page_maps": ("counter", "Pages mapped (each in every layer and worker)", ()),
    "page_unmaps": ("counter", "Pages unmapped", ()),
    "jobs_failed": ("counter", "Offloading transfer jobs a worker reported failed (their pins released)", ()),
    "page_ops_per_step": (
        "histogram",
        "Pages mapped and unmapped per scheduler step (each a map or unmap per layer region in every worker)",
        (),
    ),
    "page_hold_seconds": (
        "histogram",
        "How long a pin (offloading job, grace, window) kept an emptied page mapped, observed when it let go",
        (),
    ),
    "budget_size_bytes": ("gauge", "A shared budget's size (absent: unbounded)", ()),
    "budget_used_bytes": ("gauge", "Bytes granted to every engine on a budget", ()),
    "budget_wanted_bytes": (
        "gauge",
        "Bytes engines on a budget wait for (starting) or are short of (serving); others give back toward them",
        (),
    ),
}


_SUFFIXES: Final = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exposed_names() -> set[str]:
    """Every series name a scrape can show, as Prometheus stores it (counters with ``_total``, a
    histogram's ``_bucket``, ``_sum`` and ``_count``)."""
    return {PREFIX + n + s for n, (kind, _, _) in SERIES.items() for s in _SUFFIXES[kind]}


def documented_names() -> set[str]:
    """One name per series as docs/operating.md tables them: a histogram by its own name."""
    return {PREFIX + n + ("_total" if kind == "counter" else "") for n, (kind, _, _) in SERIES.items()}


class Collector:
    """A ``prometheus_client`` collector of the engines started by ``vllm serve`` pid ``api_pid``.

    NOTE: vLLM's route for a KV connector's own series (``KVConnectorBase.build_prom_metrics`` fed
    by ``get_kv_connector_stats``, which the OffloadingConnector uses for ``vllm:kv_offload_*``)
    exists only with a connector configured. It would mean replacing the OffloadingConnector's
    class methods, and kvcached runs without one too. So each API server registers this custom
    collector (``prometheus_client``'s documented way to expose values owned elsewhere). On each
    scrape it asks the engine cores its ``vllm serve`` started (found by ``EngineInfo.api_pid``
    among the sockets in the live view's directory) for their ``status`` over the socket
    ``kvctl`` uses: one round trip per engine, a few ms, nothing between scrapes.
    """

    def __init__(self, api_pid: int, folder: str | None = None, *, releases: Releases) -> None:
        self.api_pid = api_pid
        self.folder = folder
        self.releases = releases  # the serving engine's tested releases (its wing's table)
        self._failed = False
        self._foreign: set[tuple[str, int]] = set()  # sockets (path, inode) of other servers' engines
        self._known: dict[str, messages.EngineInfo] = {}  # socket -> the engine that answered there

    def tested(self, release: str) -> bool:
        """Whether the engine's ``release`` is one kvcached was tested on (an unreadable one is not)."""
        try:
            return self.releases.is_tested(release)
        except ConfigError:
            return False

    def families(self, log: logging.Logger) -> list[Any]:
        """The families of a scrape; none when collecting fails, said once in ``log``: the
        engine's own series must still be served."""
        try:
            return list(self.collect())
        except Exception as exc:
            if not self._failed:
                self._failed = True
                log.warning("[kvcached] metrics: kvcached's series are left out of /metrics: %s", exc)
            return []

    def describe(self) -> list[Any]:
        return []  # no fixed set: engines come and go (prometheus_client then skips the duplicate check)

    def poll(self) -> list[tuple[messages.EngineInfo, messages.StatusReply | None]]:
        """Each engine of this server with its status; None for a known one that did not answer."""
        return [(info, st) for _, info, st in self.found()]

    def found(self) -> list[tuple[str, messages.EngineInfo, messages.StatusReply | None]]:
        """Each engine of this server, by index: its socket, who it is, its status (None for a
        known one that did not answer)."""
        answered: dict[str, messages.StatusReply] = {}
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
            answered[path] = reply
            self._known[path] = reply.engine
        return [(path, info, answered.get(path)) for path, info in sorted(self._known.items(), key=_by_index)]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        families = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}
        made: dict[str, Any] = {}
        for name, (kind, doc, extra) in SERIES.items():
            labels = ["budget"] if name.startswith("budget_") else [*LABELS, *extra]
            made[name] = families[kind](PREFIX + name, doc, labels=labels)
        info, up, limit, capacity, mapped = (
            made[n] for n in ("info", "engine_up", "memory_limit_bytes", "capacity_bytes", "mapped_bytes")
        )
        pages, shrink, waiting, pinned, jobs = (
            made[n] for n in ("pages", "shrink_pending", "shrink_waiting_pages", "pinned_pages", "outstanding_jobs")
        )
        violations, events, written, dropped, maps, unmaps = (
            made[n]
            for n in ("violations", "events", "journal_events_written", "events_dropped", "page_maps", "page_unmaps")
        )
        budget_size, budget_used = made["budget_size_bytes"], made["budget_used_bytes"]
        budget_wanted = made["budget_wanted_bytes"]
        budgets: dict[str, messages.BudgetStatus] = {}
        for eng, st in self.poll():
            lv = [eng.model, str(eng.index)]
            info.add_metric(
                [
                    *lv,
                    eng.kvcached,
                    eng.policy,
                    eng.backend,
                    str(eng.page_cost or eng.page_size),  # what one page counts in the *_bytes series
                    str(eng.page_size),
                    "true" if eng.compiled else "false",
                    str(eng.pid),
                    eng.socket,
                    eng.budget or "",
                    eng.release if eng.engine.startswith("vLLM ") else "",
                    "true" if self.tested(eng.release) else "false",
                    eng.engine,
                ],
                1,
            )
            up.add_metric(lv, 0 if st is None else 1)
            if st is None:
                continue
            events.add_metric(lv, st.events)
            written.add_metric(lv, st.journal.events_written)
            dropped.add_metric(lv, st.handoff.dropped)
            for inv in INVARIANTS:
                violations.add_metric([*lv, inv], st.violations_by_invariant.get(inv, 0))
            for kind in PIN_KINDS:
                pinned.add_metric([*lv, kind], st.pinned_by_kind.get(kind, 0))
            if st.ledger is not None:
                jobs.add_metric(lv, st.ledger.outstanding_jobs)
                maps.add_metric(lv, st.ledger.maps)
                unmaps.add_metric(lv, st.ledger.unmaps)
                made["jobs_failed"].add_metric(lv, st.ledger.jobs_failed)
            m = st.memory
            if m is None:
                continue
            limit.add_metric(lv, m.limit_bytes)
            capacity.add_metric(lv, m.capacity_bytes)
            mapped.add_metric(lv, m.mapped_bytes)
            for state, n in zip(PAGE_STATES, page_states(m), strict=True):
                pages.add_metric([*lv, state], n)
            shrink.add_metric(lv, 1 if m.shrink_pending else 0)
            for reason, n in sorted(m.waiting_on.items()):
                waiting.add_metric([*lv, reason], n)
            if m.budget is not None:
                budgets[m.budget.name] = m.budget
            for series, h in (("page_ops_per_step", m.page_ops), ("page_hold_seconds", m.page_holds)):
                if h is not None:
                    made[series].add_metric(lv, _buckets(h), h.sum)
        for name, b in sorted(budgets.items()):
            if b.size is not None:
                budget_size.add_metric([name], b.size)
            budget_used.add_metric([name], b.used)
            budget_wanted.add_metric([name], b.wanted)
        yield from made.values()


def _buckets(h: messages.Histogram) -> list[tuple[str, float]]:
    """Prometheus' cumulative buckets of a per-bucket histogram, ``+Inf`` last, each ``le`` written
    as ``prometheus_client`` writes its own histograms' (``floatToGoString``: "0.0", "2.5")."""
    from prometheus_client.utils import floatToGoString

    out, total = [], 0
    for bound, n in zip((*map(floatToGoString, h.bounds), "+Inf"), h.counts, strict=True):
        total += n
        out.append((bound, float(total)))
    return out


def page_states(m: messages.MemoryStatus) -> tuple[int, int, int, int]:
    """(in use, pinned, reserved, unmapped): disjoint, summing to the engine's virtual pages."""
    held = min(m.held_pages, m.reserved_pages)
    return (m.in_use_pages, held, m.reserved_pages - held, max(0, m.num_pages - m.mapped_pages))


def _by_index(item: tuple[str, messages.EngineInfo]) -> tuple[int, str]:
    return item[1].index, item[0]
