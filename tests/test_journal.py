"""The journal format: round trips, streaming, and every way a file can be wrong.

Frames are built here independently of the writer (struct + zlib), following
docs/trace-format.md, so that the tests pin the documented bytes, not just a self-consistent
pair of reader and writer.
"""

from __future__ import annotations

import errno
import importlib.util
import io
import os
import struct
import sys
import tracemalloc
import zlib
from collections import deque
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcached.errors import (
    CorruptFrameError,
    EmptyJournalError,
    JournalError,
    JournalWriteError,
    MalformedEventError,
    NotAJournalError,
    TruncatedJournalError,
    UnsupportedVersionError,
)
from kvcached.ledger.events import (
    FORMAT_VERSION,
    BlockAlloc,
    BlockFree,
    BuildBoundary,
    Event,
    Gap,
    Header,
    JobBuilt,
    JobFailed,
    JobKind,
    JobReported,
    MemoryLimit,
    PageMapped,
    PageUnmapped,
    Policy,
    PoolGeometry,
    PrefixCacheReset,
    RequestAdded,
    RequestBlocks,
    RequestFinished,
    RequestPreempted,
    WindowHold,
    WindowRelease,
)
from kvcached.ledger.journal import (
    MAX_FRAME,
    JournalReader,
    JournalWriter,
    TornTail,
    encode_batch,
    read_journal,
)
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.segments import (
    RotatedJournal,
    read_snapshot,
    segment_header,
    segment_path,
    write_snapshot,
)
from kvcached.ledger.state import LedgerSnapshot

ROOT = Path(__file__).resolve().parent.parent

HEADER = Header(
    page_bytes=2 * 1024 * 1024,
    pools=(PoolGeometry(block_bytes=64 * 1024, num_blocks=4096), PoolGeometry(32768, 100)),
    workers=2,
    policy=Policy.LEDGER,
    producer={"kvcached": "test"},
    meta={"scenario": "unit"},
)

ALL_EVENTS: list[Event] = [
    RequestAdded(req=0, name="cmpl-5f1c2a-0"),
    BlockAlloc(pool=0, blocks=(1000, 1001, 1002)),
    WindowHold(req=0, pool=1, blocks=(7,)),
    JobBuilt(job=3, kind=JobKind.STORE, req=0, blocks=((1000, 1001), (7,)), workers=2),
    BuildBoundary(build=0),
    JobReported(job=3, count=2),
    PageMapped(page=12),
    BlockFree(pool=0, blocks=(1002,)),
    WindowRelease(req=0),
    RequestFinished(req=0),
    RequestPreempted(req=1),
    PrefixCacheReset(),
    MemoryLimit(pages=512),
    PageUnmapped(page=12),
    Gap(dropped=4),
    JobBuilt(job=4, kind=JobKind.LOAD, req=1, blocks=(tuple(range(3000, 3016)),), workers=1),
    RequestBlocks(req=1, pool=0, fresh=(3000,), shared=(5,)),
    JobFailed(job=4),
]
BATCHES: list[list[Event]] = [ALL_EVENTS[:5], ALL_EVENTS[5:6], ALL_EVENTS[6:]]


def frame(payload: bytes) -> bytes:
    first = struct.pack("<II", len(payload), zlib.crc32(payload))
    return first + struct.pack("<I", zlib.crc32(first)) + payload


def preamble(version: int = FORMAT_VERSION, flags: int = 0) -> bytes:
    return b"KVCLEDGR" + struct.pack("<HHI", version, flags, 0)


def journal_bytes(batches: list[list[Event]], header: Header = HEADER) -> bytes:
    out = io.BytesIO()
    writer = JournalWriter(out, "mem", header)
    for batch in batches:
        writer.append(batch)
    return out.getvalue()


def read_bytes(data: bytes, name: str = "mem") -> tuple[list[Event], JournalReader]:
    reader = JournalReader(name, file=io.BytesIO(data))
    return list(reader), reader


def check_message(err: JournalError, path: object, offset: int) -> None:
    message = str(err)
    assert "\n" not in message
    assert str(path) in message
    assert f"at byte {offset}" in message
    assert err.offset == offset


# --- round trips ----------------------------------------------------------------------------


def test_round_trip_all_event_types(tmp_path: Path) -> None:
    path = tmp_path / "j.kvj"
    with JournalWriter.create(path, HEADER) as writer:
        for batch in BATCHES:
            writer.append(batch)
        writer.flush()
        writer.fsync()
    assert writer.events_written == len(ALL_EVENTS)
    assert writer.frames_written == len(BATCHES)
    assert writer.bytes_written == path.stat().st_size

    assert {type(e) for e in ALL_EVENTS} == set(Event.__args__)
    with JournalReader(path) as reader:
        assert reader.header == HEADER
        batches = list(reader.batches())
    assert [b for _, _, b in batches] == BATCHES
    assert [first for first, _, _ in batches] == [0, 5, 6]
    assert reader.torn_tail is None
    assert reader.events_read == len(ALL_EVENTS)
    assert reader.frames_read == len(BATCHES)
    assert reader.offset == path.stat().st_size

    contents = read_journal(path)
    assert contents.header == HEADER
    assert contents.events == ALL_EVENTS
    assert contents.torn_tail is None


def test_bytes_follow_the_documented_layout() -> None:
    expected = preamble() + frame(msgspec.msgpack.encode(HEADER))
    expected += b"".join(frame(msgspec.msgpack.encode(batch)) for batch in BATCHES)
    assert journal_bytes(BATCHES) == expected
    # Events are arrays led by their integer tag.
    assert msgspec.msgpack.decode(encode_batch([BlockAlloc(0, (1000,))])) == [[1, 0, [1000]]]


def test_append_encoded_and_any_sequence_match_append() -> None:
    out = io.BytesIO()
    writer = JournalWriter(out, "mem", HEADER)
    writer.append_encoded(encode_batch(BATCHES[0]), len(BATCHES[0]))
    writer.append(deque(BATCHES[1]))
    writer.append(tuple(BATCHES[2]))
    writer.append([])  # writes nothing
    assert out.getvalue() == journal_bytes(BATCHES)
    assert writer.events_written == len(ALL_EVENTS)


def test_header_may_grow_fields_without_a_version_bump() -> None:
    fields = msgspec.to_builtins(HEADER)
    fields["added_in_a_later_release"] = [1, 2, 3]
    data = preamble() + frame(msgspec.msgpack.encode(fields)) + frame(encode_batch(ALL_EVENTS))
    events, reader = read_bytes(data)
    assert reader.header == HEADER
    assert events == ALL_EVENTS


def test_reader_streams_with_memory_bounded_by_one_frame(tmp_path: Path) -> None:
    path = tmp_path / "big.kvj"
    name = "x" * 50_000
    with JournalWriter.create(path, HEADER) as writer:
        for i in range(160):
            writer.append([RequestAdded(i, name)])
    size = path.stat().st_size
    assert size > 8_000_000
    tracemalloc.start()
    try:
        count = 0
        for event in JournalReader(path):
            assert isinstance(event, RequestAdded)
            count += 1
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count == 160
    assert peak < 600_000, f"reader peaked at {peak} bytes for a {size}-byte file"


def test_reader_iterates_once() -> None:
    _, reader = read_bytes(journal_bytes(BATCHES))
    with pytest.raises(RuntimeError):
        list(reader)


# --- files that are not (whole) journals ----------------------------------------------------

GOOD = journal_bytes(BATCHES)
HEADER_END = 16 + 12 + len(msgspec.msgpack.encode(HEADER))


@pytest.mark.parametrize(
    ("data", "error", "offset"),
    [
        pytest.param(b"", EmptyJournalError, 0, id="empty"),
        pytest.param(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", NotAJournalError, 0, id="png"),
        pytest.param(b"hello, world\n", NotAJournalError, 0, id="text"),
        pytest.param(b"KVX", NotAJournalError, 0, id="short-not-magic"),
        pytest.param(b"KVCLEDGX" + GOOD[8:], NotAJournalError, 0, id="wrong-magic"),
        pytest.param(b"KVC", TruncatedJournalError, 3, id="short-prefix-of-magic"),
        pytest.param(GOOD[:12], TruncatedJournalError, 12, id="inside-preamble"),
        pytest.param(GOOD[:16], TruncatedJournalError, 16, id="no-header-frame"),
        pytest.param(GOOD[:20], TruncatedJournalError, 20, id="inside-header-frame-head"),
        pytest.param(GOOD[: HEADER_END - 1], TruncatedJournalError, HEADER_END - 1, id="header"),
        pytest.param(preamble(FORMAT_VERSION + 1) + GOOD[16:], UnsupportedVersionError, 8, id="newer-version"),
        pytest.param(preamble(0) + GOOD[16:], UnsupportedVersionError, 8, id="version-0"),
        pytest.param(preamble(FORMAT_VERSION, 4) + GOOD[16:], UnsupportedVersionError, 10, id="flags"),
    ],
)
def test_bad_start(tmp_path: Path, data: bytes, error: type[JournalError], offset: int) -> None:
    path = tmp_path / "bad.kvj"
    path.write_bytes(data)
    with pytest.raises(error) as info:
        read_journal(path)
    assert type(info.value) is error
    check_message(info.value, path, offset)


def test_newer_version_message() -> None:
    newer, mine = FORMAT_VERSION + 1, FORMAT_VERSION
    message = f"written by a newer kvcached: format version {newer}, this reader reads up to {mine}"
    with pytest.raises(UnsupportedVersionError, match=message):
        read_bytes(preamble(newer) + GOOD[16:])


def test_boundary_time_is_a_trailing_field_both_ways() -> None:
    # What kvcached wrote before build boundaries carried a time (traces/ holds such files): the
    # two-element array decodes with no time, and a header without a clock base reads 0.0.
    pools = [{"block_bytes": 65536, "num_blocks": 64}]
    old = preamble() + frame(msgspec.msgpack.encode({"page_bytes": 2 << 20, "pools": pools}))
    events, reader = read_bytes(old + frame(msgspec.msgpack.encode([[0, 4]])))
    assert reader.header.clock_base_unix == 0.0
    assert events == [BuildBoundary(4)] and events[0].at_us is None  # type: ignore[union-attr]
    timed = journal_bytes([[BuildBoundary(5, at_us=1_500_000), BlockAlloc(0, (1,))]])
    assert read_bytes(timed)[0] == [BuildBoundary(5, 1_500_000), BlockAlloc(0, (1,))]

    # A reader that predates the field: the event as it was declared then, a two-field array.
    class OldBoundary(msgspec.Struct, frozen=True, array_like=True, tag=0, tag_field="t"):
        build: int

    payload = msgspec.msgpack.encode([BuildBoundary(5, at_us=1_500_000)])
    assert msgspec.msgpack.decode(payload, type=list[OldBoundary]) == [OldBoundary(5)]


def test_header_that_is_not_a_header() -> None:
    data = preamble() + frame(msgspec.msgpack.encode({"page_bytes": "big"}))
    with pytest.raises(MalformedEventError, match="header") as info:
        read_bytes(data)
    assert info.value.event_index == -1
    check_message(info.value, "mem", 16)


def frame_offsets(data: bytes) -> list[int]:
    offsets, at = [], HEADER_END
    while at < len(data):
        offsets.append(at)
        at += 12 + struct.unpack_from("<I", data, at)[0]
    assert at == len(data)
    return offsets


@pytest.mark.parametrize(
    ("byte", "why"),
    [
        (0, "header checksum"),
        (3, "header checksum"),
        (5, "header checksum"),
        (9, "header checksum"),
        (14, "payload checksum"),
    ],
)
@pytest.mark.parametrize("which", [0, 1, 2])
def test_flipped_byte_is_corruption_anywhere(byte: int, why: str, which: int) -> None:
    at = frame_offsets(GOOD)[which]
    data = bytearray(GOOD)
    data[at + byte] ^= 0x10
    reader = JournalReader("mem", file=io.BytesIO(bytes(data)))
    seen: list[Event] = []
    with pytest.raises(CorruptFrameError, match=why) as info:
        for event in reader:
            seen.append(event)
    check_message(info.value, "mem", at)
    assert seen == [e for batch in BATCHES[:which] for e in batch]


def test_length_above_max_frame_is_corruption() -> None:
    first = struct.pack("<II", MAX_FRAME + 1, 0)
    data = GOOD + first + struct.pack("<I", zlib.crc32(first)) + b"\0" * 100
    with pytest.raises(CorruptFrameError, match="exceeds") as info:
        read_bytes(data)
    check_message(info.value, "mem", len(GOOD))


@pytest.mark.parametrize(
    ("payload", "index", "match"),
    [
        pytest.param([[99, 1]], 0, "Invalid value 99", id="unknown-tag"),
        pytest.param([[0, 5], [1, 0, [-5]]], 1, ">= 0", id="negative-block"),
        pytest.param([[4, 1, 0]], 0, ">= 1", id="zero-count"),
        pytest.param([[1, 0]], 0, "at least length 3", id="missing-field"),
        pytest.param(7, 0, "not an array", id="not-an-array"),
    ],
)
def test_malformed_event_has_exact_index(payload: object, index: int, match: str) -> None:
    index += len(ALL_EVENTS)  # the parameter counts from the first event after GOOD's
    data = GOOD + frame(msgspec.msgpack.encode(payload))
    reader = JournalReader("mem", file=io.BytesIO(data))
    seen: list[Event] = []
    with pytest.raises(MalformedEventError, match=match) as info:
        for event in reader:
            seen.append(event)
    assert info.value.event_index == index
    assert f"event {index}:" in str(info.value)
    check_message(info.value, "mem", len(GOOD))
    assert seen == ALL_EVENTS


def test_empty_payload_is_malformed() -> None:
    with pytest.raises(MalformedEventError):
        read_bytes(GOOD + frame(b""))


# --- torn tails -----------------------------------------------------------------------------


@pytest.mark.parametrize("cut", [1, 11, 12, 13, -1])
def test_torn_last_frame_keeps_earlier_events(cut: int) -> None:
    last = frame_offsets(GOOD)[-1]
    size = len(GOOD) - last
    keep = cut if cut > 0 else size + cut
    events, reader = read_bytes(GOOD[: last + keep])
    assert events == BATCHES[0] + BATCHES[1]
    expected = size if keep >= 12 else 12
    assert reader.torn_tail == TornTail(offset=last, frame_bytes_expected=expected, bytes_present=keep)
    assert reader.offset == last


def test_torn_tail_from_read_journal(tmp_path: Path) -> None:
    path = tmp_path / "torn.kvj"
    path.write_bytes(GOOD[:-3])
    contents = read_journal(path)
    assert contents.events == BATCHES[0] + BATCHES[1]
    assert contents.torn_tail is not None


# --- property tests -------------------------------------------------------------------------

ids = st.integers(0, 2**31 - 1)
blocks = st.lists(ids, max_size=4).map(tuple)
nn = st.integers(0, 2**40)
pos = st.integers(1, 2**20)
events = st.one_of(
    st.builds(BuildBoundary, nn),
    st.builds(BlockAlloc, nn, blocks),
    st.builds(BlockFree, nn, blocks),
    st.builds(JobBuilt, nn, st.sampled_from(JobKind), nn, st.lists(blocks, max_size=2).map(tuple), pos),
    st.builds(JobReported, nn, pos),
    st.builds(WindowHold, nn, nn, blocks),
    st.builds(WindowRelease, nn),
    st.builds(RequestAdded, nn, st.text(max_size=12)),
    st.builds(RequestFinished, nn),
    st.builds(RequestPreempted, nn),
    st.just(PrefixCacheReset()),
    st.builds(MemoryLimit, nn),
    st.builds(PageMapped, nn),
    st.builds(PageUnmapped, nn),
    st.builds(Gap, pos),
)
batch_lists = st.lists(st.lists(events, min_size=1, max_size=6), min_size=1, max_size=4)


def outcome(data: bytes) -> tuple[list[Event], JournalReader] | JournalError:
    try:
        return read_bytes(data)
    except JournalError as err:
        assert "\n" not in str(err) and str(err).startswith("mem: at byte ")
        return err


@settings(max_examples=25, deadline=None, database=None)
@given(batch_lists)
def test_truncation_at_every_offset_is_an_error_or_a_prefix(batches: list[list[Event]]) -> None:
    data = journal_bytes(batches)
    originals = [e for batch in batches for e in batch]
    boundaries = [*frame_offsets(data), len(data)]
    for cut in range(len(data) + 1):
        result = outcome(data[:cut])
        if cut < HEADER_END:
            assert isinstance(result, (EmptyJournalError, TruncatedJournalError)), cut
            continue
        assert not isinstance(result, JournalError), (cut, result)
        got, reader = result
        assert got == originals[: len(got)]
        whole = sum(1 for b in boundaries if b <= cut) - 1
        assert got == [e for batch in batches[:whole] for e in batch]
        assert (reader.torn_tail is None) == (cut in boundaries)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), batch_lists)
def test_bit_flips_never_yield_a_wrong_event(data: st.DataObject, batches: list[list[Event]]) -> None:
    good = journal_bytes(batches)
    originals = [e for batch in batches for e in batch]
    flips = data.draw(st.lists(st.integers(0, len(good) * 8 - 1), min_size=1, max_size=3, unique=True))
    damaged = bytearray(good)
    for bit in flips:
        damaged[bit // 8] ^= 1 << (bit % 8)
    seen: list[Event] = []
    try:
        reader = JournalReader("mem", file=io.BytesIO(bytes(damaged)))
        for event in reader:
            seen.append(event)
    except JournalError as err:
        assert "\n" not in str(err)
        assert seen == originals[: len(seen)]
        return
    # Only the preamble's reserved word is unchecked: flips there change nothing.
    assert all(12 <= bit // 8 < 16 for bit in flips)
    assert seen == originals
    assert reader.torn_tail is None


# --- writer errors --------------------------------------------------------------------------


def test_enospc_is_reported_and_truncation_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "full.kvj"
    writer = JournalWriter.create(path, HEADER)
    writer.append(BATCHES[0])
    good_end = writer.bytes_written
    real_write = writer._file.write

    def disk_full(data: bytes) -> int:
        real_write(bytes(data)[:7])  # the kernel took a few bytes before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer._file, "write", disk_full)
    with pytest.raises(JournalWriteError) as info:
        writer.append(BATCHES[1])
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert "No space left on device" in message and f"byte {good_end}" in message
    assert path.stat().st_size == good_end + 7  # the partial frame is there, and reported

    monkeypatch.setattr(writer._file, "write", real_write)
    with pytest.raises(JournalWriteError, match="truncate_to_last_frame"):
        writer.append(BATCHES[1])  # refuses to write behind a partial frame
    assert writer.truncate_to_last_frame() == good_end
    assert path.stat().st_size == good_end
    writer.append(BATCHES[2])
    writer.close()
    contents = read_journal(path)
    assert contents.events == BATCHES[0] + BATCHES[2]
    assert contents.torn_tail is None


def test_short_writes_are_finished() -> None:
    class Trickle(io.BytesIO):
        def write(self, data: object) -> int:
            return super().write(bytes(data)[:5])  # type: ignore[call-overload]

    out = Trickle()
    writer = JournalWriter(out, "mem", HEADER)
    for batch in BATCHES:
        writer.append(batch)
    assert out.getvalue() == GOOD


def test_writer_errors_are_journal_write_errors(tmp_path: Path) -> None:
    with pytest.raises(JournalWriteError, match="cannot create"):
        JournalWriter.create(tmp_path / "missing-dir" / "j.kvj", HEADER)
    writer = JournalWriter.create(tmp_path / "j.kvj", HEADER)
    writer.close()
    writer.close()
    with pytest.raises(JournalWriteError, match="closed"):
        writer.append(BATCHES[0])


def test_missing_file_is_a_journal_error(tmp_path: Path) -> None:
    with pytest.raises(JournalError, match="cannot open"):
        JournalReader(tmp_path / "nope.kvj")


def test_the_reader_opens_regular_files_only_and_never_blocks(tmp_path: Path) -> None:
    # In a child process: before the fix, open() of a FIFO without a writer never returned.
    fifo = tmp_path / "fifo.kvj"
    os.mkfifo(fifo)
    code = (
        "import sys\n"
        "from kvcached.errors import JournalError\n"
        "from kvcached.ledger.journal import JournalReader\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        JournalReader(path)\n"
        "    except JournalError as exc:\n"
        "        print(exc)\n"
    )
    import subprocess

    paths = [str(fifo), "/dev/zero", str(tmp_path)]
    proc = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == [
        f"{fifo}: at byte 0: cannot open: a FIFO, not a regular file",
        "/dev/zero: at byte 0: cannot open: a character device, not a regular file",
        f"{tmp_path}: at byte 0: cannot open: a directory, not a regular file",
    ], proc.stderr


def test_the_writer_never_writes_through_a_symlink_or_into_a_fifo_or_device(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "link.kvj"
    os.symlink(victim, link)
    dangling = tmp_path / "dangling.kvj"
    os.symlink(tmp_path / "nowhere", dangling)
    fifo = tmp_path / "fifo.kvj"
    os.mkfifo(fifo)  # no reader: an open for writing without O_NONBLOCK would block
    for path, what in (
        (link, "a symbolic link"),
        (dangling, "a symbolic link"),
        (fifo, "a FIFO"),
        (Path("/dev/null"), "a character device"),
        (tmp_path, "a directory"),
    ):
        with pytest.raises(JournalWriteError, match=f"^{path}: cannot create the journal: {what}, not a regular file"):
            JournalWriter.create(path, HEADER)
    assert victim.read_bytes() == b"precious" and not (tmp_path / "nowhere").exists()
    # A regular file at the name is replaced (truncated in place), as an output named by -o is.
    old = tmp_path / "old.kvj"
    old.write_bytes(b"x" * 100_000)
    with JournalWriter.create(old, HEADER) as w:
        w.append(BATCHES[0])
    assert read_journal(old).events == BATCHES[0]


# --- the header's bounds: what a GPU can hold --------------------------------------------------


def test_a_header_beyond_what_a_gpu_holds_is_refused_constructed_or_decoded() -> None:
    from kvcached.errors import ConfigError
    from kvcached.ledger.events import MAX_BLOCKS, MAX_POOLS

    ok = Header(page_bytes=2 << 20, pools=(PoolGeometry(8192, MAX_BLOCKS),))  # the largest: one H200 of 8 KiB blocks
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ok), type=Header) == ok
    for pools, match in (
        ((PoolGeometry(8192, MAX_BLOCKS + 1),), "16,777,217 KV blocks: more than a GPU holds"),
        ((PoolGeometry(8192, MAX_BLOCKS // 2 + 1),) * 2, "over 2 pools"),
        ((PoolGeometry(8192, 0),) * (MAX_POOLS + 1), "257 block pools"),
    ):
        # Constructed, as the served path does (KVCacheManager, the bridge): a ConfigError, which
        # the plugin turns into its one refusal line.
        with pytest.raises(ConfigError, match=match):
            Header(page_bytes=2 << 20, pools=pools)
        doc = {"page_bytes": 2 << 20, "pools": [msgspec.to_builtins(p) for p in pools]}
        # Decoded from a journal: the reader names the file and the header's offset.
        data = preamble() + frame(msgspec.msgpack.encode(doc))
        with pytest.raises(MalformedEventError, match="header: ") as info:
            read_bytes(data)
        check_message(info.value, "mem", 16)
    with pytest.raises(MalformedEventError, match=r"length <= 256"):
        read_bytes(preamble() + frame(msgspec.msgpack.encode({"page_bytes": 4096, "pools": [[1, 0]] * 10**6})))


def test_event_integers_are_int64() -> None:
    # The ledger keeps builds and indices in int64 arrays: the format bounds every integer there.
    for payload, after in (([[0, 2**63]], 0), ([[11, 2**64 - 1]], 0), ([[0, 1], [4, 2**63, 1]], 1)):
        with pytest.raises(MalformedEventError, match="<= 9223372036854775807") as info:
            read_bytes(GOOD + frame(msgspec.msgpack.encode(payload)))
        assert info.value.event_index == len(ALL_EVENTS) + after
    events, _ = read_bytes(GOOD + frame(msgspec.msgpack.encode([[0, 2**63 - 1]])))
    assert events[-1] == BuildBoundary(build=2**63 - 1)


def test_worked_example_in_the_docs_is_what_the_writer_writes() -> None:
    doc = (Path(__file__).parent.parent / "docs" / "trace-format.md").read_text()
    dump = doc.split("(`xxd -g1`):\n\n```\n", 1)[1].split("```", 1)[0]
    documented = bytes.fromhex("".join(line[10:58] for line in dump.splitlines()))
    geometry = (PoolGeometry(block_bytes=65536, num_blocks=1024),)
    header = Header(page_bytes=2097152, pools=geometry, clock_base_unix=1796256000.0)
    batches: list[list[Event]] = [
        [RequestAdded(0, "req-a"), BlockAlloc(0, (1000, 1001)), BuildBoundary(0, at_us=250000)],
        [JobBuilt(0, JobKind.STORE, 0, ((1000, 1001),), 1), JobReported(0, 1), BlockFree(0, (1000, 1001))],
    ]
    assert journal_bytes(batches, header) == documented


# --- rotated journals and snapshots (kvcached.ledger.segments) --------------------------------


def _events(n: int) -> list[Event]:
    return [BuildBoundary(build=i) for i in range(n)]


def write_segments(base: Path, sizes: list[int], header: Header = HEADER, first: int = 0) -> list[Event]:
    """Segments of ``sizes`` events, named and headed as the journal service does."""
    events = _events(first + sum(sizes))
    at = first
    for k, n in enumerate(sizes):
        with JournalWriter.create(segment_path(str(base), k), segment_header(header, k, at)) as w:
            for i in range(at, at + n, 7):
                w.append(events[i : min(i + 7, at + n)])
        at += n
    return events[first:]


def test_a_rotated_journal_is_read_in_order_from_any_of_its_segments(tmp_path: Path) -> None:
    base = tmp_path / "j.kvj"
    events = write_segments(base, [30, 0, 25, 40])
    (tmp_path / "j.kvj.keep").write_bytes(b"not a segment")  # names that are no segment's are left alone
    (tmp_path / "j.kvj.01").write_bytes(b"not a segment either")
    for k, named in ((0, base), (2, tmp_path / "j.kvj.2"), (3, tmp_path / "j.kvj.3")):
        journal = RotatedJournal(named)
        assert journal.base == str(base) and journal.given == k
        assert journal.paths == [segment_path(str(base), k) for k in range(4)]
        assert list(journal.events()) == events and journal.torn_tail is None
        assert [(s.number, n) for s, n in journal.read] == [(0, 30), (1, 0), (2, 25), (3, 40)]
    journal = RotatedJournal(base)
    assert list(journal.events(50)) == events[50:]
    assert [s.number for s, _ in journal.read] == [2, 3]  # segments before event 50: not even opened
    assert journal.events_read == 95
    with pytest.raises(JournalError, match="ends at event 95; reading was to start at event 96"):
        list(RotatedJournal(base).events(96))


def test_a_plain_journal_reads_nothing_beside_it(tmp_path: Path) -> None:
    path = tmp_path / "t.kvj"
    path.write_bytes(GOOD)
    (tmp_path / "t.kvj.1").write_bytes(b"garbage")
    journal = RotatedJournal(path)
    assert journal.given is None and journal.paths == [str(path)]
    assert list(journal.events()) == ALL_EVENTS


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("missing", "segment 1 of the rotated journal .* is missing"),
        ("renumbered", "its header says segment number 5, not 1"),
        ("other run", "geometry or policy differ"),
        ("gap", "segment 2 starts at event 21, but the one before ends at event 20"),
        ("torn middle", "segment 2 follows .*j.kvj.1, which ends in a torn frame"),
        ("bad meta", "header meta first_event='x' is not a number"),
    ],
)
def test_a_damaged_rotated_journal_names_the_segment(tmp_path: Path, damage: str, message: str) -> None:
    base = tmp_path / "j.kvj"
    write_segments(base, [10, 10, 10])
    one = segment_path(str(base), 1)
    if damage == "missing":
        os.unlink(one)
    elif damage in ("renumbered", "other run", "bad meta"):
        h = segment_header(HEADER, 1, 10)
        if damage == "renumbered":
            h = msgspec.structs.replace(h, meta={**h.meta, "segment": "5"})
        elif damage == "other run":
            h = msgspec.structs.replace(h, workers=7)
        else:
            h = msgspec.structs.replace(h, meta={**h.meta, "first_event": "x"})
        with JournalWriter.create(one, h) as w:
            w.append(_events(10))
    elif damage == "gap":
        with JournalWriter.create(segment_path(str(base), 2), segment_header(HEADER, 2, 21)) as w:
            w.append(_events(10))
    else:
        data = Path(one).read_bytes()
        Path(one).write_bytes(data[:-3])
    with pytest.raises(JournalError, match=message):
        list(RotatedJournal(segment_path(str(base), 2)).events())


def test_a_journal_that_starts_mid_run_is_read_only_from_its_first_event(tmp_path: Path) -> None:
    base = tmp_path / "late.kvj"
    events = write_segments(base, [10, 10], first=500)
    journal = RotatedJournal(base)
    assert journal.first_event == 500 and list(journal.events()) == events
    with pytest.raises(JournalError, match="starts at event 500"):
        list(RotatedJournal(base).events(0))
    copy = tmp_path / "copy.kvj"  # a segment copied away from its siblings is read alone
    copy.write_bytes(Path(f"{base}.1").read_bytes())
    alone = RotatedJournal(copy)
    assert alone.standalone and alone.given == 1 and list(alone.events()) == events[10:]


def _snapshot(n: int = 3) -> LedgerSnapshot:
    lg = Ledger(HEADER)
    lg.apply_all(_events(n))
    return lg.snapshot()


def test_one_snapshot_writer_and_reader(tmp_path: Path) -> None:
    path = str(tmp_path / "j.snap")
    first = write_snapshot(path, _snapshot(2), sync=True)
    assert read_snapshot(path) == _snapshot(2)
    assert Path(path).read_bytes() == msgspec.msgpack.encode(_snapshot(2))
    second = write_snapshot(path, _snapshot(3), replacing=first)  # replaces its own file
    assert read_snapshot(path).index == 3 and second != first
    with pytest.raises(FileExistsError):
        write_snapshot(path, _snapshot(4))  # replacing=None: never over an existing file
    with pytest.raises(FileExistsError, match="no longer the file"):
        write_snapshot(path, _snapshot(4), replacing=first)  # not the file it made last
    assert read_snapshot(path).index == 3
    assert os.listdir(tmp_path) == ["j.snap"]  # no temporary file left behind, even on failure


def test_the_snapshot_writer_never_writes_through_a_planted_name(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = str(tmp_path / "j.snap")
    os.symlink(victim, path)
    with pytest.raises(FileExistsError):
        write_snapshot(path, _snapshot())
    # The old writer's fixed temporary name, planted: never opened.
    os.symlink(victim, f"{path}.tmp")
    os.unlink(path)
    write_snapshot(path, _snapshot())
    assert victim.read_bytes() == b"precious" and read_snapshot(path).index == 3


def test_the_snapshot_reader_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.snap"
    os.mkfifo(fifo)  # no writer: an open() without O_NONBLOCK would wait forever
    with pytest.raises(JournalError, match="a FIFO, not a regular file"):
        read_snapshot(fifo)
    with pytest.raises(JournalError, match="a character device, not a regular file"):
        read_snapshot("/dev/zero")  # would read without end
    (tmp_path / "junk.snap").write_bytes(b"\x92\x01\x02")
    with pytest.raises(JournalError, match="not a ledger snapshot"):
        read_snapshot(tmp_path / "junk.snap")
    with pytest.raises(JournalError, match="cannot read the snapshot: No such file"):
        read_snapshot(tmp_path / "none.snap")


def test_segments_and_files_are_part_of_the_pure_core() -> None:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
    assert spec is not None and spec.loader is not None
    graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(graph)
    edges = graph.graph(typing=True)
    reached = graph.reachable(edges, ("kvcached.ledger.segments", "kvcached.ledger.files"))
    ours = {m for m in reached if m in edges}
    face = ("kvcached", "kvcached.errors", "kvcached.version")  # the package's own __init__ and what it imports
    assert all(m in face or m.startswith("kvcached.ledger") for m in ours), ours
    assert {m for m in reached if m not in edges} - set(sys.stdlib_module_names) == {"msgspec"}
