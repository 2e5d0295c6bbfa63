"""The live path's edges: journaling from the environment, a journal that fails mid-run, and
the bridge refusing a setup it does not cover with one line that says what to change."""

from __future__ import annotations

import errno
import logging
from types import SimpleNamespace

import pytest

from kvcached.errors import ConfigError
from kvcached.ledger.events import BuildBoundary, Header, PageMapped, PoolGeometry
from kvcached.ledger.journal import read_journal
from kvcached.ledger.recorder import JOURNAL_ENV, Recorder
from kvcached.vllm.engine_core.bridge import install_bridge

HEADER = Header(page_bytes=4096, pools=(PoolGeometry(1024, 16),))


def test_journal_path_from_the_environment(tmp_path, monkeypatch) -> None:
    path = tmp_path / "run.kvj"
    monkeypatch.setenv(JOURNAL_ENV, str(path))
    rec = Recorder.for_header(HEADER, batch=2)
    for ev in (PageMapped(0), BuildBoundary(0), BuildBoundary(1)):
        rec.emit(ev)
    rec.close()
    got = read_journal(str(path))
    assert got.events == [PageMapped(0), BuildBoundary(0), BuildBoundary(1)]
    assert got.header == HEADER


def test_a_failing_journal_stops_journaling_and_serving_goes_on(tmp_path, caplog) -> None:
    path = tmp_path / "full.kvj"
    rec = Recorder.for_header(HEADER, journal_path=str(path), batch=1)
    rec.emit(PageMapped(0))  # one whole frame on disk
    assert rec.journal is not None
    real_write = rec.journal._file.write

    def disk_full(data: bytes) -> int:
        real_write(bytes(data)[:5])  # a torn write, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    rec.journal._file.write = disk_full  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="kvcached.ledger"):
        rec.emit(BuildBoundary(0))
        rec.emit(BuildBoundary(1))  # serving goes on: the ledger still applies every event
    assert rec.journal is None
    assert rec.ledger.index == 3 and rec.ledger.build == 2
    assert len([r for r in caplog.records if "journaling stopped" in r.getMessage()]) == 1
    got = read_journal(str(path))  # cut back to its last whole frame: reads cleanly
    assert got.events == [PageMapped(0)] and got.torn_tail is None


@pytest.mark.parametrize("connector", [None, SimpleNamespace()])
def test_the_bridge_refuses_a_scheduler_without_the_offloading_connector(connector: object) -> None:
    scheduler = SimpleNamespace(connector=connector)
    with pytest.raises(ConfigError) as e:
        install_bridge(scheduler, Recorder.for_header(HEADER, journal_path=""))
    msg = str(e.value)
    assert "\n" not in msg and "OffloadingConnector" in msg and "disable kvcached" in msg


def test_an_engine_journals_inline_or_through_the_service_not_both() -> None:
    from kvcached.service.ledger_service import ServiceConfig
    from kvcached.vllm.engine_core.engine import EngineConfig

    with pytest.raises(ConfigError, match="not both"):
        EngineConfig(journal_path="a.kvj", journal_service=ServiceConfig(journal="b.kvj"))
    with pytest.raises(ConfigError, match="max_cached_blocks"):
        EngineConfig(max_cached_blocks=-1)
