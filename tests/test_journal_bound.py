"""Bounded disk: the real ledger service run past its journal's size bound keeps a
journal that kvreplay replays from its snapshot, never deletes a file it did not write, and keeps
only its newest flight-recorder dumps; a journal missing its head without the writer's note
stays an error."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from kvcached.errors import ConfigError, JournalError
from kvcached.ledger.events import Event
from kvcached.ledger.ledger import Ledger
from kvcached.ledger.segments import PRUNED_KEY, RotatedJournal, read_header, resume, segment_path, snapshot_path
from kvcached.ledger.simulate import derive
from kvcached.service import retention
from kvcached.service.journal_files import members
from kvcached.service.ledger_service import BackgroundService, LedgerService, ServiceConfig
from kvcached.testing import synth
from kvreplay.cli import main as kvreplay

HEADER = synth.header()
_TRACE: list[Event] = []
SEGMENT = 32 << 10
BOUND = 256 << 10  # the synthetic header's snapshot is about 37 KiB: the bound holds ~6 segments
# What the journal may pass its bound by (retention.py): the frame that takes the segment being
# written past its size, at most batch_events (97 here) of these small events.
FRAME_SLACK = 8 << 10


def trace(n: int) -> list[Event]:
    if len(_TRACE) < n:
        _TRACE[:] = derive(Ledger(HEADER), itertools.islice(synth.workload(3), 2 * n))
    return _TRACE[:n]


def journal_bytes(path: str) -> int:
    """Bytes in the files named as the journal at ``path``'s (``P``, ``P.<n>``, ``P.snap``)."""
    folder, name = os.path.split(path)
    return sum(os.lstat(os.path.join(folder, e)).st_size for e in members(os.listdir(folder), name))


def bounded(path: str, snapshot_every: int) -> ServiceConfig:
    return ServiceConfig(
        journal=path, batch_events=97, rotate_bytes=SEGMENT, max_bytes=BOUND, snapshot_every=snapshot_every
    )


def serve(
    cfg: ServiceConfig,
    events: list[Event],
    during: Callable[[BackgroundService], bool] | None = None,
    *,
    replay_each_rotation: bool = True,
) -> tuple[BackgroundService, int]:
    """Runs the service over ``events`` in chunks (``during`` is called after each until it says
    it is done); returns it, closed, and the most bytes its journal held between two batches.
    After every rotation the journal on disk must replay from its snapshot to the last event
    written: a crash may come at any time, not only once the run is over."""
    assert cfg.journal is not None
    peak, segment = [0], [0]
    problems: list[str] = []

    def sample(first: int, payload: bytes) -> None:  # on the loop, between two batches' disk work
        path = cfg.journal or ""
        peak[0] = max(peak[0], journal_bytes(path))
        now = bg.service.journal_status().segment
        if replay_each_rotation and now != segment[0] and bg.service.journal_status().state == "writing":
            segment[0] = now
            try:
                ledger, rest, _ = resume(path)
                ledger.apply_all(rest)
            except JournalError as exc:
                problems.append(f"after rotating to segment {now}: {exc}")
                return
            if ledger.index != first:
                problems.append(f"after rotating to segment {now}: replays to event {ledger.index}, not {first}")

    with BackgroundService.start(HEADER, cfg) as bg:
        bg.service.listeners.append(sample)
        for at in range(0, len(events), 500):
            for ev in events[at : at + 500]:
                bg.producer.put(ev)
            deadline = time.monotonic() + 30
            while bg.service.journal_status().events_written < min(at + 500, len(events)):
                assert time.monotonic() < deadline, "the service did not drain"
                time.sleep(0.002)
            assert not problems, problems[0]
            if during is not None and during(bg):
                during = None
    return bg, max(peak[0], journal_bytes(cfg.journal))


def check_json(capsys: pytest.CaptureFixture[str], path: str) -> dict:  # type: ignore[type-arg]
    capsys.readouterr()
    code = kvreplay(["check", path, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)  # type: ignore[no-any-return]


# --- the journal's bound ------------------------------------------------------------------------


@pytest.mark.parametrize("snapshot_every", [5000, 0], ids=["snapshots", "only-the-bound-snapshots"])
def test_a_journal_run_past_its_bound_stays_within_it_and_replays_from_its_snapshot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], snapshot_every: int
) -> None:
    events = trace(40_000)
    path = str(tmp_path / "bound.kvj")
    bg, peak = serve(bounded(path, snapshot_every=snapshot_every), events)
    status = bg.service.journal_status()
    written = status.pruned_bytes + status.kept_bytes
    assert written > 2 * BOUND, "the run must go well past its bound"
    assert peak <= BOUND + FRAME_SLACK, (peak, BOUND)
    assert status.kept_bytes == journal_bytes(path) and status.pruned_segments > 0
    assert not os.path.exists(path)  # segment 0 went with the others before the snapshot
    journal = RotatedJournal(path)
    assert journal.pruned_below == status.first_segment == journal.segments[0].number > 0
    # What is kept is the newest snapshot and every event after it, unchanged.
    snap_index = status.snapshot_index
    assert snap_index is not None and journal.first_event <= snap_index
    assert list(journal.events(journal.first_event)) == events[journal.first_event :]
    ledger, rest, _ = resume(path)
    ledger.apply_all(rest)
    whole = Ledger(HEADER)
    whole.apply_all(events)
    assert ledger.snapshot() == whole.snapshot()
    report = check_json(capsys, path)
    assert report["clean"] and report["from_snapshot"] == snap_index
    assert report["segments"][-1]["first_event"] + report["segments"][-1]["events"] == len(events)
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_files_of_the_journals_names_the_service_did_not_write_are_never_deleted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    path = str(tmp_path / "plant.kvj")
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    copy = b""

    def plant(bg: BackgroundService) -> bool:
        nonlocal copy
        if bg.service.journal_status().segment < 3:
            return False
        # While the service runs: segment 1 becomes a link to another file, segment 2 a copy of
        # itself (the same bytes, another file). Neither is the file the service wrote.
        os.unlink(segment_path(path, 1))
        os.symlink(victim, segment_path(path, 1))
        two = segment_path(path, 2)
        shutil.copyfile(two, str(tmp_path / "copy"))
        os.replace(str(tmp_path / "copy"), two)
        copy = Path(two).read_bytes()
        return True

    # Until the bound's cut passes them, the planted names break the journal: no replay meanwhile.
    bg, _ = serve(bounded(path, snapshot_every=5000), trace(40_000), during=plant, replay_each_rotation=False)
    assert copy, "the plant happened before the bound was reached"
    assert os.path.islink(segment_path(path, 1)) and victim.read_bytes() == b"someone else's file"
    assert Path(segment_path(path, 2)).read_bytes() == copy
    status = bg.service.journal_status()
    assert status.pruned_segments > 0 and status.first_segment > 2
    assert any("not deleted" in r.getMessage() and "plant.kvj.1" in r.getMessage() for r in caplog.records)
    # The reader takes the names below the note for leftovers, not for part of the journal.
    assert check_json(capsys, path)["clean"]


def test_a_missing_head_without_the_writers_note_is_still_lost_events(tmp_path: Path) -> None:
    events = trace(20_000)
    path = str(tmp_path / "plain.kvj")
    cfg = ServiceConfig(journal=path, batch_events=97, rotate_bytes=SEGMENT, snapshot_every=5000)
    with BackgroundService.start(HEADER, cfg) as bg:
        for ev in events:
            bg.producer.put(ev)
    assert RotatedJournal(path).pruned_below == 0
    os.unlink(path)
    os.unlink(segment_path(path, 1))
    with pytest.raises(JournalError, match="no segment says the journal's size bound deleted it"):
        RotatedJournal(path)


def test_a_pruned_journal_missing_the_segment_its_note_names_is_an_error(tmp_path: Path) -> None:
    path = str(tmp_path / "cut.kvj")
    bg, _ = serve(bounded(path, snapshot_every=5000), trace(30_000))
    first = bg.service.journal_status().first_segment
    last = RotatedJournal(path).segments[-1]
    assert read_header(last.path).meta[PRUNED_KEY] == str(first)
    os.unlink(segment_path(path, first))
    with pytest.raises(JournalError, match=f"segment {first} of the rotated journal .* is missing"):
        RotatedJournal(path)


def test_the_bound_is_checked_against_the_segment_and_the_snapshot(tmp_path: Path) -> None:
    for bad in (
        {"max_bytes": BOUND, "rotate_bytes": 0},
        {"max_bytes": BOUND, "replica": False, "snapshot_every": 0},
        {"max_bytes": SEGMENT, "rotate_bytes": SEGMENT},
        {"max_dumps": -1},
    ):
        with pytest.raises(ConfigError):
            ServiceConfig(**bad)  # type: ignore[arg-type]
    # 32 KiB of segment and the header's 37 KiB snapshot do not fit in 64 KiB.
    with pytest.raises(ConfigError) as e:
        LedgerService(HEADER, ServiceConfig(journal=str(tmp_path / "j"), rotate_bytes=SEGMENT, max_bytes=64 << 10))
    message = str(e.value)
    assert "\n" not in message and retention.MAX_BYTES_VAR in message and retention.SEGMENT_VAR in message
    assert "snapshot" in message and not os.listdir(tmp_path)


# --- flight-recorder dumps ------------------------------------------------------------------------


async def test_only_the_newest_dumps_are_kept_and_only_the_services_own_deleted(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    foreign = dumps / "flight-1-20200101T000000-I1.kvj"  # another engine's, or an operator's copy
    foreign.write_bytes(b"not this service's")
    svc = LedgerService(HEADER, ServiceConfig(flight_events=64, batch_events=16, dump_dir=str(dumps), max_dumps=2))
    saved: list[str] = []
    async with anyio.create_task_group() as tg:
        await tg.start(svc.run)
        for ev in trace(1000):  # past twice the ring: each dump has a snapshot beside it
            svc.producer.put(ev)
        while svc.index < 1000:
            await anyio.sleep(0.005)
        for i in range(5):
            path = await svc._save_flight(f"test {i}", f"t{i}")
            assert path is not None
            saved.append(path)
            if i == 1:  # the oldest kept dump's snapshot is replaced by a link before it is due to go
                os.unlink(snapshot_path(saved[0]))
                os.symlink(foreign, snapshot_path(saved[0]))
        svc.stop()
    assert svc.dumps == saved[-2:]
    left = sorted(os.listdir(dumps))
    kept = sorted(os.path.basename(p) for d in saved[-2:] for p in (d, snapshot_path(d)))
    assert left == sorted([*kept, foreign.name, os.path.basename(snapshot_path(saved[0]))])
    assert os.path.islink(snapshot_path(saved[0])) and foreign.read_bytes() == b"not this service's"
