"""One error hierarchy for kvcached, so that callers (the CLI, the vLLM plugin) can catch
``KvcachedError`` and print its one-line message instead of a traceback.

Every message names what went wrong and where (file and byte offset, event index, setting),
and, where there is one, what to change.
"""

from __future__ import annotations


class KvcachedError(Exception):
    """Base of every error kvcached raises on purpose."""


class ConfigError(KvcachedError):
    """A setting or a combination of settings kvcached does not support."""


class JournalError(KvcachedError):
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


class JournalWriteError(KvcachedError):
    """The journal could not be written (disk full, permissions); serving goes on without it."""


class BackendError(KvcachedError):
    """A memory backend refused or failed an operation: a page mapped twice, an index out of
    range, a closed backend, or a driver call that failed (the message names the call and the
    driver's error name)."""
