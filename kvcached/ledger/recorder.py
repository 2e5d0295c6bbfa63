"""The live path of the ledger: every producer (allocator, vLLM bridge) emits through here.

Emitting applies the event to the ledger first, so the ledger is never behind the engine, and
then hands it to the journal if one is attached. A journal that fails (disk full, file gone)
is dropped with one log line and serving goes on: losing the trace is better than losing the
server. The allocator subscribes to learn that pages became releasable because of an event it
did not emit itself (a build boundary, a job report), so that it can give them back at once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
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
        self._listeners: list[Callable[[list[int]], None]] = []

    @classmethod
    def for_header(cls, header: Header, *, journal_path: str | None = None, batch: int = 256) -> Recorder:
        """A recorder with a fresh ledger; journals to ``journal_path`` or ``$KVCACHED_LEDGER_JOURNAL``."""
        path = journal_path if journal_path is not None else os.environ.get(JOURNAL_ENV) or None
        journal = JournalWriter.create(path, header) if path else None
        return cls(Ledger(header), journal, batch=batch)

    def subscribe(self, listener: Callable[[list[int]], None]) -> None:
        """Call ``listener(pages)`` after any event that made ``pages`` releasable."""
        self._listeners.append(listener)

    def emit(self, event: Event) -> None:
        ledger = self.ledger
        ledger.apply(event)
        if self.sink is not None:
            self.sink.put(event)
        elif self.journal is not None:
            self._pending.append(event)
            if len(self._pending) >= self._batch:
                self.flush()
        if ledger._fresh:
            pages = ledger.take_fresh_releasable()
            for listener in self._listeners:
                listener(pages)

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
