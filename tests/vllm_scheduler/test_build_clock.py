"""Build boundaries that say when, on vLLM's real Scheduler and OffloadingConnector.

An incident seen on a dashboard at 14:05 must be findable in the journal (``kvreplay show
--at``), so a served engine's boundaries carry the time: microseconds on the
monotonic clock after the header's wall-clock base. A scenario or kvsim seed must give the same
bytes on every run, so its engines (``EngineConfig.clock`` False, the default) write none. With
the bridge emitting ``BuildBoundary(build)`` without ``recorder.stamp()`` (the old code) the
first test fails: no boundary has a time.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")
pytestmark = pytest.mark.vllm

from kvcached.ledger.events import BuildBoundary  # noqa: E402
from kvcached.ledger.journal import read_journal  # noqa: E402
from kvcached.vllm.engine_core.engine import EngineConfig  # noqa: E402
from kvcached.vllm.testing.harness import Harness, HarnessConfig  # noqa: E402
from kvcached.vllm.testing.host_engine import HostEngine  # noqa: E402

CFG = HarnessConfig(num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)


def serve(journal: Path, clock: bool) -> tuple[float, float]:
    """A few requests to the end on an engine journaling to ``journal``; the wall clock around."""
    kv = HostEngine(EngineConfig(journal_path=str(journal), clock=clock))
    before = time.time()
    h = Harness(CFG, kv_memory=kv.kv_memory, on_scheduler_built=kv.on_scheduler_built)
    for i in range(3):
        h.add_request(prompt=h.make_prompt(40, seed=i), max_tokens=3)
        h.step()
    h.run_until_idle()
    h.close()
    kv.close()
    return before, time.time()


def test_served_boundaries_carry_the_time(tmp_path: Path) -> None:
    before, after = serve(tmp_path / "clock.kvj", clock=True)
    got = read_journal(tmp_path / "clock.kvj")
    base = got.header.clock_base_unix
    assert before <= base <= after
    boundaries = [e for e in got.events if isinstance(e, BuildBoundary)]
    assert len(boundaries) >= 4
    times = [b.at_us for b in boundaries]
    assert all(t is not None for t in times), times
    stamps = [t for t in times if t is not None]
    assert stamps == sorted(stamps)  # the monotonic clock never goes back
    assert before <= base + stamps[0] / 1e6 and base + stamps[-1] / 1e6 <= after + 0.001


def test_scenario_boundaries_carry_none(tmp_path: Path) -> None:
    serve(tmp_path / "plain.kvj", clock=False)
    got = read_journal(tmp_path / "plain.kvj")
    assert got.header.clock_base_unix == 0.0
    boundaries = [e for e in got.events if isinstance(e, BuildBoundary)]
    assert boundaries and all(b.at_us is None for b in boundaries)
