"""One error hierarchy for kvcached, so that callers (the CLI, the vLLM plugin) can catch
``KvcachedError`` and print its one-line message instead of a traceback.

Every message names what went wrong and where (file and byte offset, event index, setting),
and, where there is one, what to change. Below the base, a few parents say what a caller can
do about an error (``ConfigError``, ``CapacityError``, ``ConsistencyError``, ``BackendError``,
``TraceError``, ``ServiceError``). The specific errors live with the code that raises them and
subclass one. The tree is msgspec's in spirit (``msgspec/__init__.pyi``: one base, a few kinds).
"""

from __future__ import annotations


class KvcachedError(Exception):
    """Base of every error kvcached raises on purpose."""


class ConfigError(KvcachedError):
    """A setting (or a combination of settings), a setup or a vLLM that kvcached does not
    support: change it (``kvcached.vllm.patches.PatchError``: a vLLM whose internals moved)."""


class LimitRefusedError(KvcachedError):
    """A memory limit below what one request of the model needs: say the floor, offer --force."""


class CapacityError(KvcachedError):
    """No memory for the request now: free blocks, or raise the memory limit or the budget
    (``page_allocator.OutOfPagesError``, ``kv_cache_manager.OutOfBlocksError``)."""


class ConsistencyError(KvcachedError):
    """Two views of the same blocks or pages disagree (kvcached's and vLLM's, the scheduler's and
    a worker's): a bug, or an unsupported executor, one that does not carry vLLM's step whole.

    NOTE: the engine stops, and its flight recorder keeps the events that led there."""


class TraceError(KvcachedError):
    """A trace, journal or snapshot that cannot be read or used (``JournalError`` and its kinds,
    which say the file and byte offset)."""


class ServiceError(KvcachedError):
    """A file or socket the ledger service keeps cannot be used: the journal being written, a
    budget file, the live view ``kvctl`` talks to."""


class JournalError(TraceError):
    """A journal file cannot be read. ``path`` and ``offset`` say where."""

    def __init__(self, path: str, offset: int, what: str) -> None:
        self.path = path
        self.offset = offset
        self.what = what
        super().__init__(f"{path}: at byte {offset}: {what}")


class EmptyJournalError(JournalError):
    """The file has no bytes at all."""


class NotAJournalError(JournalError):
    """The file does not start with the journal magic: another kind of file."""


class UnsupportedVersionError(JournalError):
    """The journal was written in a format version this reader does not know."""


class TruncatedJournalError(JournalError):
    """The file ends before its header is complete: nothing in it can be used."""


class CorruptFrameError(JournalError):
    """A frame's bytes are all there but do not check out (checksum or length)."""


class MalformedEventError(JournalError):
    """A frame checks out but holds something that is not a valid event."""

    def __init__(self, path: str, offset: int, event_index: int, what: str) -> None:
        self.event_index = event_index
        super().__init__(path, offset, f"event {event_index}: {what}")


class JournalWriteError(ServiceError):
    """The journal could not be written (disk full, permissions); serving goes on without it."""


class BackendError(KvcachedError):
    """A memory backend refused or failed an operation: a page mapped twice, an index out of
    range, a closed backend, or a driver call that failed (the message names the call and the
    driver's error name)."""
