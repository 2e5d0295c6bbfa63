"""kvreplay on bad input: every damaged or foreign file gives one line and exit 1, never a traceback.

The promise tested here, for ``check`` (and spot-checked for the other replaying subcommands):
the exit code is 0 or 1 (2 is a usage error, which no file makes); a run that could not be done
prints nothing on stdout, and exactly one line on stderr that names the file and where
(byte offset or event index); a file cut inside its last frame gives one "torn tail" warning
line and then the result for the events before it. The exhaustive part cuts a small
multi-frame trace at every byte offset and flips a few hundred random bits (seeded), calling
``main`` in process so that it stays fast.
"""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import msgspec
import pytest

from kvcached.ledger.events import Header, JobReported, PageUnmapped, Policy, PoolGeometry
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


def every_reader(trace: Path | str, out: Path) -> list[list[str]]:
    """The command line of every subcommand that reads a trace, on ``trace`` (outputs in ``out``)."""
    t = str(trace)
    return [
        ["check", t],
        ["stats", t],
        ["show", t, "--page", "0"],
        ["plot", t, "-o", str(out / "p.png")],
        ["compare", t],
        ["minimize", t, "-o", str(out / "m.kvj")],
        ["snapshot", t, "--at", "0", "-o", str(out / "s.snap")],
    ]


def assert_one_line_error(code: int, err: list[str], path: Path, *words: str) -> None:
    assert code == 1, err
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


def raw_header(page_bytes: int, pools: list[tuple[int, int]]) -> bytes:
    """A header frame from plain values: a ``Header`` that breaks its bounds cannot be made."""
    doc = {"page_bytes": page_bytes, "pools": [{"block_bytes": b, "num_blocks": n} for b, n in pools]}
    return frame(msgspec.msgpack.encode(doc))


@pytest.mark.parametrize(
    ("pools", "words"),
    [
        # A 171-byte file: 2**26 blocks, which once took 7.5 GB and 20 s to be refused.
        ([(1024, 1 << 26)], ("67,108,864 KV blocks", "more than a GPU holds")),
        ([(1024, (1 << 24) + 1)], ("16,777,217 KV blocks",)),
        ([(1024, 1 << 40)], ("KV blocks",)),
        ([(1024, 1 << 23)] * 3, ("25,165,824 KV blocks over 3 pools",)),
        ([(1024, 0)] * 300, ("length <= 256", "pools")),
    ],
)
def test_a_header_beyond_what_a_gpu_holds_is_refused_before_anything_is_allocated(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pools: list[tuple[int, int]], words: tuple[str, ...]
) -> None:
    path = tmp_path / "huge.kvj"
    path.write_bytes(preamble() + raw_header(1 << 21, pools) + frame(msgspec.msgpack.encode([[0, 0]])))
    for argv in every_reader(path, tmp_path):
        code = main(argv)
        out, err = capsys.readouterr()
        assert_one_line_error(code, err.splitlines(), path, "at byte 16", "header", *words)
        assert out == ""


def test_a_block_larger_than_its_page_names_the_file_not_a_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "misfit.kvj"
    path.write_bytes(preamble() + raw_header(16384, [(32768, 4)]))
    code, _, err = check(capsys, path)
    assert_one_line_error(code, err, path, "at byte 16", "32,768 bytes do not fit its 16,384-byte pages")
    assert "KVCACHED_" not in err[0] and "raise" not in err[0]


def test_unwritable_output(tmp_path: Path, small_trace: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.kvj"
    path.write_bytes(small_trace)
    for argv in (
        ["minimize", str(path), "-o", str(tmp_path / "no" / "m.kvj")],
        ["snapshot", str(path), "--at", "3", "-o", str(tmp_path / "no" / "s.snap")],
    ):
        code = main(argv)
        err = capsys.readouterr().err.splitlines()
        assert code == 1 and len(err) == 1 and "no" in err[0], err


# --- every truncation, random bit flips -----------------------------------------------------


def _assert_contract(code: int, out: str, err: list[str], path: Path) -> str:
    """Checks the bad-input contract for one run; returns which case it was."""
    assert code in (0, 1)
    assert not any("Traceback" in line or "internal error" in line for line in err), err
    if code == 1 and not out:
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
            # Only a file without a complete header is unusable; after it, a cut is a torn tail,
            # except for check when no event at all is left: nothing was checked.
            assert any(w in err[0] for w in ("empty", "header", "preamble", "nothing was checked")), err
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
    assert code == 1 and len(err) == 1 and f"{link}: a symbolic link, not a regular file" in err[0], err
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
        assert code == 1 and out == "" and len(err) == 1, err
        assert err[0] == f"kvreplay: {snap}: at byte 0: cannot read the snapshot: {what}, not a regular file"


# --- what is not a regular file, integers past int64, nesting, bad snapshots -


_RUN_EACH = """
import contextlib, io, json, sys
from kvreplay.cli import main
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    print(json.dumps([code, out.getvalue(), err.getvalue()]), flush=True)
"""


def run_each_in_a_child(argvs: list[list[str]], timeout: float = 60) -> list[tuple[int, str, list[str]]]:
    """``main(argv)`` for each, in one child process: an open that blocks fails the test (timeout)
    instead of hanging it."""
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_EACH, json.dumps(argvs)], capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr
    return [(code, out, err.splitlines()) for code, out, err in map(json.loads, proc.stdout.splitlines())]


def test_a_trace_that_is_not_a_regular_file_is_one_line_and_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.kvj"
    os.mkfifo(fifo)  # no writer: open() for reading would block forever
    cases = [(fifo, "a FIFO"), (Path("/dev/zero"), "a character device"), (tmp_path, "a directory")]
    argvs = [argv for trace, _ in cases for argv in every_reader(trace, tmp_path)]
    results = run_each_in_a_child(argvs)
    assert len(results) == len(argvs)
    per = len(every_reader(fifo, tmp_path))
    for i, (code, out, err) in enumerate(results):
        trace, what = cases[i // per]
        assert_one_line_error(code, err, trace, "at byte 0", f"cannot open: {what}, not a regular file")
        assert out == ""
    # A FIFO given as a snapshot is refused as well (tested below with the other snapshots), and
    # a FIFO as the output of minimize or synth (JournalWriter.create) in the next test.


def test_outputs_are_never_written_through_a_symlink_or_into_a_fifo(
    tmp_path: Path, small_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.kvj"
    path.write_bytes(small_trace)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    link = tmp_path / "link.kvj"
    os.symlink(victim, link)
    fifo = tmp_path / "fifo.kvj"
    os.mkfifo(fifo)
    for out, what in ((link, "a symbolic link"), (fifo, "a FIFO")):
        for argv in (
            ["minimize", str(path), "-o", str(out)],
            ["synth", "-o", str(out), "--events", "100"],
        ):
            code = main(argv)
            e = capsys.readouterr().err
            assert_one_line_error(code, e.splitlines(), out, f"cannot create the journal: {what}, not a regular file")
    assert victim.read_bytes() == b"precious" and os.path.islink(link)
    # demo --save into a folder where another user planted a link at one of its names.
    save = tmp_path / "demo"
    save.mkdir()
    planted = save / "finish-in-write-step.legacy.kvj"
    os.symlink(victim, planted)
    code = main(["demo", "--save", str(save), "finish-in-write-step"])
    e = capsys.readouterr().err.splitlines()
    assert_one_line_error(code, e, planted, "a symbolic link")
    assert victim.read_bytes() == b"precious"
    # A regular file named by -o is replaced, as -o does everywhere.
    old = tmp_path / "old.kvj"
    old.write_bytes(b"x" * 100_000)
    assert main(["synth", "-o", str(old), "--events", "100"]) == 0
    capsys.readouterr()
    assert main(["check", str(old)]) in (0, 1) and old.stat().st_size < 100_000


def test_a_build_number_past_int64_is_a_malformed_event(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The format allowed any msgpack integer below 2**64; the ledger's int64 arrays raised an
    # internal OverflowError on a build number >= 2**63. Now the reader refuses it, naming the event.
    path = tmp_path / "build.kvj"
    for value in (2**63, 2**64 - 1):
        events = [[0, 0], [1, 0, [1]], [0, value]]
        path.write_bytes(preamble() + header_frame() + frame(msgspec.msgpack.encode(events)))
        for argv in every_reader(path, tmp_path)[:3]:
            code = main(argv)
            err = capsys.readouterr().err
            assert_one_line_error(code, err.splitlines(), path, "event 2", "<= 9223372036854775807")
    path.write_bytes(preamble() + header_frame() + frame(msgspec.msgpack.encode([[0, 2**63 - 1], [0, 2**63 - 1]])))
    code, out, err = check(capsys, path)  # the largest build number replays: I3 build-out-of-order
    assert code == 1 and err == [] and "I3 build-out-of-order x2" in out


def with_deep_field(doc: dict[str, object]) -> bytes:
    """``doc`` as a msgpack map with one more key, ``x``, whose value is [[[[...0...]]]] 200,000
    deep: msgspec skips an unknown field by descending into it (RecursionError)."""
    data = msgspec.msgpack.encode({**doc, "x": 0})
    assert data.endswith(b"\xa1x\x00")
    return data[:-1] + b"\x91" * 200_000 + b"\x00"


@pytest.mark.parametrize("where", ["event frame", "event", "header"])
def test_a_payload_nested_200000_deep_is_malformed_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    deep = b"\x91" * 200_000 + b"\x00"  # [[[[...0...]]]]: 200,001 bytes
    path = tmp_path / "deep.kvj"
    if where == "header":
        path.write_bytes(preamble() + frame(with_deep_field(msgspec.to_builtins(HEADER))))
    else:
        payload = b"\x91" + deep if where == "event frame" else b"\x92" + msgspec.msgpack.encode([0, 0]) + deep
        path.write_bytes(preamble() + header_frame() + frame(payload))
    code, _, err = check(capsys, path)
    assert_one_line_error(code, err, path, "event ")
    assert "RecursionError" not in err[0]


@pytest.fixture
def snapshot_case(tmp_path: Path, small_trace: bytes, capsys: pytest.CaptureFixture[str]) -> tuple[Path, bytes]:
    """The small trace and the raw snapshot after its event 7: job 0 was unmapped under (I1,
    event 6) and is reported at event 9, so the replay after it looks up the violation again."""
    path = tmp_path / "t.kvj"
    path.write_bytes(small_trace)
    snap = tmp_path / "s.snap"
    assert main(["snapshot", str(path), "--at", "7", "-o", str(snap)]) == 0
    capsys.readouterr()
    return path, snap.read_bytes()


def _damaged(raw: bytes, **fields: object) -> bytes:
    doc = msgspec.msgpack.decode(raw)
    doc.update(fields)
    return msgspec.msgpack.encode(doc)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"job_violation": {0: [5]}}, "violation index outside its 1 violations"),  # was IndexError mid-replay
        ({"job_violation": {0: [-1]}}, "violation index outside"),  # was the wrong violation, silently
        ({"boundary_ix": [2, 2**63], "boundary_build": [0, 1]}, "build boundaries"),  # was OverflowError
        ({"boundary_ix": [4, 6]}, "build boundaries"),  # longer than boundary_build: IndexError in build_of
        ({"index": 2**63}, "event index"),
        ({"grace": {-1: 3}}, "a grace on a page outside"),  # was a wrong page, silently
        ({"holds": {16: {0: 1}}}, "a window hold on a page outside"),  # was IndexError in restore
        ({"mapped": b"\x02"}, "page tables"),
        # was "internal error ... min() arg is an empty sequence" at the liveness check (I4)
        ({"finished": {77: 0}, "finish_due": {0: [77], 1: [77], 2: [77]}}, "finished request 77 with no job"),
    ],
)
def test_a_snapshot_that_points_nowhere_is_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    snapshot_case: tuple[Path, bytes],
    fields: dict[str, object],
    words: str,
) -> None:
    path, raw = snapshot_case
    assert check(capsys, path, "--from-snapshot", str(tmp_path / "s.snap"))[0] == 1  # the intact one replays
    bad = tmp_path / "bad.snap"
    bad.write_bytes(_damaged(raw, **fields))
    for argv in every_reader(path, tmp_path)[:4]:
        code = main([*argv, "--from-snapshot", str(bad)])
        out, err = capsys.readouterr()
        assert_one_line_error(code, err.splitlines(), bad, "at byte 0", "not a consistent ledger snapshot", words)
        assert out == ""


def test_a_snapshot_nested_deep_or_of_an_absurd_geometry_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], snapshot_case: tuple[Path, bytes]
) -> None:
    path, raw = snapshot_case
    bad = tmp_path / "bad.snap"
    doc = msgspec.msgpack.decode(raw)
    for data, words in (
        (with_deep_field(doc), "nested too deep"),
        (
            _damaged(raw, header={**doc["header"], "pools": [{"block_bytes": 1024, "num_blocks": 1 << 26}]}),
            "67,108,864 KV blocks",
        ),
    ):
        bad.write_bytes(data)
        code, _, err = check(capsys, path, "--from-snapshot", str(bad))
        assert_one_line_error(code, err, bad, "not a ledger snapshot", words)


# --- a trace that holds nothing, or ends with work under way ------------------


def test_a_trace_with_no_event_checks_nothing_and_says_so(
    tmp_path: Path, small_trace: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "header-only.kvj"
    path.write_bytes(preamble() + header_frame())
    code, out, err = check(capsys, path)
    assert_one_line_error(code, err, path, "no event to check", "nothing was checked")
    assert out == ""
    code, out, err = check(capsys, path, "--json")
    assert code == 1 and out == "" and len(err) == 1
    # Its first frame torn: one line still (not a torn-tail warning and then a verdict).
    cut = 16 + 12 + struct.unpack_from("<I", small_trace, 16)[0] + 5  # the preamble, the header frame
    path.write_bytes(small_trace[:cut])
    code, out, err = check(capsys, path)
    assert_one_line_error(code, err, path, "no event to check", "first frame is cut off", "nothing was checked")


def test_a_trace_that_ends_with_jobs_outstanding_or_a_shrink_unfinished_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What a crashed run leaves: a store job built and never reported, a limit not yet reached.
    from kvcached.ledger.events import (
        BlockAlloc,
        BuildBoundary,
        JobBuilt,
        JobKind,
        MemoryLimit,
        PageMapped,
        RequestAdded,
    )

    header = Header(page_bytes=4096, pools=(PoolGeometry(1024, 16),))
    events = [
        PageMapped(0),
        PageMapped(1),
        RequestAdded(0, "req-a"),
        BlockAlloc(0, (0, 1)),
        JobBuilt(3, JobKind.STORE, 0, ((0, 1),), 2),
        BuildBoundary(0),
        MemoryLimit(1),
    ]
    path = tmp_path / "crashed.kvj"
    with JournalWriter.create(path, header) as w:
        w.append(events)
    code, out, err = check(capsys, path)
    assert code == 0 and err == []
    lines = out.splitlines()
    assert lines[1].startswith("clean: no invariant violated, but the trace ends unfinished (not a violation: ")
    assert lines[2] == (
        "  1 job outstanding; the oldest: store job 3 of request req-a, built in build 0, waiting on 2 workers"
    )
    assert lines[3] == "  a shrink unfinished: 2 pages mapped over a limit of 1"
    code, out, _ = check(capsys, path, "--json")
    doc = json.loads(out)
    assert doc["clean"] is True and doc["unfinished"] == {
        "outstanding_jobs": 1,
        "oldest_job": {"job": 3, "kind": "store", "request": "req-a", "build": 0, "waiting_workers": 2},
        "shrink": {"limit": 1, "mapped_pages": 2},
    }
    # Once the job is reported and the limit met, the end is finished: the plain verdict again.
    with JournalWriter.create(path, header) as w:
        w.append([*events, JobReported(3, 2), PageUnmapped(1)])
    code, out, _ = check(capsys, path)
    assert code == 0 and "clean: no invariant violated\n" in out and "unfinished" not in out
    code, out, _ = check(capsys, path, "--json")
    assert "unfinished" not in json.loads(out)


def test_an_unfinished_end_is_said_after_the_violations_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # finish-in-write-step under legacy, cut after its I1 (event 6) and before job 0 is reported.
    sc = SCENARIOS["finish-in-write-step"]()
    h = msgspec.structs.replace(sc.header, policy=Policy.LEGACY)
    path = tmp_path / "cut.kvj"
    with JournalWriter.create(path, h) as w:
        w.append(list(derive(Ledger(h), sc.events))[:8])
    code, out, err = check(capsys, path)
    assert code == 1 and err == []
    lines = out.splitlines()
    at = lines.index("1 violation: I1 unmap-under-job x1")
    assert lines[at + 1].startswith("the trace ends unfinished (not a violation: ")
    assert lines[at + 2].startswith("  1 job outstanding; the oldest: store job 0 of request ")
    assert json.loads(check(capsys, path, "--json")[1])["unfinished"]["outstanding_jobs"] == 1
