"""The plugin through SGLang's own loader: ``load_plugins`` finds kvcached's entry point and,
with ``ENABLE_KVCACHED=1``, SGLang's pool builder gets kvcached's pages and allocator."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent(
    """
    import warnings; warnings.filterwarnings("ignore")
    import torch
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.mem_cache.allocator import paged, token
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from kvcached.sglang.engine import engine_of
    pool = MHATokenToKVPool(size=255, page_size=PAGE_SIZE, dtype=torch.float32, head_num=2, head_dim=8,
                            layer_num=2, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    if PAGE_SIZE == 1:
        alloc = token.TokenToKVPoolAllocator(255, torch.float32, "cpu", pool, need_sort=False)
    else:
        alloc = paged.PagedTokenToKVPoolAllocator(255, PAGE_SIZE, torch.float32, "cpu", pool, need_sort=False)
    engine = engine_of(pool)
    print(type(alloc).__name__, engine is not None and engine.backend.kind,
          engine is not None and engine.ledger.header.policy.value)
    """
)


def _probe(env: dict[str, str], page_size: int = 1) -> subprocess.CompletedProcess[str]:
    code = PROBE.replace("PAGE_SIZE", str(page_size))
    full = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))}
    full.update({"KVCACHED_PAGE_SIZE_MB": "", **env})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300)


def test_enabled_the_pool_and_allocator_are_kvcached() -> None:
    done = _probe({"ENABLE_KVCACHED": "1", "KVCACHED_BACKEND": "host", "KVCACHED_LEDGER_POLICY": "legacy"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["KvcachedTokenAllocator", "host", "legacy"]


def test_off_sglang_runs_as_shipped() -> None:
    done = _probe({})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["TokenToKVPoolAllocator", "False", "False"]


def test_enabled_at_a_page_size_above_one_the_paged_allocator_is_kvcached() -> None:
    done = _probe({"ENABLE_KVCACHED": "1", "KVCACHED_BACKEND": "host"}, page_size=16)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["KvcachedPagedAllocator", "host", "ledger"]


def test_a_bad_setting_or_page_size_is_refused_in_one_line() -> None:
    bad = _probe({"ENABLE_KVCACHED": "1", "KVCACHED_LEDGER_POLICY": "sometimes"})
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1].startswith("[kvcached] refused: KVCACHED_LEDGER_POLICY")
    assert "Traceback" not in bad.stderr
    # SGLang pages of 3 slots (192 bytes a region) do not tile a 2 MiB page.
    odd = _probe({"ENABLE_KVCACHED": "1", "KVCACHED_BACKEND": "host", "KVCACHED_PAGE_SIZE_MB": "2"}, page_size=3)
    assert odd.returncode != 0
    last = odd.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "[kvcached] refused: kvcached under SGLang: a KV block (3 token(s) x 2 heads x 8 x torch.float32) takes "
        "192 B, which does not "
        "divide the 2 MiB page KVCACHED_PAGE_SIZE_MB sets; set KVCACHED_PAGE_SIZE_MB=2.00390625 or 1.9921875"
    ), last
    assert "Traceback" not in odd.stderr


HYBRID = textwrap.dedent(
    """
    import warnings; warnings.filterwarnings("ignore")
    import torch
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    SWAKVPool(size=256, size_swa=128, page_size=1, dtype=torch.float32, head_num=2, head_dim=8,
              swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    print("built")
    """
)


def test_a_hybrid_models_second_pool_is_refused_in_one_line(tmp_path) -> None:
    """SWAKVPool (sliding-window hybrids) builds two MHA pools in one scheduler process: kvcached
    takes one pool a process (its journal, its socket, its steps), so the second is refused, not
    put on a second engine that nothing steps."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED"))}
    full.update(ENABLE_KVCACHED="1", KVCACHED_BACKEND="host", XDG_RUNTIME_DIR=str(tmp_path))  # the first's socket
    done = subprocess.run([sys.executable, "-c", HYBRID], capture_output=True, text=True, env=full, timeout=300)
    assert done.returncode != 0 and "built" not in done.stdout
    assert done.stderr.strip().splitlines()[-1] == (
        "[kvcached] refused: kvcached under SGLang: this model builds a second KV pool (MHATokenToKVPool beside "
        "MHATokenToKVPool: a "
        "sliding-window, hybrid or draft model), which kvcached does not support yet; disable kvcached "
        "(ENABLE_KVCACHED=0) for this model"
    ), done.stderr[-2000:]
    assert "Traceback" not in done.stderr
