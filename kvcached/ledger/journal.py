"""The journal file: a header, then batches of events, each batch in its own checksummed frame.

A journal is written by a serving process that may be killed at any moment and read back by
tools that must never act on a wrong event. So the format is built around two rules: a frame is
either wholly present and checked or it is not used, and damage is told apart from an
interrupted write. See ``docs/trace-format.md`` for the byte-level description.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from collections.abc import Iterator, Sequence
from typing import IO, BinaryIO, Final, Self

import msgspec

from kvcached.errors import (
    ConfigError,
    CorruptFrameError,
    EmptyJournalError,
    JournalError,
    JournalWriteError,
    MalformedEventError,
    NotAJournalError,
    TruncatedJournalError,
    UnsupportedVersionError,
)
from kvcached.ledger.events import FORMAT_VERSION, Event, Header, misfit
from kvcached.ledger.files import NotRegularFileError, create_or_truncate, open_regular

MAGIC: Final = b"KVCLEDGR"
# A bound on what a reader will allocate for one frame; a length above it can only be damage.
MAX_FRAME: Final = 64 * 1024 * 1024

_PREAMBLE: Final = struct.Struct("<8sHHI")  # magic, version, flags, reserved
_FRAME_HEAD: Final = struct.Struct("<III")  # payload length, payload crc, crc of the 8 before
_LEN_CRC: Final = struct.Struct("<II")
_U32: Final = struct.Struct("<I")
PREAMBLE_SIZE: Final = _PREAMBLE.size
FRAME_HEADER_SIZE: Final = _FRAME_HEAD.size
_READ_BUFFER: Final = 1 << 16

_encoder: Final = msgspec.msgpack.Encoder()


def encode_batch(events: Sequence[Event]) -> bytes:
    """The frame payload for ``events``, for :meth:`JournalWriter.append_encoded`."""
    return _encoder.encode(_as_list(events))


def _as_list(events: Sequence[Event]) -> Sequence[Event]:
    # msgspec encodes lists and tuples natively; any other sequence would be rejected.
    if type(events) is list or type(events) is tuple:
        return events
    return list(events)


def _frame_head(payload: bytes | bytearray | memoryview) -> bytes:
    first = _LEN_CRC.pack(len(payload), zlib.crc32(payload))
    return first + _U32.pack(zlib.crc32(first))


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _decode_error(exc: BaseException) -> str:
    """What msgspec found wrong with a payload; RecursionError is msgspec's word for nesting too
    deep to decode (msgpack arrays in arrays, a few bytes each), which only damage or a forged
    file makes."""
    if isinstance(exc, RecursionError):
        return "nested too deep to decode (arrays or maps within each other beyond msgspec's recursion limit)"
    return _one_line(exc)


# --------------------------------------------------------------------------------------------
# writing


class JournalWriter:
    """Appends batches of events to a journal, one frame per batch, one ``write`` per frame.

    The file is unbuffered on purpose: each frame reaches the kernel whole or fails there,
    so after an ``OSError`` the writer knows exactly where the last complete frame ends
    (``bytes_written``) and a killed process leaves at most one partial frame behind. Use
    :meth:`create`, or pass a file opened with ``open(path, "wb", buffering=0)``.

    NOTE: one frame per batch keeps the per-event overhead to the msgpack bytes of the event
    itself, lets a writer emit each batch with a single ``write``, and lets a reader stream a file
    of any size while holding no more than one frame.
    """

    def __init__(self, file: BinaryIO, path: str, header: Header) -> None:
        if header.format_version != FORMAT_VERSION:
            what = f"this writer writes format version {FORMAT_VERSION}, not the header's"
            raise ValueError(f"{what} {header.format_version}")
        self.path = path
        self._file = file
        self._buf = bytearray()
        self._encoder = msgspec.msgpack.Encoder()
        self._failed = False
        self.closed = False
        self.bytes_written = 0  # end of the last complete frame: a safe truncation point
        self.events_written = 0
        self.frames_written = 0
        payload = msgspec.msgpack.encode(header)
        start = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, 0) + _frame_head(payload) + payload
        self._write(start, 0, "the preamble and header")
        self.frames_written = 0

    @classmethod
    def create(cls, path: str | os.PathLike[str], header: Header) -> JournalWriter:
        """Creates the journal at ``path`` (a regular file there is replaced; a symlink, device
        or FIFO is refused, never written through) and writes its preamble and header."""
        name = os.fspath(path)
        try:
            # Unbuffered: a frame must reach the kernel in one write (see the class docstring).
            file = create_or_truncate(name)
        except NotRegularFileError as exc:
            raise JournalWriteError(f"{name}: cannot create the journal: {exc.strerror}") from None
        except OSError as exc:
            raise JournalWriteError(f"{name}: cannot create the journal: {_one_line(exc)}") from exc
        try:
            return cls(file, name, header)
        except BaseException:
            file.close()
            raise

    def append(self, events: Sequence[Event]) -> None:
        """Writes ``events`` as one frame. An empty batch writes nothing."""
        if not events:
            return
        buf = self._buf
        # Encoding straight behind a reserved frame header avoids copying the payload again.
        self._encoder.encode_into(_as_list(events), buf, FRAME_HEADER_SIZE)
        size = len(buf) - FRAME_HEADER_SIZE
        with memoryview(buf) as view:
            crc = zlib.crc32(view[FRAME_HEADER_SIZE:])
            _LEN_CRC.pack_into(buf, 0, size, crc)
            _U32.pack_into(buf, 8, zlib.crc32(view[:8]))
        self._write(buf, len(events), "a frame")

    def append_encoded(self, payload: bytes, count: int) -> None:
        """Writes a payload made by :func:`encode_batch` of ``count`` events as one frame."""
        self._write(_frame_head(payload) + payload, count, "a frame")

    def _write(self, frame: bytes | bytearray, count: int, what: str) -> None:
        at = self.bytes_written
        if self.closed:
            raise JournalWriteError(f"{self.path}: cannot write {what}: the journal is closed")
        if self._failed:
            raise JournalWriteError(
                f"{self.path}: cannot write {what}: an earlier write failed and the file may end "
                f"in a partial frame; call truncate_to_last_frame() to cut it back to byte {at}"
            )
        if len(frame) - FRAME_HEADER_SIZE > MAX_FRAME:
            raise JournalWriteError(
                f"{self.path}: cannot write {what} at byte {at}: its payload of "
                f"{len(frame) - FRAME_HEADER_SIZE} bytes exceeds {MAX_FRAME}; split the batch"
            )
        # Failed until proven written, so that even an interrupt mid-frame is remembered.
        self._failed = True
        try:
            done = self._file.write(frame) or 0
            # Regular files only write short when the disk is filling up; finish or fail.
            while done < len(frame):
                wrote = self._file.write(frame[done:])
                if not wrote:
                    raise OSError(f"short write ({done} of {len(frame)} bytes)")
                done += wrote
        except OSError as exc:
            raise JournalWriteError(
                f"{self.path}: writing {what} at byte {at} failed: {_one_line(exc)}; "
                f"the journal is complete up to byte {at} (truncate_to_last_frame())"
            ) from exc
        self._failed = False
        self.bytes_written = at + len(frame)
        self.events_written += count
        self.frames_written += 1

    def truncate_to_last_frame(self) -> int:
        """Cuts a partial frame left by a failed write; returns the new size of the file."""
        at = self.bytes_written
        with self._failing(f"truncating back to byte {at}"):
            self._file.truncate(at)
            self._file.seek(at)
        self._failed = False
        return at

    def flush(self) -> None:
        with self._failing("flush"):
            self._file.flush()

    def fsync(self) -> None:
        """Asks the kernel to put every written frame on the disk."""
        with self._failing("fsync"):
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with self._failing("close"):
                self._file.close()

    @contextlib.contextmanager
    def _failing(self, what: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            raise JournalWriteError(f"{self.path}: {what} failed: {_one_line(exc)}") from exc

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# reading


class TornTail(msgspec.Struct, frozen=True):
    """The last frame was cut off by an interrupted write; its events were never complete.

    ``frame_bytes_expected`` is the whole frame's size (header and payload) when the frame
    header is complete, else the frame header's size, the least a frame can take.

    NOTE: a frame that is cut off at the end of the file (the one write a killed writer left
    unfinished) is a *torn tail*, which costs only that frame's events.
    """

    offset: int
    frame_bytes_expected: int
    bytes_present: int


class JournalContents(msgspec.Struct, frozen=True):
    """Everything :func:`read_journal` found in a journal."""

    path: str
    header: Header
    events: list[Event]
    torn_tail: TornTail | None


class JournalReader:
    """Streams a journal: the header on construction, then events frame by frame.

    Memory is bounded by the largest frame, never by the file. Iterate once, with ``for event
    in reader`` or :meth:`batches`; afterwards ``torn_tail`` says whether the last frame was
    cut off. Every problem is a :class:`~kvcached.errors.JournalError` naming file and offset.

    NOTE: a reader opens only regular files (a FIFO would block it, a device never end) and
    refuses a header whose geometry no GPU holds before anything is allocated for it
    (``events.Header``).
    """

    def __init__(self, path: str | os.PathLike[str], *, file: IO[bytes] | None = None) -> None:
        self.path = os.fspath(path)
        self.torn_tail: TornTail | None = None
        self.events_read = 0
        self.frames_read = 0  # event frames; the header frame is not counted
        self.offset = 0  # end of the last frame read: where the next one starts
        self._started = False
        self._owns_file = file is None
        if file is None:
            # Regular files only: a FIFO without a writer would block open() forever, a device
            # such as /dev/zero never ends; open_regular refuses both without blocking.
            try:
                file, _ = open_regular(self.path, buffering=_READ_BUFFER)
            except NotRegularFileError as exc:
                raise JournalError(self.path, 0, f"cannot open: {exc.strerror}") from None
            except OSError as exc:
                raise JournalError(self.path, 0, f"cannot open: {_one_line(exc)}") from exc
        self._file: IO[bytes] = file
        self._decoder = msgspec.msgpack.Decoder(list[Event])
        try:
            self.header = self._read_start()
        except BaseException:
            self.close()
            raise

    def _read(self, size: int) -> bytes:
        try:
            return self._file.read(size)
        except OSError as exc:
            raise JournalError(self.path, self.offset, f"read failed: {_one_line(exc)}") from exc

    def _read_start(self) -> Header:
        path = self.path
        start = self._read(PREAMBLE_SIZE)
        if not start:
            raise EmptyJournalError(path, 0, "the file is empty (0 bytes), not a kvcached journal")
        if not start.startswith(MAGIC[: len(start)]):
            raise NotAJournalError(path, 0, f"not a kvcached journal: starts with {start[:8]!r}, expected {MAGIC!r}")
        if len(start) < PREAMBLE_SIZE:
            what = f"the file ends inside the {PREAMBLE_SIZE}-byte preamble"
            raise TruncatedJournalError(path, len(start), what)
        _, version, flags, _ = _PREAMBLE.unpack(start)
        if version == 0 or version > FORMAT_VERSION:
            newer = "written by a newer kvcached: " if version else "invalid: "
            what = f"{newer}format version {version}, this reader reads up to {FORMAT_VERSION}"
            raise UnsupportedVersionError(path, 8, what)
        if flags:
            # Flags are reserved for features a reader must understand; refuse rather than guess.
            raise UnsupportedVersionError(path, 10, f"unknown preamble flags 0x{flags:04x}; this reader knows none")
        self.offset = PREAMBLE_SIZE
        frame = self._read_frame()
        if not isinstance(frame, bytes):
            present = frame.bytes_present if frame else 0
            what = f"the file ends inside the header frame ({present} bytes of it present)"
            raise TruncatedJournalError(path, PREAMBLE_SIZE + present, what)
        try:
            header = msgspec.msgpack.decode(frame, type=Header)
        except (msgspec.DecodeError, RecursionError) as exc:
            raise MalformedEventError(
                path, PREAMBLE_SIZE, -1, f"header: not a valid header: {_decode_error(exc)}"
            ) from None
        except ConfigError as exc:  # a geometry beyond the ledger's bounds (Header.__post_init__)
            raise MalformedEventError(path, PREAMBLE_SIZE, -1, f"header: {_one_line(exc)}") from None
        if header.format_version != version:
            what = f"header: format_version {header.format_version} is not the preamble's {version}"
            raise MalformedEventError(path, PREAMBLE_SIZE, -1, what)
        if (why := misfit(header)) is not None:
            # Said here, about the file: the ledger would refuse the geometry with advice on the
            # serving settings, which mean nothing to someone reading a trace.
            what = f"header: {why}; a kvcached engine never writes such a header (damaged or hand-made)"
            raise MalformedEventError(path, PREAMBLE_SIZE, -1, what)
        self.offset = PREAMBLE_SIZE + FRAME_HEADER_SIZE + len(frame)
        return header

    def _read_frame(self) -> bytes | TornTail | None:
        """The checked payload of the frame at ``self.offset``; None at a clean end.

        NOTE: each frame carries a CRC of its payload and a separate CRC of its own length, so a
        flipped length is reported as corruption instead of being mistaken for a file that
        merely ends early."""
        at = self.offset
        head = self._read(FRAME_HEADER_SIZE)
        if len(head) < FRAME_HEADER_SIZE:
            return TornTail(at, FRAME_HEADER_SIZE, len(head)) if head else None
        size, crc, head_crc = _FRAME_HEAD.unpack(head)
        if zlib.crc32(head[:8]) != head_crc:
            raise CorruptFrameError(self.path, at, "frame header checksum mismatch (damaged length or checksum)")
        if size > MAX_FRAME:
            raise CorruptFrameError(self.path, at, f"frame length {size} exceeds {MAX_FRAME}")
        payload = self._read(size)
        if len(payload) < size:
            return TornTail(at, FRAME_HEADER_SIZE + size, FRAME_HEADER_SIZE + len(payload))
        if zlib.crc32(payload) != crc:
            raise CorruptFrameError(self.path, at, f"frame payload checksum mismatch ({size}-byte payload)")
        return payload

    def batches(self) -> Iterator[tuple[int, int, list[Event]]]:
        """Yields ``(index of the batch's first event, frame offset, events)`` per frame."""
        if self._started:
            raise RuntimeError(f"{self.path}: a JournalReader can be iterated only once")
        self._started = True
        decode = self._decoder.decode
        try:
            while True:
                at = self.offset
                payload = self._read_frame()
                if isinstance(payload, TornTail):
                    self.torn_tail = payload
                    return
                if payload is None:
                    return
                try:
                    events = decode(payload)
                except (msgspec.DecodeError, RecursionError) as exc:
                    raise self._malformed(payload, at, exc) from None
                first = self.events_read
                self.offset = at + FRAME_HEADER_SIZE + len(payload)
                self.frames_read += 1
                self.events_read = first + len(events)
                yield first, at, events
        finally:
            self.close()

    def _malformed(self, payload: bytes, at: int, exc: msgspec.DecodeError | RecursionError) -> JournalError:
        # Only on failure: decode lazily to find which element is bad, for an exact index.
        first = self.events_read
        try:
            items = msgspec.msgpack.decode(payload, type=list[msgspec.Raw])
        except (msgspec.DecodeError, RecursionError) as outer:
            # Skipping an element to find the next one recurses into it: an element nested
            # deeper than msgspec's recursion limit cannot be skipped, only reported.
            return MalformedEventError(
                self.path, at, first, f"frame payload is not an array of events: {_decode_error(outer)}"
            )
        one = msgspec.msgpack.Decoder(Event)
        for i, item in enumerate(items):
            try:
                one.decode(item)
            except (msgspec.DecodeError, RecursionError) as inner:
                return MalformedEventError(self.path, at, first + i, f"not a valid event: {_decode_error(inner)}")
        return MalformedEventError(self.path, at, first, f"bad frame payload: {_decode_error(exc)}")

    def __iter__(self) -> Iterator[Event]:
        for _, _, events in self.batches():
            yield from events

    def close(self) -> None:
        if self._owns_file:
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_journal(path: str | os.PathLike[str]) -> JournalContents:
    """Reads a whole journal into memory; a torn tail is reported, not raised."""
    reader = JournalReader(path)
    events: list[Event] = []
    for _, _, batch in reader.batches():
        events += batch
    return JournalContents(reader.path, reader.header, events, reader.torn_tail)
