"""The wire types of the live view, and what the live view needs from the service that feeds it.

Every message, in both directions, is a 4-byte big-endian length followed by that many bytes of
msgpack (``frame``). The journal service (``ledger_service``), the live view (``live``) and
``kvctl`` all speak these types; keeping them here, with the ``LiveSource`` protocol that the
service satisfies, is what lets the service and the live view depend on this module and not on
each other (before, ``live`` imported the service for its type and the service imported ``live``
for its status structs and server).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Literal, Protocol

import msgspec

from kvcached.ledger.findings import PageStatus

if TYPE_CHECKING:
    from kvcached.ledger.ledger import Ledger

MAX_REQUEST: Final = 4096
MAX_REPLY: Final = 256 << 20
LEN: Final = struct.Struct(">I")


class Request(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    op: Literal["pins", "status", "why", "tail"]
    page: int | None = None  # for why
    limit: int | None = None  # for pins: at most this many rows


class PinRow(msgspec.Struct, frozen=True, array_like=True):
    """One pin on one page; a page with three pins has three rows."""

    page: int
    kind: Literal["job", "grace", "window"]
    since_build: int
    job: int | None = None
    job_kind: Literal["store", "load"] | None = None
    request: str | None = None
    waiting_workers: int | None = None
    until_build: int | None = None


class PinsReply(msgspec.Struct, frozen=True, kw_only=True, tag="pins", tag_field="type"):
    index: int  # events applied by the replica
    build: int
    pinned_pages: int
    lossy: bool  # the replica saw a gap: pins may be missing or stale
    truncated: bool
    rows: list[PinRow]


class JournalStatus(msgspec.Struct, frozen=True, kw_only=True):
    state: Literal["off", "starting", "writing", "stopped", "closed"]
    path: str | None
    durability: str
    segment: int
    segment_bytes: int
    events_written: int  # global index after the last event written (page cache at least)
    events_durable: int  # global index after the last event known fsynced
    snapshot_index: int | None
    error: str | None


class HandoffStatus(msgspec.Struct, frozen=True, kw_only=True):
    capacity: int
    queued: int
    dropped: int
    gaps: int
    episodes: int


class LedgerCounts(msgspec.Struct, frozen=True, kw_only=True):
    """The replica's view; it lags the engine by what the hand-off holds."""

    policy: str
    index: int  # events applied
    build: int
    num_pages: int
    mapped_pages: int
    pinned_pages: int
    releasable_pages: int
    outstanding_jobs: int
    violations: int
    lossy: bool  # a gap was applied: the counts may be off by what was dropped
    dropped_events: int  # the sum of the gaps applied


class StatusReply(msgspec.Struct, frozen=True, kw_only=True, tag="status", tag_field="type"):
    pid: int
    uptime_s: float
    events: int  # events the service has taken from the hand-off
    ledger: LedgerCounts | None  # None: the service keeps no replica
    journal: JournalStatus
    handoff: HandoffStatus
    clients: int
    dropped_clients: int


class WhyReply(msgspec.Struct, frozen=True, tag="why", tag_field="type"):
    status: PageStatus


class EventsReply(msgspec.Struct, frozen=True, tag="events", tag_field="type"):
    first: int  # global index of the first event
    events: msgspec.Raw  # a msgpack array of events, as in a journal frame


class ErrorReply(msgspec.Struct, frozen=True, tag="error", tag_field="type"):
    message: str


Reply = PinsReply | StatusReply | WhyReply | EventsReply | ErrorReply

_encoder: Final = msgspec.msgpack.Encoder()


def frame(message: Request | Reply) -> bytes:
    body = _encoder.encode(message)
    return LEN.pack(len(body)) + body


class LiveSource(Protocol):
    """What the live view reads from the service: its replica, its counters and its batches."""

    replica: Ledger | None  # None: the service keeps no replica
    index: int  # global index of the next event the service takes
    started_unix: float
    listeners: list[Callable[[int, bytes], None]]  # (first index, encoded batch), on the loop

    def journal_status(self) -> JournalStatus: ...

    def handoff_status(self) -> HandoffStatus: ...
