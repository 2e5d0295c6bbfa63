"""Operating an engine without vLLM: the flight recorder, kvctl list / limit / dump, one-line errors.

The served end to end (a real ``vllm serve``) is tests/serve/test_operate_e2e.py; here the ledger
service runs as in an engine core, fed the golden traces' events, with a real KVCacheManager on
the host backend behind ``kvctl limit``.
"""

from __future__ import annotations

import io
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvcached.kv_cache_manager import KVCacheManager
from kvcached.ledger.events import BuildBoundary, Header, PoolGeometry
from kvcached.ledger.segments import RotatedJournal
from kvcached.service.flight import FlightRecorder
from kvcached.service.ledger_service import BackgroundService, ServiceConfig
from kvcached.settings import parse_size
from kvcached.vllm.api_server.startup import serve_port
from kvcached.vllm.engine_core.control import LiveControl
from kvcached.vllm.testing.live_engine import LiveEngine
from kvctl import cli as kvctl
from kvreplay.cli import main as kvreplay

ROOT = Path(__file__).resolve().parent.parent
LEGACY = sorted((ROOT / "traces").glob("*.legacy.kvj"))


def events_of(path: Path) -> tuple[Header, list]:  # type: ignore[type-arg]
    j = RotatedJournal(path)
    return j.header, list(j.events())


def replay(capsys: pytest.CaptureFixture[str], path: str) -> dict:  # type: ignore[type-arg]
    capsys.readouterr()
    code = kvreplay(["check", path, "--json"])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    return json.loads(out)  # type: ignore[no-any-return]


# --- the flight recorder ------------------------------------------------------------------------


@pytest.mark.parametrize("trace", LEGACY, ids=lambda p: p.name.split(".")[0])
def test_first_violation_saves_a_dump_that_replays_to_the_same_violation(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    header, events = events_of(trace)
    want = json.loads(trace.with_suffix(".check.json").read_text())["violations"]
    assert want, "a legacy golden trace shows a violation"
    cfg = ServiceConfig(flight_events=16, dump_dir=str(tmp_path / "dumps"), batch_events=4)
    with BackgroundService.start(header, cfg) as bg:
        for ev in events:
            bg.producer.put(ev)
    dumps = bg.service.dumps
    firsts = {v["invariant"] for v in want}
    assert len(dumps) == len(firsts)  # one per invariant violated, not one per violation
    assert any(f"kvreplay check {dumps[0]}" in r.getMessage() for r in caplog.records)
    got = replay(capsys, dumps[0])
    first = want[0]
    same = [
        v
        for v in got["violations"]
        if (v["invariant"], v["code"], v["index"]) == (first["invariant"], first["code"], first["index"])
    ]
    assert same and same[0]["page"] == first["page"], (got["violations"][:1], first)


def test_a_dump_from_mid_run_starts_from_its_snapshot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = ROOT / "traces" / "preempt-shrink.ledger.kvj"
    header, events = events_of(trace)
    whole = replay(capsys, str(trace))
    cfg = ServiceConfig(flight_events=40, batch_events=8)
    with BackgroundService.start(header, cfg) as bg:
        for ev in events:
            bg.producer.put(ev)
    flight = bg.service.flight
    assert flight is not None and 40 <= flight.events <= 80 + 8 and flight.first_event > 0
    d = bg.service.dump("test")
    assert d is not None and d.snapshot is not None
    out = tmp_path / "mid.kvj"
    from kvcached.service.flight import write_dump

    write_dump(d, str(out))
    got = replay(capsys, str(out))
    # The same end state as a replay of the whole trace, from only the last events and a snapshot.
    assert got["summary"]["mapped_pages"] == whole["summary"]["mapped_pages"]
    assert got["summary"]["events"] == whole["summary"]["events"] and got["clean"]


def test_the_ring_keeps_between_one_and_two_capacities() -> None:
    header, events = events_of(ROOT / "traces" / "preempt-shrink.ledger.kvj")
    from kvcached.ledger.ledger import Ledger

    lg = Ledger(header)
    ring = FlightRecorder(header, 10)
    for i, ev in enumerate(events):
        lg.apply(ev)
        ring.add(i, 1, msgspec.msgpack.encode([ev]), lg.snapshot)
        if i >= 10:
            assert 10 <= ring.events <= 20, (i, ring.events)


# --- kvctl against a service with an engine behind it ----------------------------------------------

PAGE = 64 << 10
CONTROLS: dict[str, LiveControl] = {}  # the engine fixture's, by socket: a test may give it a floor


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, KVCacheManager]]:
    """A ledger service on a socket in a private runtime directory, over a real manager."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVCACHED_LEDGER_SOCKET", raising=False)
    eng = LiveEngine(tmp_path / "kvcached", page=PAGE)
    CONTROLS[eng.socket] = eng.control
    try:
        yield eng.socket, eng.manager
    finally:
        eng.close()


def kv(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = kvctl.main(list(argv))
    except SystemExit as e:  # argparse's usage errors
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_list_status_and_limit_honour_blocks_in_use(
    engine: tuple[str, KVCacheManager], capsys: pytest.CaptureFixture[str]
) -> None:
    sock, manager = engine
    code, out, _ = kv(capsys, "list")
    assert code == 0 and "tiny-llama" in out and "8123" in out and sock in out
    held = manager.alloc(4 * 6)  # six pages in use
    code, out, _ = kv(capsys, "limit", "tiny-llama", "256K")  # four pages
    assert code == 0 and "shrinking" in out and "in use" in out
    code, out, _ = kv(capsys, "status", "--json")
    st = json.loads(out)
    assert st["memory"]["limit_bytes"] == 4 * PAGE and st["memory"]["shrink_pending"]
    assert st["memory"]["mapped_bytes"] == manager.state().mapped * PAGE
    manager.free(held)
    manager.drain_releasable()
    code, out, _ = kv(capsys, "status")
    assert "grace" in out  # under ledger, freed pages wait for the next build: status says so
    manager.recorder.emit(BuildBoundary(manager.recorder.ledger.build))  # the open build closes
    manager.drain_releasable()
    code, out, _ = kv(capsys, "-e", str(os.getpid()), "status", "--json")
    mem = json.loads(out)["memory"]
    assert not mem["shrink_pending"] and mem["mapped_pages"] <= 4, mem
    assert manager.recorder.ledger.violations == []
    code, out, _ = kv(capsys, "limit-percent", "100", "--json")
    assert code == 0 and json.loads(out)["limit_pages"] == manager.allocator.num_pages
    code, out, _ = kv(capsys, "limit", "none", "--json")
    assert code == 0 and json.loads(out)["limit_pages"] == manager.allocator.num_pages


def test_status_says_which_empty_pages_pins_keep_and_how_long_holds_lasted(
    engine: tuple[str, KVCacheManager], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcached.ledger.events import JobBuilt, JobKind, JobReported

    _, manager = engine
    blocks = manager.alloc(4)  # one page
    manager.recorder.emit(JobBuilt(1, JobKind.STORE, 0, (tuple(blocks),), 1))
    manager.free(blocks)
    manager.drain_releasable()
    code, out, err = kv(capsys, "status")
    assert code == 0, err
    assert "1 empty page kept by pins now; no hold ended yet" in out, out
    for step in range(2):
        manager.recorder.emit(BuildBoundary(step))  # the free's grace ends; the job's pin stays
    manager.recorder.emit(JobReported(1, 1))
    manager.drain_releasable()
    code, out, err = kv(capsys, "status")
    assert code == 0 and "0 empty pages kept by pins now; 1 hold ended" in out, out


def test_dump_over_the_socket_replays(
    engine: tuple[str, KVCacheManager], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, manager = engine
    blocks = manager.alloc(10)
    manager.free(blocks)
    manager.drain_releasable()
    out_file = tmp_path / "d.kvj"
    import time

    time.sleep(0.1)  # the service takes the events within its flush interval
    code, out, err = kv(capsys, "dump", "-o", str(out_file))
    assert code == 0, err
    assert f"kvreplay check {out_file}" in out
    got = replay(capsys, str(out_file))
    assert got["clean"] and got["summary"]["events"] == manager.recorder.ledger.index


def test_a_limit_below_the_floor_is_refused_unless_forced(
    engine: tuple[str, KVCacheManager], capsys: pytest.CaptureFixture[str]
) -> None:
    sock, manager = engine
    control = CONTROLS[sock]
    control.floor_pages, control.floor_why = 8, "one request of max_model_len 512 needs 32 blocks on 8 pages"
    before = manager.state().limit
    code, out, err = kv(capsys, "limit", "256K")  # four pages, under the floor of eight
    assert code == 1 and out == "" and err.count("\n") == 1, (code, out, err)
    assert "limit: 256 KiB is below this engine's floor of 512 KiB (one request of max_model_len 512" in err
    assert "--force" in err and manager.state().limit == before  # nothing changed
    code, out, _ = kv(capsys, "limit-percent", "5")  # 5% of 64 pages: under the floor too
    assert code == 1
    code, out, err = kv(capsys, "limit", "512K", "--json")  # at the floor: allowed
    assert code == 0 and json.loads(out)["limit_pages"] == 8 and json.loads(out)["floor_bytes"] == 8 * PAGE, err
    code, out, err = kv(capsys, "limit", "256K", "--force", "--json")
    assert code == 0 and json.loads(out)["limit_pages"] == 4, err
    _, out, _ = kv(capsys, "status")
    assert "floor" in out and "512 KiB: one request of max_model_len 512" in out


def test_kvctl_status_with_only_dead_sockets_says_no_engine_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVCACHED_LEDGER_SOCKET", raising=False)
    folder = tmp_path / "kvcached"
    folder.mkdir()
    for pid in (999997, 999998):
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(folder / f"ledger-{pid}.sock"))  # bound, never listening: what SIGKILL leaves
    code, out, err = kv(capsys, "status")
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert f"no kvcached engine is running (2 dead sockets in {folder}; kvctl list --prune removes them)" in err


def dead_socket(path: Path, age: float = 60.0) -> Path:
    """A socket bound and never listened on (what SIGKILL leaves), made ``age`` seconds old: a
    younger one may be an engine between its bind and its listen, which pruning leaves alone."""
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
    if age:
        then = time.time() - age
        os.utime(path, (then, then), follow_symlinks=False)
    return path


def test_list_prune_removes_only_dead_sockets(
    engine: tuple[str, KVCacheManager], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sock, _ = engine
    folder = tmp_path / "kvcached"
    dead = dead_socket(folder / "ledger-999999.sock")
    young = dead_socket(folder / "ledger-999998.sock", age=0)  # bound just now: maybe about to listen
    other = folder / "notes.sock"  # not a socket, whatever its name
    other.write_text("mine")
    link = folder / "ledger-link.sock"
    link.symlink_to(dead)
    then = time.time() - 60
    os.utime(sock, (then, then))  # the live engine's, old: it answers, so it stays
    code, out, _ = kv(capsys, "list", "--prune")
    assert code == 0 and out.startswith(f"removed 1 dead socket: {dead}\n") and sock in out
    assert not dead.exists() and os.path.exists(sock) and other.read_text() == "mine" and link.is_symlink()
    assert young.is_socket()
    code, out, _ = kv(capsys, "list", "--prune", "--json")
    assert code == 0 and [r["socket"] for r in json.loads(out)] == [sock]  # nothing left to prune


def test_the_service_prunes_dead_sockets_beside_its_own_on_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVCACHED_LEDGER_SOCKET", raising=False)
    folder = tmp_path / "kvcached"
    folder.mkdir(mode=0o700)
    header = Header(page_bytes=4096, pools=(PoolGeometry(64, 4),), workers=1)
    first = BackgroundService.start(header, ServiceConfig(socket=str(folder / "ledger-1.sock")))
    try:
        then = time.time() - 60
        os.utime(folder / "ledger-1.sock", (then, then))  # a live engine's, old
        dead = dead_socket(folder / "ledger-999999.sock")
        young = dead_socket(folder / "ledger-999998.sock", age=0)
        foreign = dead_socket(folder / "other.sock")  # dead, but not named as engines name theirs
        fake = folder / "ledger-999997.sock"
        fake.write_text("not a socket")
        link = folder / "ledger-999996.sock"
        link.symlink_to(foreign)
        second = BackgroundService.start(header, ServiceConfig(socket=str(folder / "ledger-2.sock")))
        second.close()
        assert not dead.exists()
        assert (folder / "ledger-1.sock").is_socket() and young.is_socket() and foreign.is_socket()
        assert fake.read_text() == "not a socket" and link.is_symlink()
    finally:
        first.close()


def test_one_live_engine_among_dead_sockets_is_the_one(
    engine: tuple[str, KVCacheManager], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for pid in (999997, 999998):
        dead_socket(tmp_path / "kvcached" / f"ledger-{pid}.sock")
    code, out, err = kv(capsys, "status")
    assert code == 0 and "tiny-llama" in out, err


def test_min_kv_cache_mb_raises_the_floor(
    engine: tuple[str, KVCacheManager], capsys: pytest.CaptureFixture[str]
) -> None:
    from types import SimpleNamespace as NS

    from kvcached.settings import Settings
    from kvcached.vllm.engine_core.control import request_floor

    sock, manager = engine
    settings = Settings.from_env({"KVCACHED_MIN_KV_CACHE_MB": "1"})
    assert settings.min_kv_cache_bytes == 1 << 20 and Settings.from_env({}).min_kv_cache_bytes == 0
    # vLLM's scheduler as request_floor reads it: one full-attention group of 16-token blocks.
    group = NS(kv_cache_spec=NS(block_size=16))
    scheduler = NS(vllm_config=NS(model_config=NS(max_model_len=512)), kv_cache_config=NS(kv_cache_groups=[group]))
    assert request_floor(scheduler, 4, PAGE) == (8, "one request of max_model_len 512 needs 32 blocks on 8 pages")
    assert request_floor(object(), 4, PAGE) == (0, "")  # nothing known of the model: no floor
    pages, why = request_floor(scheduler, 4, PAGE, settings.min_kv_cache_bytes)
    assert pages == (1 << 20) // PAGE and why.startswith("KVCACHED_MIN_KV_CACHE_MB is 1; one request")
    control = CONTROLS[sock]
    control.floor_pages, control.floor_why = pages, why
    before = manager.state().limit
    code, _, err = kv(capsys, "limit", "768K")  # above one request's 8 pages, below the setting's 16
    assert code == 1 and "768 KiB is below this engine's floor of 1 MiB (KVCACHED_MIN_KV_CACHE_MB is 1" in err
    assert manager.state().limit == before
    code, out, err = kv(capsys, "limit", "1M", "--json")
    assert code == 0 and json.loads(out)["limit_pages"] == 16, err


def test_budget_that_does_not_exist_is_not_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    code, out, err = kv(capsys, "budget", "gpu7")
    assert code == 1 and out == "" and "no budget named 'gpu7'" in err and err.count("\n") == 1
    assert list(tmp_path.rglob("budget-gpu7*")) == []  # asking made nothing
    code, out, _ = kv(capsys, "budget", "gpu7", "1G")
    assert code == 0 and "budget gpu7: 0 B used of 1 GiB" in out
    code, out, _ = kv(capsys, "budget", "gpu7")
    assert code == 0 and "of 1 GiB" in out
    code, _, err = kv(capsys, "budget", "gpu7", "lots")
    assert code == 2 and "budget" in err


def stop_watch_after_two(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """kvctl watch's sleep, made to end the watch (Ctrl-C) at its second call; reset ``["n"]``
    to watch again."""
    calls = {"n": 0}

    def stop_after_two(_: float) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("kvctl.engines.time.sleep", stop_after_two)
    return calls


def test_watch_on_a_pipe_prints_listings_and_json_lines(
    engine: tuple[str, KVCacheManager], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    sock, _ = engine
    calls = stop_watch_after_two(monkeypatch)
    code, out, _ = kv(capsys, "watch", "-n", "0.5", "--json")
    assert code == 130 and [len(json.loads(line)) for line in out.splitlines()] == [1, 1]
    calls["n"] = 0
    code, out, _ = kv(capsys, "watch", "-n", "0.5")
    assert code == 130 and out.count("tiny-llama") == 2 and out.count(sock) == 2


class Terminal(io.StringIO):
    """What kvctl writes to a terminal, kept: rich takes it for one (``isatty``)."""

    def isatty(self) -> bool:
        return True


def test_watch_on_a_terminal_redraws_in_place(
    engine: tuple[str, KVCacheManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("rich")
    sock, _ = engine
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setenv("TERM", "xterm-256color")
    stop_watch_after_two(monkeypatch)
    screen = Terminal()
    assert kvctl.main(["watch", "-n", "0.5"], out=screen) == 130
    text = screen.getvalue()
    # rich.live moves the cursor up over the last frame and clears its lines: in place, not appended.
    assert "\x1b[1A" in text and "\x1b[2K" in text and text.count("tiny-llama") >= 2 and sock in text


def test_a_wide_terminal_gets_its_whole_width(
    engine: tuple[str, KVCacheManager], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("rich")
    sock, _ = engine
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.setenv("TERM", "xterm-256color")
    screen = Terminal()
    assert kvctl.main(["list"], out=screen) == 0
    lines = screen.getvalue().splitlines()
    assert any(sock in line for line in lines) and max(len(line) for line in lines) > 80, lines


def test_wide_rows_are_never_cut(engine: tuple[str, KVCacheManager], capsys: pytest.CaptureFixture[str]) -> None:
    # A socket path longer than 80 columns stays whole on a pipe: it can be pasted back.
    sock, _ = engine
    _, out, _ = kv(capsys, "list")
    assert any(line.rstrip().endswith(sock) for line in out.splitlines()) and len(sock) > 20


def test_a_dead_socket_is_not_listed_as_alive(
    engine: tuple[str, KVCacheManager], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = str(tmp_path / "kvcached" / "ledger-999999.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(dead)  # bound, never listening: what SIGKILL leaves
    _, out, _ = kv(capsys, "list", "--json")
    rows = json.loads(out)
    assert [r["alive"] for r in rows] == [True]
    _code, out, _ = kv(capsys, "list", "--all", "--json")
    assert sorted(r["alive"] for r in json.loads(out)) == [False, True]


@pytest.mark.parametrize(
    ("argv", "message", "exit"),
    [  # 2: the command line is wrong; 1: the engine is not there or refuses
        (["limit", "12x"], "not a size", 2),
        (["limit", "a", "b", "c"], "one value", 2),
        (["limit-percent", "150"], "from 0 to 100", 2),
        (["kvtop"], "kvctl watch", 2),
        (["-e", "no-such-model", "status"], "no running kvcached engine", 1),
        (["why", "100000"], "not a page", 1),
        # A size that starts with '-' is the size, refused as negative (argparse took -5M for an option).
        (["limit", "tiny-llama", "-5M"], "'-5M': a negative size", 2),
        (["limit", "-1.5GiB"], "'-1.5GiB': a negative size", 2),
        (["limit", "-5"], "'-5': a negative size", 2),
        (["limit-percent", "tiny-llama", "-5"], "from 0 to 100", 2),
        (["budget", "b", "-5M"], "'-5M': a negative size", 2),
        (["--timeout", "-5", "status"], "above 0", 2),
    ],
)
def test_errors_are_one_line(
    engine: tuple[str, KVCacheManager], capsys: pytest.CaptureFixture[str], argv: list[str], message: str, exit: int
) -> None:
    code, _out, err = kv(capsys, *argv)
    assert code == exit and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_negative_size_names_the_subcommands_help(
    engine: tuple[str, KVCacheManager], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = kv(capsys, "limit", "tiny-llama", "-5M")
    assert (code, out) == (2, "") and err.startswith("kvctl: limit: '-5M': a negative size") and err.count("\n") == 1
    assert err.rstrip().endswith("(see kvctl limit --help)"), err


@pytest.mark.parametrize(
    "argv",
    [["-e", "tiny-lama", "status"], ["limit", "tiny-lama", "8M"], ["-e", "lamma", "pins"], ["dump", "lamma", "-o"]],
)
def test_a_misspelt_engine_name_gets_the_close_ones(
    engine: tuple[str, KVCacheManager], tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = kv(capsys, *argv, *([str(tmp_path / "d.kvj")] if argv[-1] == "-o" else []))
    assert (code, out) == (1, "") and err.count("\n") == 1, err
    assert "no running kvcached engine matches" in err and err.rstrip().endswith("did you mean tiny-llama?"), err
    code, _, err = kv(capsys, "-e", "no-such-model", "status")  # nothing close: nothing guessed
    assert code == 1 and "did you mean" not in err


def test_a_refused_limit_that_rounds_to_the_floor_says_the_bytes(
    engine: tuple[str, KVCacheManager], capsys: pytest.CaptureFixture[str]
) -> None:
    sock, manager = engine
    control = CONTROLS[sock]
    control.floor_pages, control.floor_why = 1, "one request of max_model_len 16 needs 4 blocks on 1 page"
    before = manager.state().limit
    code, out, err = kv(capsys, "limit", str(PAGE - 1))  # one byte short of the floor: both print as 64 KiB
    assert (code, out) == (1, "") and err.count("\n") == 1, err
    assert "limit: 65,535 B is below this engine's floor of 64 KiB (65,536 B; one request of max_model_len 16" in err
    assert manager.state().limit == before
    code, _, err = kv(capsys, "limit", "32K")  # the rounded sizes differ: they say it
    assert code == 1 and "32 KiB is below this engine's floor of 64 KiB (one request of max_model_len 16" in err


def test_help_on_every_subcommand_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("list", "status", "pins", "why", "tail", "limit", "limit-percent", "dump", "watch"):
        with pytest.raises(SystemExit) as e:
            kvctl.main([name, "--help"])
        assert e.value.code == 0
        assert capsys.readouterr().out.strip()
    with pytest.raises(SystemExit):
        kvctl.main(["--version"])
    assert "kvcached" in capsys.readouterr().out


def test_sizes_and_ports() -> None:
    assert parse_size("512M") == 512 << 20 and parse_size("2G") == 2 << 30 and parse_size("1.5GiB") == 3 << 29
    assert serve_port(["vllm", "serve", "m", "--port", "9000"]) == 9000
    assert serve_port(["vllm", "serve", "m"]) == 8000
    assert serve_port(["/x/api_server.py", "--port=8555"]) == 8555
    assert serve_port(["pytest", "-q"]) is None


def test_a_failing_scheduler_call_saves_the_flight_recorder_before_it_raises(tmp_path: Path) -> None:
    from kvcached.ledger.ledger import Ledger
    from kvcached.ledger.recorder import Recorder
    from kvcached.vllm.engine_core import scheduler_calls
    from kvcached.vllm.engine_core.bridge import Bridge
    from kvcached.vllm.engine_core.engine import Engine

    header, events = events_of(ROOT / "traces" / "preempt-shrink.ledger.kvj")
    bg = BackgroundService.start(header, ServiceConfig(flight_events=64, dump_dir=str(tmp_path)))
    recorder = Recorder(Ledger(header))
    bridge = Bridge(object(), recorder, workers=1, windows=frozenset())  # a connector: no build to close
    engine = Engine(recorder, manager=None, pool=None, bridge=bridge, service=bg)

    class Scheduler:  # the shape of vLLM's: the engine wraps the real one's calls the same way
        def schedule(self) -> None:
            for ev in events:
                bg.producer.put(ev)
            raise RuntimeError("a bug in a scheduler step")

    scheduler = Scheduler()
    scheduler_calls.install(scheduler, engine)
    try:
        with pytest.raises(RuntimeError, match="a bug"):
            scheduler.schedule()
        (dump,) = bg.service.dumps
        assert "error" in dump and RotatedJournal(dump).header.meta["flight_recorder"].startswith("engine error")
        assert sum(1 for _ in RotatedJournal(dump).events()) == len(events)  # every event before the error
    finally:
        bg.close()


def test_kvctl_budget_sets_and_shows_a_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    code, out, err = kv(capsys, "budget", "gpu0", "8G", "--json")
    assert code == 0, err
    u = json.loads(out)
    assert u["size"] == 8 << 30 and u["used"] == 0 and u["headroom"] == 8 << 30
    code, out, _ = kv(capsys, "budget", "gpu0")
    assert code == 0 and "8 GiB" in out
    for bad, message in ((["budget", "a/b"], "not a budget name"), (["budget", "gpu0", "lots"], "not a size")):
        code, _, err = kv(capsys, *bad)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1
