"""kvreplay on bad input: every damaged or foreign file gives one line and exit 2, never a traceback.

The promise tested here, for ``check`` (and spot-checked for the other replaying subcommands):
the exit code is 0, 1 or 2; on 2, stderr is exactly one line that names the file and where
(byte offset or event index); a file cut inside its last frame gives one "torn tail" warning
line and then the result for the events before it. The exhaustive part cuts a small
multi-frame trace at every byte offset and flips a few hundred random bits (seeded), calling
``main`` in process so that it stays fast.
"""

from __future__ import annotations

import os
import random
import struct
import zlib
from pathlib import Path

import msgspec
import pytest

from kvcached.ledger.events import Header, Policy, PoolGeometry
from kvcached.ledger.journal import JournalWriter
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.segments import read_snapshot
from kvcached.ledger.simulate import derive
from kvcached.testing.seed_cases import SCENARIOS
from kvreplay.cli import main

MAGIC = b"KVCLEDGR"


def frame(payload: bytes) -> bytes:
    head = struct.pack("<II", len(payload), zlib.crc32(payload))
    return head + struct.pack("<I", zlib.crc32(head)) + payload


def preamble(version: int = 1, flags: int = 0) -> bytes:
    return struct.pack("<8sHHI", MAGIC, version, flags, 0)


HEADER = Header(page_bytes=4096, pools=(PoolGeometry(1024, 16),), policy=Policy.LEGACY)


def header_frame(header: Header = HEADER) -> bytes:
    return frame(msgspec.msgpack.encode(header))


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """finish-in-write-step under legacy (a violation), in frames of three events."""
    sc = SCENARIOS["finish-in-write-step"]()
    h = msgspec.structs.replace(sc.header, policy=Policy.LEGACY)
    events = list(derive(Ledger(h), sc.events))
    path = tmp_path_factory.mktemp("small") / "t.kvj"
    with JournalWriter.create(path, h) as w:
        for i in range(0, len(events), 3):
            w.append(events[i : i + 3])
    return path.read_bytes()


def check(capsys: pytest.CaptureFixture[str], path: Path, *extra: str) -> tuple[int, str, list[str]]:
    code = main(["check", str(path), *extra])
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def assert_one_line_error(code: int, err: list[str], path: Path, *words: str) -> None:
    assert code == 2, err
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("kvreplay: ") and str(path) in line
    assert "Traceback" not in line and "internal error" not in line
    for w in words:
        assert w in line, line


# --- each kind of bad file ------------------------------------------------------------------


def test_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "nope.kvj"
    code, out, err = check(capsys, path)
    assert_one_line_error(code, err, path, "cannot open", "byte 0")
    assert out == ""


def test_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = check(capsys, tmp_path)
    assert_one_line_error(code, err, tmp_path)


@pytest.mark.parametrize(
    ("name", "data", "words"),
    [
        ("empty", b"", ("empty", "byte 0")),
        ("foreign", b"%PDF-1.7\n" + b"x" * 100, ("not a kvcached journal", "byte 0")),
        ("wrong magic", b"KVCLEDGX" + bytes(8), ("not a kvcached journal",)),
        ("short", b"KVC", ("byte 3",)),
        ("newer version", preamble(version=2) + header_frame(), ("newer", "version 2", "byte 8")),
        ("unknown flags", preamble(flags=4) + header_frame(), ("flags", "byte 10")),
        ("cut header", preamble() + header_frame()[:20], ("header frame",)),
        ("bad header", preamble() + frame(msgspec.msgpack.encode({"page_bytes": "x"})), ("header",)),
    ],
)
def test_unreadable_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, data: bytes, words: tuple[str, ...]
) -> None:
    path = tmp_path / f"{name.replace(' ', '-')}.kvj"
    path.write_bytes(data)
    code, out, err = check(capsys, path)
    assert_one_line_error(code, err, path, *words)
    assert out == ""


def test_torn_last_frame_is_a_warning_then_the_result(
    tmp_path: Path, small_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "torn.kvj"
    path.write_bytes(small_trace[:-2])
    code, out, err = check(capsys, path)
    assert code in (0, 1)
    assert len(err) == 1 and err[0].startswith(f"kvreplay: warning: {path}: torn tail at byte ")
    assert "summary:" in out
    code, out, err = check(capsys, path, "--json")
    assert '"torn_tail": {' in out and len(err) == 1


def test_corrupt_frame_in_the_middle(tmp_path: Path, small_trace: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    data = bytearray(small_trace)
    data[len(data) // 2] ^= 0x10
    path = tmp_path / "corrupt.kvj"
    path.write_bytes(bytes(data))
    code, out, err = check(capsys, path)
    assert_one_line_error(code, err, path, "checksum", "byte ")
    assert out == ""


def test_malformed_event_names_its_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = msgspec.msgpack.encode([[0, 0], [0, 1]])
    bad = msgspec.msgpack.encode([[0, 2], [99, 1], [0, 3]])  # tag 99 is no event
    path = tmp_path / "malformed.kvj"
    path.write_bytes(preamble() + header_frame() + frame(good) + frame(bad))
    code, _, err = check(capsys, path)
    assert_one_line_error(code, err, path, "event 3")


def test_absurd_geometry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    huge = Header(page_bytes=4096, pools=(PoolGeometry(1024, 1 << 40),))
    path = tmp_path / "huge.kvj"
    path.write_bytes(preamble() + header_frame(huge))
    code, _, err = check(capsys, path)
    assert_one_line_error(code, err, path, "blocks")
    misfit = Header(page_bytes=4096, pools=(PoolGeometry(8192, 4),))
    path.write_bytes(preamble() + header_frame(misfit))
    code, _, err = check(capsys, path)
    assert code == 2 and len(err) == 1 and "does not fit" in err[0]


def test_unwritable_output(tmp_path: Path, small_trace: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.kvj"
    path.write_bytes(small_trace)
    for argv in (
        ["minimize", str(path), "-o", str(tmp_path / "no" / "m.kvj")],
        ["snapshot", str(path), "--at", "3", "-o", str(tmp_path / "no" / "s.snap")],
    ):
        code = main(argv)
        err = capsys.readouterr().err.splitlines()
        assert code == 2 and len(err) == 1 and "no" in err[0], err


# --- every truncation, random bit flips -----------------------------------------------------


def _assert_contract(code: int, out: str, err: list[str], path: Path) -> str:
    """Checks the bad-input contract for one run; returns which case it was."""
    assert code in (0, 1, 2)
    assert not any("Traceback" in line or "internal error" in line for line in err), err
    if code == 2:
        assert_one_line_error(code, err, path)
        assert out == ""
        return "error"
    if err:
        assert len(err) == 1 and err[0].startswith(f"kvreplay: warning: {path}: torn tail at byte "), err
        assert out
        return "torn"
    assert out
    return "clean"


def test_truncated_at_every_byte(tmp_path: Path, small_trace: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cut.kvj"
    seen: dict[str, int] = {}
    for n in range(len(small_trace) + 1):
        path.write_bytes(small_trace[:n])
        code, out, err = check(capsys, path)
        case = _assert_contract(code, out, err, path)
        seen[case] = seen.get(case, 0) + 1
        if case == "error":
            # Only a file without a complete header is unusable; after it, a cut is a torn tail.
            assert any(w in err[0] for w in ("empty", "header", "preamble")), err
        # The other replaying subcommands keep the same promise (spot-checked, to stay fast).
        if n % 9 == 0:
            for argv in (["stats", str(path), "--json"], ["show", str(path), "--page", "0"]):
                code = main(argv)
                o, e = capsys.readouterr()
                _assert_contract(code, o, e.splitlines(), path)
    assert seen["error"] and seen["torn"] and seen["clean"]


def test_random_bit_flips(tmp_path: Path, small_trace: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    rng = random.Random(20261130)
    path = tmp_path / "flipped.kvj"
    cases: dict[str, int] = {}
    for _ in range(300):
        data = bytearray(small_trace)
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        code, out, err = check(capsys, path)
        case = _assert_contract(code, out, err, path)
        cases[case] = cases.get(case, 0) + 1
    # CRCs catch every flip but those in the 4 reserved preamble bytes, which readers ignore.
    assert cases["error"] > 250


# --- snapshots as input and output ----------------------------------------------------------


def test_snapshot_output_is_never_written_through_a_link(
    tmp_path: Path, small_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.kvj"
    path.write_bytes(small_trace)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "s.snap"
    os.symlink(victim, link)
    code = main(["snapshot", str(path), "--at", "3", "-o", str(link)])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and f"{link}: a symbolic link, not a regular file" in err[0], err
    assert victim.read_bytes() == b"precious"
    old = tmp_path / "old.snap"  # a regular file the user names with -o is replaced, as -o does
    old.write_bytes(b"old")
    assert main(["snapshot", str(path), "--at", "3", "-o", str(old)]) == 0
    assert read_snapshot(old).index == 3
    assert sorted(os.listdir(tmp_path)) == ["old.snap", "s.snap", "t.kvj", "victim"]


def test_a_snapshot_that_is_not_a_regular_file_is_one_line(
    tmp_path: Path, small_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.kvj"
    path.write_bytes(small_trace)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: opening it to read would block forever
    for snap, what in ((str(fifo), "a FIFO"), ("/dev/zero", "a character device")):
        code, out, err = check(capsys, path, "--from-snapshot", snap)
        assert code == 2 and out == "" and len(err) == 1, err
        assert err[0] == f"kvreplay: {snap}: at byte 0: cannot read the snapshot: {what}, not a regular file"
