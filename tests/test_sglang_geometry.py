"""The geometry kvcached gives an SGLang KV pool, from the pool's own fields (no SGLang needed).

MHA pools have a region per layer's K and V; MLA pools (DeepSeek) a region per layer's latent,
576 bf16 values a token, which no power-of-two page holds whole: unset, kvcached chooses a page of
whole slots near the default (``page_size.choose_page``); set, a page that does not tile is
refused in one line that names pages which do.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcached.errors import ConfigError
from kvcached.kv_cache_manager import Layout
from kvcached.sglang.engine import is_mla, pool_geometry

torch = pytest.importorskip("torch")  # the pools' dtypes (the wheel's own test run has no torch)

MiB = 1 << 20


def _mla(page_size: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        size=4096, page_size=page_size, layer_num=27, kv_lora_rank=512, qk_rope_head_dim=64, kv_cache_dim=576,
        store_dtype=torch.bfloat16, use_dsa=False,
    )  # fmt: skip


def _mha(page_size: int = 1) -> SimpleNamespace:
    return SimpleNamespace(
        size=4096, page_size=page_size, layer_num=24, head_num=2, head_dim=64, v_head_dim=64,
        store_dtype=torch.bfloat16, kv_cache_layout="nhd",
    )  # fmt: skip


def test_an_mha_pool_has_a_region_per_layers_k_and_v() -> None:
    g = pool_geometry(_mha(), 2 * MiB)
    assert not is_mla(_mha())
    assert (g.num_layers, g.block_bytes, g.num_blocks, g.layout) == (48, 256, 4097, Layout.PER_LAYER)
    paged = pool_geometry(_mha(page_size=16), 2 * MiB)
    assert (paged.block_bytes, paged.num_blocks) == (16 * 256, 4096 // 16 + 1)


def test_an_mla_pool_has_a_region_per_layers_latent_on_a_page_kvcached_chooses() -> None:
    assert is_mla(_mla())
    host = pool_geometry(_mla(), 2 * MiB, backend="host", page_set=False)
    assert (host.num_layers, host.block_bytes) == (27, 1152)
    assert host.page_bytes == 56 * 36864  # 1.96875 MiB: the largest multiple of lcm(1152, 4 KiB) in 2 MiB
    cuda = pool_geometry(_mla(), 2 * MiB, backend="cuda", page_set=False)
    assert cuda.page_bytes == 18 * MiB  # lcm(1152, the 2 MiB granule)


def test_a_page_that_does_not_tile_an_mla_block_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as e:
        pool_geometry(_mla(), 2 * MiB, backend="cuda", page_set=True)
    said = str(e.value)
    assert "\n" not in said
    assert said.startswith(
        "kvcached under SGLang: a KV block (1 token(s) x 576 x torch.bfloat16) takes 1152 B, which does not divide "
        "the 2 MiB page KVCACHED_PAGE_SIZE_MB sets; set KVCACHED_PAGE_SIZE_MB=18"
    ), said


def test_deepseek_sparse_attention_pools_are_refused() -> None:
    dsa = SimpleNamespace(**{**vars(_mla()), "use_dsa": True})
    with pytest.raises(ConfigError, match="DeepSeek sparse attention"):
        pool_geometry(dsa, 2 * MiB)
