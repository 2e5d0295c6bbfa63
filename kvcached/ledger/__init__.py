from .events import FORMAT_VERSION, Event, Header, JobKind, Policy, PoolGeometry
from .findings import PageStatus, PinReason, Violation
from .ledger import Ledger

__all__ = [
    "FORMAT_VERSION",
    "Event",
    "Header",
    "JobKind",
    "Ledger",
    "PageStatus",
    "PinReason",
    "Policy",
    "PoolGeometry",
    "Violation",
]
