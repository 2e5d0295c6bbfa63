"""The ledger service: what reaches the journal (order, completeness, gaps), rotation, snapshots,
durability, overflow without blocking, and a disk that fills up while the engine serves."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, cast

import anyio
import msgspec
import pytest

from kvcached.errors import ConfigError
from kvcached.ledger.events import Event, Gap
from kvcached.ledger.journal import read_journal
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.segments import RotatedJournal, read_snapshot, resume, segment_path, snapshot_path
from kvcached.ledger.simulate import derive
from kvcached.service import ledger_service as service_mod
from kvcached.service.ledger_service import BackgroundService, Durability, LedgerService, Producer, ServiceConfig
from kvcached.testing import synth

HEADER = synth.header()
_TRACE: list[Event] = []


def trace(n: int) -> list[Event]:
    """The synthetic workload with the allocator's decisions: a realistic, violation-free trace."""
    if len(_TRACE) < n:
        _TRACE[:] = derive(Ledger(HEADER), itertools.islice(synth.workload(3), 2 * n))
    return _TRACE[:n]


def put_all(producer: Producer, events: list[Event], pause_every: int = 0) -> None:
    for i, ev in enumerate(events):
        producer.put(ev)
        if pause_every and i % pause_every == 0:
            time.sleep(0.0005)  # let the writer interleave, as a scheduler step would


def with_gaps(journal: list[Event], sent: list[Event]) -> int:
    """Checks ``journal`` against what was put: equal in order, a ``Gap(n)`` standing for n dropped
    events; returns the events accounted for (written + dropped)."""
    at = 0
    for ev in journal:
        if type(ev) is Gap and (at >= len(sent) or sent[at] != ev):
            at += ev.dropped
            continue
        assert ev == sent[at], f"journal event differs from put event {at}"
        at += 1
    return at


class FaultyFile:
    """A journal file that blocks on ``gate`` or fills up after ``room`` bytes (ENOSPC)."""

    def __init__(self, file: BinaryIO, room: int | None = None, gate: threading.Event | None = None) -> None:
        self._f = file
        self.room, self.gate = room, gate

    def write(self, data: Any) -> int:
        if self.gate is not None and self._f.tell() > 0:
            self.gate.wait()
        if self.room is not None:
            if self.room <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            data = bytes(data)[: self.room]
            self.room -= len(data)
        return self._f.write(data) or 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


_REAL_OPEN = service_mod._open_segment_file


def faulty(room: int | None = None, gate: threading.Event | None = None) -> Callable[[str], tuple[str, BinaryIO]]:
    """A replacement for the service's segment file maker that wraps each file in FaultyFile."""

    def open_segment_file(near: str) -> tuple[str, BinaryIO]:
        tmp, file = _REAL_OPEN(near)
        return tmp, cast(BinaryIO, FaultyFile(file, room, gate))

    return open_segment_file


# --- the hand-off -------------------------------------------------------------------------------


def test_producer_puts_a_gap_where_the_drop_happened() -> None:
    ev = trace(10)
    p = Producer(capacity=5, wake_at=100)
    for e in ev[:7]:
        p.put(e)  # 5 fit, 2 dropped
    assert (p.queued, p.dropped, p.episodes) == (5, 2, 1)
    p._q.popleft(), p._q.popleft()  # the writer takes two
    p.put(ev[7])
    assert list(p._q) == [*ev[2:5], Gap(2), ev[7]]
    assert (p.dropped, p.gaps, p.episodes) == (2, 1, 1)
    p.put(ev[8])  # full again (past the bound by the gap): a second episode
    p._q.clear()
    p.put(ev[9])
    assert list(p._q) == [Gap(1), ev[9]] and p.episodes == 2


def test_producer_wakes_a_sleeping_writer_once_per_batch_not_per_event() -> None:
    p = Producer(capacity=1000, wake_at=10)
    for e in trace(9):
        p.put(e)
    p._sleeping = True
    for e in trace(500):
        p.put(e)
    assert os.read(p._rfd, 100) == b"\0"  # exactly one wake byte for 500 events
    assert not p._sleeping
    with pytest.raises(BlockingIOError):
        os.read(p._rfd, 100)


def test_config_is_checked() -> None:
    assert ServiceConfig(durability="batch").durability is Durability.BATCH  # type: ignore[arg-type]
    for bad in ({"durability": "sometimes"}, {"capacity": 0}, {"snapshot_every": 5, "replica": False}):
        with pytest.raises(ConfigError):
            ServiceConfig(**bad)


# --- the journal --------------------------------------------------------------------------------


def test_journal_gets_every_event_in_order_across_rotated_segments(tmp_path: Path) -> None:
    events = trace(30_000)
    path = str(tmp_path / "trace.kvj")
    cfg = ServiceConfig(journal=path, batch_events=97, rotate_bytes=64 << 10, snapshot_every=7000, capacity=1 << 16)
    with BackgroundService.start(HEADER, cfg) as bg:
        put_all(bg.producer, events, pause_every=500)
    assert bg.producer.dropped == 0
    journal = RotatedJournal(path)
    assert len(journal.segments) > 3
    assert list(journal.events()) == events and journal.torn_tail is None
    first = 0
    for k, seg in enumerate(journal.paths):  # each segment is a whole journal on its own
        assert seg == segment_path(path, k)
        contents = read_journal(seg)
        assert contents.header.meta["segment"] == str(k) and contents.header.meta["first_event"] == str(first)
        assert contents.header.pools == HEADER.pools and contents.torn_tail is None
        first += len(contents.events)
    # The replica saw what the journal holds, and a replay from the snapshot ends in the same state.
    whole = Ledger(HEADER)
    whole.apply_all(events)
    assert bg.service.replica is not None and bg.service.replica.snapshot() == whole.snapshot()
    snap = read_snapshot(snapshot_path(path))
    assert snap.index == bg.service.journal_status().snapshot_index and 0 < snap.index <= len(events)
    ledger, rest, _ = resume(path)
    assert ledger.index == snap.index
    ledger.apply_all(rest)
    assert ledger.snapshot() == whole.snapshot()
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_a_service_started_from_a_snapshot_writes_a_replayable_journal(tmp_path: Path) -> None:
    events = trace(6000)
    live = Ledger(HEADER)
    live.apply_all(events[:2500])
    path = str(tmp_path / "late.kvj")
    with BackgroundService.start(HEADER, ServiceConfig(journal=path), start=live.snapshot()) as bg:
        put_all(bg.producer, events[2500:])
    journal = RotatedJournal(path)
    assert journal.first_event == 2500 and list(journal.events()) == events[2500:]
    ledger, rest, _ = resume(path)
    ledger.apply_all(rest)
    live.apply_all(events[2500:])
    assert ledger.snapshot() == live.snapshot()


@pytest.mark.parametrize("durability", list(Durability))
def test_durability_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durability: Durability) -> None:
    fsyncs: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    reported: list[int] = []
    path = str(tmp_path / "d.kvj")
    cfg = ServiceConfig(
        journal=path,
        durability=durability,
        batch_events=50,
        snapshot_every=0,
        fsync_interval=3600,
        on_durable=reported.append,
    )
    with BackgroundService.start(HEADER, cfg) as bg:
        put_all(bg.producer, trace(2000), pause_every=100)
    status = bg.service.journal_status()
    assert status.events_written == 2000 and status.state == "closed"
    frames = read_journal(path)
    assert frames.events == trace(2000)
    if durability is Durability.NONE:
        assert fsyncs == [] and reported == [] and status.events_durable == 0
    elif durability is Durability.INTERVAL:
        # Once when the segment is created, once at close: the hour-long interval never came.
        assert len(fsyncs) <= 4 and reported == [2000]
    else:
        assert len(fsyncs) >= 2000 // 50 and reported == sorted(reported) and reported[-1] == 2000
        assert len(reported) > 2


# --- overflow and failures ----------------------------------------------------------------------


def test_overflow_never_blocks_the_producer_and_is_journaled_as_a_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    gate = threading.Event()
    monkeypatch.setattr(service_mod, "_open_segment_file", faulty(gate=gate))
    events = trace(20_000)
    path = str(tmp_path / "slow.kvj")
    caplog.set_level(logging.WARNING, "kvcached.service.ledger_service")
    bg = BackgroundService.start(HEADER, ServiceConfig(journal=path, capacity=1000, batch_events=100))
    try:
        slowest = 0.0
        for ev in events[:15_000]:  # the disk hangs: the hand-off fills, the producer goes on
            t0 = time.perf_counter()
            bg.producer.put(ev)
            slowest = max(slowest, time.perf_counter() - t0)
        assert bg.producer.dropped > 10_000 and bg.producer.episodes >= 1
        assert slowest < 0.1, f"a put took {slowest * 1e3:.1f} ms"
        gate.set()
        while bg.producer.queued:
            time.sleep(0.005)
        put_all(bg.producer, events[15_000:], pause_every=50)
    finally:
        gate.set()
        bg.close()
    written = read_journal(path).events
    assert any(type(e) is Gap for e in written)
    assert with_gaps(written, events) == len(events)  # every event written or counted, in order
    # One warning for the overload and one when it ended, however often the hand-off refilled.
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "hand-off is full" in warnings[0]
    assert warnings[1] == f"kvcached: the ledger service caught up; {bg.producer.dropped} events were dropped"
    assert bg.service.replica is not None and bg.service.replica.lossy


def test_a_full_disk_stops_journaling_once_and_the_producer_keeps_serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(service_mod, "_open_segment_file", faulty(room=20_000))
    events = trace(20_000)
    path = str(tmp_path / "full.kvj")
    caplog.set_level(logging.ERROR, "kvcached.service.ledger_service")
    with BackgroundService.start(HEADER, ServiceConfig(journal=path, batch_events=64, snapshot_every=0)) as bg:
        t0 = time.perf_counter()
        put_all(bg.producer, events, pause_every=200)
        assert time.perf_counter() - t0 < 30
    status = bg.service.journal_status()
    assert status.state == "stopped" and status.error is not None and "No space left" in status.error
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].startswith("kvcached: journaling stopped, serving goes on")
    # What was journaled reads cleanly (cut back to the last whole frame) and is a prefix.
    contents = read_journal(path)
    assert contents.torn_tail is None and 0 < len(contents.events) < len(events)
    assert contents.events == events[: len(contents.events)]
    assert bg.producer.dropped == 0
    assert bg.service.replica is not None and bg.service.replica.index == len(events)


def test_an_unwritable_journal_path_leaves_the_service_running(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, "kvcached.service.ledger_service")
    cfg = ServiceConfig(journal=str(tmp_path / "missing" / "j.kvj"))
    with BackgroundService.start(HEADER, cfg) as bg:
        put_all(bg.producer, trace(1000))
    assert bg.service.journal_status().state == "stopped"
    assert len([r for r in caplog.records if "journaling stopped" in r.getMessage()]) == 1
    assert bg.service.replica is not None and bg.service.replica.index == 1000


# --- the service in the caller's loop -----------------------------------------------------------


async def test_run_in_an_existing_loop_drains_on_stop(tmp_path: Path) -> None:
    events = trace(5000)
    path = str(tmp_path / "loop.kvj")
    svc = LedgerService(HEADER, ServiceConfig(journal=path, durability=Durability.BATCH))
    batches: list[tuple[int, int]] = []
    svc.listeners.append(lambda first, payload: batches.append((first, len(msgspec.msgpack.decode(payload)))))
    async with anyio.create_task_group() as tg:
        await tg.start(svc.run)

        def produce() -> None:
            put_all(svc.producer, events, pause_every=250)

        await anyio.to_thread.run_sync(produce)
        svc.stop()
    assert read_journal(path).events == events
    # Listeners see every batch once, contiguous, in order.
    assert [f for f, _ in batches] == list(itertools.accumulate([0] + [n for _, n in batches[:-1]]))
    assert sum(n for _, n in batches) == len(events)
    with pytest.raises(RuntimeError):
        await svc.run()


def test_events_put_after_stop_are_counted_not_lost_silently(tmp_path: Path) -> None:
    with BackgroundService.start(HEADER, ServiceConfig(journal=str(tmp_path / "s.kvj"))) as bg:
        put_all(bg.producer, trace(10))
    bg.producer.put(trace(11)[-1])
    assert bg.producer.dropped == 1 and bg.producer.queued == 0
    assert len(read_journal(str(tmp_path / "s.kvj")).events) == 10


def _drained(it: Iterator[Event]) -> int:
    return sum(1 for _ in it)


def test_resume_refuses_a_journal_it_cannot_start(tmp_path: Path) -> None:
    from kvcached.errors import JournalError

    path = str(tmp_path / "r.kvj")
    live = Ledger(HEADER)
    live.apply_all(trace(100))
    with BackgroundService.start(HEADER, ServiceConfig(journal=path), start=live.snapshot()) as bg:
        put_all(bg.producer, trace(200)[100:])
    os.unlink(snapshot_path(path))
    with pytest.raises(JournalError, match="no snapshot covers"):
        resume(path)
    assert _drained(RotatedJournal(path).events(150)) == 50
    with pytest.raises(JournalError, match="ends at event 200"):
        _drained(RotatedJournal(path).events(500))


# --- files the service does not own ------------------------------------------


def _journal_off(bg: BackgroundService) -> str:
    status = bg.service.journal_status()
    assert status.state == "stopped" and status.error is not None
    return status.error


@pytest.mark.parametrize("what", ["fifo", "symlink", "foreign file", "directory"])
def test_a_journal_path_holding_something_else_is_never_replaced(tmp_path: Path, what: str) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / "j.kvj"
    if what == "fifo":  # as a device node such as /dev/full would be
        os.mkfifo(path)
    elif what == "symlink":
        os.symlink(victim, path)
    elif what == "foreign file":
        path.write_bytes(b"Jan  1 00:00:00 host a log line\n")
    else:
        path.mkdir()
    before = os.lstat(path)
    with BackgroundService.start(HEADER, ServiceConfig(journal=str(path))) as bg:
        put_all(bg.producer, trace(100))
    error = _journal_off(bg)
    assert error.startswith(f"{path}: ") and "not a file this journal service wrote" in error, error
    after = os.lstat(path)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert victim.read_bytes() == b"precious"
    if what == "foreign file":
        assert path.read_bytes() == b"Jan  1 00:00:00 host a log line\n"
    assert sorted(os.listdir(tmp_path)) == ["j.kvj", "victim"]  # nothing made, no temporary file left
    assert bg.service.replica is not None and bg.service.replica.index == 100  # serving went on


def test_files_beside_the_journal_that_it_did_not_write_are_never_deleted(tmp_path: Path) -> None:
    path = str(tmp_path / "syslog")
    theirs = {
        "syslog.1": b"rotated log 1\n",
        "syslog.2": b"rotated log 2\n",
        "syslog.snap": b"a snap",
        "syslog.3.tmp": b"t3",
        "syslog.snap.tmp": b"ts",
        "syslog.keep": b"k",
    }
    for name, data in theirs.items():
        (tmp_path / name).write_bytes(data)
    with BackgroundService.start(HEADER, ServiceConfig(journal=path)) as bg:
        put_all(bg.producer, trace(100))
    # The names the journal would write (syslog.1, syslog.snap) are taken: journaling is off.
    assert _journal_off(bg).startswith(f"{path}.1: a regular file that is not a kvcached journal, not a file this")
    assert {n: (tmp_path / n).read_bytes() for n in theirs} == theirs and not os.path.exists(path)
    for name in ("syslog.1", "syslog.2", "syslog.snap"):
        del theirs[name]
        os.unlink(tmp_path / name)
    with BackgroundService.start(HEADER, ServiceConfig(journal=path, snapshot_every=0)) as bg:
        put_all(bg.producer, trace(100))
    assert bg.service.journal_status().state == "closed"
    assert list(RotatedJournal(path).events()) == trace(100)
    assert {n: (tmp_path / n).read_bytes() for n in theirs} == theirs  # other names: left alone


def test_temporary_files_have_unpredictable_names_and_are_never_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = str(tmp_path / "t.kvj")
    # The names the temporary files used to have, planted (in /tmp, by another user) as links.
    for k in range(8):
        os.symlink(victim, segment_path(path, k) + ".tmp")
    os.symlink(victim, snapshot_path(path) + ".tmp")
    temps: list[str] = []

    def recording(near: str) -> tuple[str, BinaryIO]:
        tmp, file = _REAL_OPEN(near)
        temps.append(os.path.basename(tmp))
        return tmp, file

    monkeypatch.setattr(service_mod, "_open_segment_file", recording)
    events = trace(8000)
    cfg = ServiceConfig(journal=path, batch_events=97, rotate_bytes=16 << 10, snapshot_every=2000)
    with BackgroundService.start(HEADER, cfg) as bg:
        put_all(bg.producer, events, pause_every=500)
    assert bg.service.journal_status().state == "closed"
    assert victim.read_bytes() == b"precious"
    journal = RotatedJournal(path)
    assert len(journal.segments) >= 3 and list(journal.events()) == events
    assert 0 < read_snapshot(snapshot_path(path)).index <= len(events)
    assert len(temps) == len(journal.segments) == len(set(temps))
    assert all(re.fullmatch(r"\.t\.kvj(\.[0-9]+)?\.[0-9a-f]{16}\.tmp", t) for t in temps), temps
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # none left behind


def test_a_restarted_service_keeps_the_previous_runs_journal_and_at_most_keep_runs(tmp_path: Path) -> None:
    path = str(tmp_path / "run.kvj")

    def one_run(n: int) -> None:
        cfg = ServiceConfig(journal=path, batch_events=97, rotate_bytes=16 << 10, snapshot_every=1000, keep_runs=2)
        with BackgroundService.start(HEADER, cfg) as bg:
            put_all(bg.producer, trace(n), pause_every=500)
        assert bg.service.journal_status().state == "closed"

    one_run(3000)
    first = sorted(os.listdir(tmp_path))
    assert len(first) >= 4  # segments and a snapshot
    one_run(1000)  # the run that crashed is the one an operator needs: kept as run.kvj.run1
    kept = sorted(n for n in os.listdir(tmp_path) if n.startswith("run.kvj.run1"))
    assert kept == sorted(n.replace("run.kvj", "run.kvj.run1", 1) for n in first)
    assert list(RotatedJournal(path + ".run1.2").events()) == trace(3000)  # a journal of its own
    ledger, rest, _ = resume(path + ".run1")
    ledger.apply_all(rest)
    assert ledger.index == 3000
    assert list(RotatedJournal(path).events()) == trace(1000)
    # Names in the runs' pattern that the service did not write are neither counted nor deleted.
    (tmp_path / "run.kvj.run1.notes").write_bytes(b"an operator's notes")
    (tmp_path / "run.kvj.run2.7").write_bytes(b"not a segment")
    one_run(500)  # run.kvj.run3 (2 is taken), runs 3 and 1 kept
    assert os.path.exists(path + ".run1") and os.path.exists(path + ".run3")
    one_run(200)  # run.kvj.run4; keep_runs=2: run 1's files go
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("run.kvj.run1")) == ["run.kvj.run1.notes"]
    assert (tmp_path / "run.kvj.run2.7").read_bytes() == b"not a segment"
    for where, n in ((".run3", 1000), (".run4", 500), ("", 200)):
        assert list(RotatedJournal(path + where).events()) == trace(n)


def test_a_journal_another_running_service_writes_is_not_taken_over(tmp_path: Path) -> None:
    path = str(tmp_path / "dp.kvj")  # two engines (data-parallel ranks) given one journal path
    with BackgroundService.start(HEADER, ServiceConfig(journal=path)) as first:
        put_all(first.producer, trace(100))
        with BackgroundService.start(HEADER, ServiceConfig(journal=path)) as second:
            put_all(second.producer, trace(50))
        assert "another running ledger service is writing this journal" in _journal_off(second)
        put_all(first.producer, trace(300)[100:])
    assert first.service.journal_status().state == "closed"
    assert list(RotatedJournal(path).events()) == trace(300)
    assert sorted(os.listdir(tmp_path)) == ["dp.kvj"]


def test_keep_runs_is_checked() -> None:
    with pytest.raises(ConfigError, match="keep_runs=-1"):
        ServiceConfig(keep_runs=-1)
