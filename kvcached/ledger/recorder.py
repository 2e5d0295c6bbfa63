"""The live path of the ledger: every producer (allocator, manager, vLLM bridge) emits through here.

Emitting applies the event to the ledger first, so the ledger is never behind the engine, and
then hands it to the journal if one is attached; that is all it does. It calls nobody back, so
no event is ever emitted from inside another's emit: the allocator learns which pages an event
let go by draining the ledger's queue of them afterwards (``PageAllocator.drain_releasable``).
A journal that fails (disk full, file gone) is dropped with one log line and serving goes on:
losing the trace is better than losing the server.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

from ..errors import JournalWriteError
from .events import Event, Header
from .journal import JournalWriter
from .ledger import Ledger

log = logging.getLogger("kvcached.ledger")

JOURNAL_ENV = "KVCACHED_LEDGER_JOURNAL"


class EventSink(Protocol):
    """Where events go off the hot path (the journal service's producer end)."""

    def put(self, event: Event) -> None: ...


class Recorder:
    """Applies events to ``ledger`` and, if ``journal`` is set, journals them in batches."""

    def __init__(
        self, ledger: Ledger, journal: JournalWriter | None = None, *, batch: int = 256, sink: EventSink | None = None
    ) -> None:
        self.ledger = ledger
        self.journal = journal
        self.sink = sink  # e.g. BackgroundService(...).producer: journaled by the service instead
        self._batch = batch
        self._pending: list[Event] = []
        # The monotonic reading that the header's wall-clock base stands for, taken once: a build
        # boundary's time is then immune to the wall clock being stepped (NTP) while serving.
        base = ledger.tables.header.clock_base_unix
        self._mono_base = time.monotonic() - (time.time() - base) if base else None

    def stamp(self) -> int | None:
        """Now, for a ``BuildBoundary``: microseconds after the header's ``clock_base_unix``, or
        None when the header has no clock base (tests and scenarios, whose traces stay exact)."""
        if self._mono_base is None:
            return None
        return max(0, int((time.monotonic() - self._mono_base) * 1e6))

    @classmethod
    def for_header(cls, header: Header, *, journal_path: str | None = None, batch: int = 256) -> Recorder:
        """A recorder with a fresh ledger; journals to ``journal_path`` or ``$KVCACHED_LEDGER_JOURNAL``."""
        path = journal_path if journal_path is not None else os.environ.get(JOURNAL_ENV) or None
        journal = JournalWriter.create(path, header) if path else None
        return cls(Ledger(header), journal, batch=batch)

    def emit(self, event: Event) -> None:
        self.ledger.apply(event)
        if self.sink is not None:
            self.sink.put(event)
        elif self.journal is not None:
            self._pending.append(event)
            if len(self._pending) >= self._batch:
                self.flush()

    def flush(self) -> None:
        if self.journal is None or not self._pending:
            return
        batch, self._pending = self._pending, []
        try:
            self.journal.append(batch)
        except JournalWriteError as e:
            log.error("kvcached: journaling stopped, serving goes on: %s", e)
            journal, self.journal = self.journal, None
            try:  # leave a journal that reads cleanly up to its last whole frame
                journal.truncate_to_last_frame()
                journal.close()
            except (OSError, JournalWriteError):
                pass

    def close(self) -> None:
        self.flush()
        if self.journal is not None:
            self.journal.close()
            self.journal = None
