"""SGLang serving end to end on this CPU, kvcached under it through SGLang's plugin interface.

SGLang's offline ``Engine`` (its tokenizer manager, scheduler and detokenizer processes)
serves the tiny llama with HiCache on (``kvcached.sglang.testing.serve``): three prompts on a
160-slot pool, so that the first two are evicted to the host tier and come back from it, then a
flush and the first again. Native SGLang, kvcached ``legacy`` and kvcached ``ledger`` must give
the same tokens and the same cache hits (device and host), and the ledger's journal must replay
clean. The same for SGLang's paged allocator (``--page-size 16``), an MLA model (DeepSeek-V2) and a
sliding-window model (Gemma-3), each against native SGLang. The platform for a CPU without
sgl-kernel is test scaffolding
(``kvcached.sglang.testing.cpu_platform``), discovered by SGLang as a vendor's plugin would be.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcached.ledger.journal import JournalContents, read_journal
from kvcached.ledger.ledger import Ledger
from kvcached.sglang.engine import sglang_version
from kvcached.sglang.testing import gpu_only
from kvcached.testing import tiny_kinds
from kvcached.testing.tiny_model import build

if (_why := gpu_only()) is not None:
    pytest.skip(_why, allow_module_level=True)

from kvcached.sglang.testing import cpu_platform  # imports what SGLang 0.5.22 added
from kvcached.sglang.testing.serve import tiny_mla


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict], Path]]:
    root = tmp_path_factory.mktemp("sglang-serve")
    models = {
        "llama": build(root / "tiny"),
        "mla": tiny_mla(root / "tiny-mla"),
        "swa": tiny_kinds.build(root / "tiny-gemma3", "gemma3"),
    }
    site = cpu_platform.dist_info(str(root / "site"))
    # Each variant is a process tree of its own that spends most of its life importing on one core:
    # two at a time.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        done = {variant: pool.submit(_serve_variant, variant, root, models, site) for variant in VARIANTS}
    return {variant: future.result() for variant, future in done.items()}


# "-p16": at --page-size 16, SGLang's paged allocator (kvcached's subclass places as SGLang does);
# "-mla": the tiny DeepSeek-V2, whose pool is MLATokenToKVPool (a latent per layer); "-swa": the
# tiny Gemma-3, sliding-window (32) and full layers alternating, which SGLang serves from one MHA
# pool, the window a mask (model_overrides/gemma2_gemma3.py: no hybrid SWA memory).
VARIANTS = (
    "native", "legacy", "ledger", "native-p16", "ledger-p16", "native-mla", "ledger-mla", "native-swa", "ledger-swa"
)  # fmt: skip


def _serve_variant(variant: str, root: Path, models: dict[str, Path], site: str) -> tuple[list[dict], Path]:
    """Serve the three prompts once, as ``variant`` says: its lines and its journal's path."""
    policy, _, kind = variant.partition("-")
    journal = root / f"{variant}.kvj"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED", "SGLANG_"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")])), HF_HUB_OFFLINE="1")
    if policy != "native":
        env.update(
            ENABLE_KVCACHED="1",
            KVCACHED_BACKEND="host",
            KVCACHED_LEDGER_POLICY=policy,
            KVCACHED_LEDGER_JOURNAL=str(journal),
            KVCACHED_LEDGER_SOCKET=str(root / f"{variant}.sock"),
            KVCACHED_DUMP_DIR=str(root / "dumps"),
            # 16 slots a page (1 KiB a slot in each of the 16 regions: 8 layers' K and V), so that
            # the 160-slot pool spans 11 pages and pages come and go with requests (at --page-size
            # 16, one SGLang page a kvcached page). MLA's latent is 1,152 B a slot and layer: 32
            # slots to the smallest host page of whole slots (36 KiB).
            KVCACHED_PAGE_SIZE_MB="0.03515625" if kind == "mla" else "0.015625",
            # No reserve (kvcached PR #598's reproduction settings): an emptied page goes.
            KVCACHED_MIN_RESERVED_PAGES="0",
            KVCACHED_MAX_RESERVED_PAGES="0",
        )
    model = models[kind if kind in models else "llama"]
    page_size = "16" if kind == "p16" else "1"
    done = subprocess.run(
        [sys.executable, "-m", "kvcached.sglang.testing.serve", str(model), "--page-size", page_size],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, f"{variant}: {done.stderr[-3000:]}"
    return [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")], journal


def test_native_sglang_loads_back_from_the_host_tier(served) -> None:
    lines, _ = served["native"]
    assert [x["name"] for x in lines] == ["A", "B", "C", "A", "B", "A", "A"]
    assert lines[3]["host"] > 0 and lines[4]["host"] > 0, "A and B came back from the host tier"
    assert lines[5]["device"] > 0
    assert lines[6]["cached"] == 0, "the flush emptied both tiers"


@pytest.mark.parametrize("policy", ["legacy", "ledger"])
def test_kvcached_serves_what_native_serves(served, policy) -> None:
    native, _ = served["native"]
    lines, _ = served[policy]
    assert lines == native


def _replayed(journal: Path) -> tuple[JournalContents, Ledger]:
    contents = read_journal(journal)
    ledger = Ledger(contents.header)
    ledger.apply_all(contents.events)
    return contents, ledger


def _served_as_native(served, kind: str) -> tuple[JournalContents, Ledger]:
    """The ledger-policy run of ``kind`` gave native SGLang's lines (A back from the host tier)
    and its journal replays clean, with pinned copies and pages that went back."""
    native, _ = served[f"native-{kind}"]
    lines, journal = served[f"ledger-{kind}"]
    assert lines == native and native[3]["host"] > 0, "A came back from the host tier"
    contents, ledger = _replayed(journal)
    assert ledger.violations == []
    assert ledger.jobs_built >= 4 and ledger.unmaps > 0
    return contents, ledger


def _distinct(served, kind: str) -> None:
    native, _ = served[f"native-{kind}"]
    assert len({tuple(x["output"]) for x in native}) >= 3, "a model that answers every prompt alike hides a wrong page"


def test_the_paged_allocator_serves_what_native_sglang_serves(served) -> None:
    contents, _ = _served_as_native(served, "p16")
    # A block is an SGLang page of 16 slots, a kvcached page of 16 KiB holds one: 10 and padding.
    assert contents.header.pools[0].num_blocks == 11


def test_an_mla_model_serves_on_kvcached_pages_as_native_sglang_does(served) -> None:
    _distinct(served, "mla")
    contents, _ = _served_as_native(served, "mla")
    pool = contents.header.pools[0]
    assert pool.block_bytes == 576 * 2 and pool.num_blocks == 161  # a slot: one bf16 latent of 576


def test_a_sliding_window_model_serves_on_kvcached_pages_as_native_sglang_does(served) -> None:
    _distinct(served, "swa")
    _served_as_native(served, "swa")


def test_the_ledger_journal_replays_clean_and_names_sglang(served) -> None:
    _, journal = served["ledger"]
    contents, ledger = _replayed(journal)
    assert "sglang" in contents.header.producer
    assert ledger.violations == []
    assert ledger.jobs_built >= 4, "the backups and the load-backs were pinned"
    assert ledger.builds > 10
    assert ledger.unmaps > 0, "pages went back as the tree evicted and the flush emptied them"


def test_kvctl_lists_and_limits_a_served_sglang_engine(tmp_path: Path) -> None:
    """The live socket of an SGLang engine: ``kvctl list`` names it, ``kvctl limit`` reaches its
    allocator through the scheduler's next step, ``kvctl status`` reports the limit, and the idle
    engine reaches it though its tree cache held the pages."""
    model = build(tmp_path / "tiny")
    site = cpu_platform.dist_info(str(tmp_path / "site"))
    runtime = tmp_path / "rt"
    runtime.mkdir()
    release = tmp_path / "release"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED", "SGLANG_"))}
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [site, env.get("PYTHONPATH")])),
        HF_HUB_OFFLINE="1",
        XDG_RUNTIME_DIR=str(runtime),
        ENABLE_KVCACHED="1",
        KVCACHED_BACKEND="host",
        KVCACHED_PAGE_SIZE_MB="0.015625",
        KVCACHED_MIN_RESERVED_PAGES="0",
        KVCACHED_MAX_RESERVED_PAGES="0",
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcached.sglang.testing.serve", str(model), "--hold", str(release)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        held = None
        for line in proc.stdout:
            if line.startswith('{"held"'):
                held = json.loads(line)["held"]
                break
        assert held is not None, "the engine ended before holding"

        def kvctl(*argv: str) -> object:
            done = subprocess.run(
                [sys.executable, "-m", "kvctl.cli", *argv, "--json"],
                capture_output=True,
                text=True,
                env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout)

        (listed,) = kvctl("list")
        status = listed["status"]
        assert status["engine"]["engine"] == f"SGLang {sglang_version()}" and status["engine"]["model"] == str(model)
        mapped = status["memory"]["mapped_pages"]
        page = status["memory"]["page_bytes"]
        assert mapped >= 2
        reply = kvctl("limit", str(status["pid"]), str(page), "--force")  # one page: the padding page's
        assert reply["limit_bytes"] == page
        after = kvctl("status")  # the one engine of this runtime directory
        assert after["memory"]["limit_pages"] == 1
        # Idle, its tree full of the load's prefixes: the limit evicts them (SGLang itself evicts
        # only when it needs slots), the pages empty and go at the following steps.
        deadline = time.monotonic() + 20
        while after["memory"]["shrink_pending"] and time.monotonic() < deadline:
            time.sleep(0.2)
            after = kvctl("status")
        assert not after["memory"]["shrink_pending"], after["memory"]
        assert after["memory"]["mapped_pages"] == 1, after["memory"]
    finally:
        release.touch()
        proc.wait(timeout=120)
