"""The page kvcached chooses for a KV block when KVCACHED_PAGE_SIZE_MB is unset, and the hints it
gives when a page the user set does not fit (kvcached/page_size.py), so that it just works at
default settings. The blocks are the kinds vLLM's CPU build served: MLA's 576-wide latent
(18432 B per 16 tokens, 147456 B per 128), a Mamba2 state (1085440 B), power-of-two attention."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from kvcached.errors import ConfigError
from kvcached.page_size import (
    AUTO_MAX_PAGE_BYTES,
    CUDA_GRANULARITY,
    DEFAULT_PAGE_BYTES,
    MAX_PAGE_BYTES,
    PageChoice,
    choose_page,
    mib,
)
from kvcached.settings import Settings

MiB = 1 << 20
HOST = "host"
CUDA = "cuda"
MAMBA2 = 1085440  # 265 OS pages: 1.03515625 MiB


def pick(block: int, backend: str, **kw: Any) -> PageChoice:
    """``choose_page`` with the x86 OS page as the host's unit, whatever this machine's is."""
    return choose_page(block, backend=backend, unit=4096 if backend == HOST else None, **kw)


def test_the_default_page_is_the_settings_default() -> None:
    assert Settings().page_bytes == DEFAULT_PAGE_BYTES == CUDA_GRANULARITY
    assert Settings().page_bytes_set is False


@pytest.mark.parametrize("block", [4096, 16384, 65536, 2 * MiB])
@pytest.mark.parametrize("backend", [HOST, CUDA])
def test_a_power_of_two_block_keeps_the_default(block: int, backend: str) -> None:
    c = pick(block, backend)
    assert c.page_bytes == DEFAULT_PAGE_BYTES and not c.chosen
    assert c.blocks_per_page == DEFAULT_PAGE_BYTES // block and c.unused_bytes == 0


def test_mamba2_state_on_host_gets_a_page_of_one_state() -> None:
    c = pick(MAMBA2, HOST)
    assert c.chosen and c.page_bytes == MAMBA2 and mib(c.page_bytes) == "1.03515625"
    assert (c.blocks_per_page, c.unused_bytes) == (1, 0)
    assert c.describe() == (
        "page size: a KV block takes 1085440 B, which does not divide the default 2 MiB page; chose "
        "1.03515625 MiB pages (1 block each, 0 B unused per page) for the host backend "
        "(set KVCACHED_PAGE_SIZE_MB to choose)"
    )


@pytest.mark.parametrize(("block", "per_page"), [(18432, 112), (147456, 14)])
def test_mla_on_host_gets_the_largest_page_of_whole_blocks_below_the_default(block: int, per_page: int) -> None:
    # lcm(18432, 4 KiB) = 36 KiB; 56 of them (1.96875 MiB) are the most within 2 MiB.
    c = pick(block, HOST)
    assert c.chosen and c.page_bytes == 2064384 and mib(c.page_bytes) == "1.96875"
    assert c.page_bytes % block == 0 and c.page_bytes % 4096 == 0 and c.page_bytes <= DEFAULT_PAGE_BYTES
    assert (c.blocks_per_page, c.unused_bytes) == (per_page, 0)
    assert c.vs_default < 1 and "times the default" not in c.describe()


@pytest.mark.parametrize(("block", "per_page"), [(18432, 1024), (147456, 128)])
def test_mla_on_cuda_gets_lcm_with_the_granule(block: int, per_page: int) -> None:
    c = pick(block, CUDA)
    assert c.chosen and c.page_bytes == 18 * MiB and c.blocks_per_page == per_page
    assert c.vs_default == 9
    assert f"chose 18 MiB pages ({per_page} blocks each, 0 B unused per page, 9 times the default) for the cuda" in (
        c.describe()
    )


@pytest.mark.parametrize("backend", [HOST, CUDA])
def test_a_block_larger_than_the_default_gets_a_page_of_whole_blocks(backend: str) -> None:
    c = pick(4 * MiB, backend)
    assert c.chosen and c.page_bytes == 4 * MiB and c.blocks_per_page == 1 and c.vs_default == 2
    c = pick(3 * MiB, backend)
    assert c.page_bytes == (3 if backend is HOST else 6) * MiB


def test_beyond_the_bound_kvcached_refuses_with_the_page_that_fits() -> None:
    # On CUDA a Mamba2 state needs lcm(1085440, 2 MiB) = 530 MiB pages: more than kvcached picks.
    with pytest.raises(ConfigError) as e:
        pick(MAMBA2, CUDA)
    msg = str(e.value)
    assert "\n" not in msg
    assert "smallest page of whole blocks on the cuda backend is 530 MiB" in msg
    assert msg.endswith("set KVCACHED_PAGE_SIZE_MB=530 to accept that")  # no --block-size: a state does not scale
    assert pick(MAMBA2, CUDA, page_bytes=530 * MiB, page_set=True).page_bytes == 530 * MiB
    # Just within the bound it is chosen; just beyond, refused.
    assert pick(AUTO_MAX_PAGE_BYTES, CUDA).page_bytes == AUTO_MAX_PAGE_BYTES
    with pytest.raises(ConfigError, match=r"KVCACHED_PAGE_SIZE_MB=66 to accept that$"):  # 33 MiB needs 66 too
        pick(66 * MiB, CUDA, tokens=16)
    with pytest.raises(ConfigError, match=r"KVCACHED_PAGE_SIZE_MB=128 to accept that, or --block-size 8$"):
        pick(128 * MiB, CUDA, tokens=16)
    # Beyond the largest page there is: only a smaller block, or nothing.
    with pytest.raises(ConfigError, match=r"more than a page may be \(1024 MiB\); disable kvcached"):
        pick(MAX_PAGE_BYTES + 2 * MiB, CUDA)


def test_a_page_the_user_set_is_kept_when_the_block_divides_it() -> None:
    c = pick(18432, HOST, page_bytes=18 * MiB, page_set=True)
    assert c.page_bytes == 18 * MiB and not c.chosen
    c = pick(65536, CUDA, page_bytes=4 * MiB, page_set=True)
    assert c.page_bytes == 4 * MiB and not c.chosen


@pytest.mark.parametrize(
    ("block", "page", "backend", "tail"),
    [
        (
            MAMBA2,
            2 * MiB,
            HOST,
            "set KVCACHED_PAGE_SIZE_MB=2.0703125 or 1.03515625 (multiples of 1.03515625 MiB hold whole blocks on "
            "the host backend), or unset it to let kvcached choose",
        ),
        (
            MAMBA2,
            2 * MiB,
            CUDA,
            "set KVCACHED_PAGE_SIZE_MB=530 (multiples of 530 MiB hold whole blocks on the cuda backend)",
        ),
        (
            18432,
            2 * MiB,
            HOST,
            "set KVCACHED_PAGE_SIZE_MB=2.00390625 or 1.96875 (multiples of 0.03515625 MiB hold whole blocks on the "
            "host backend), or unset it to let kvcached choose",
        ),
        (
            18432,
            2 * MiB,
            CUDA,
            "set KVCACHED_PAGE_SIZE_MB=18 (multiples of 18 MiB hold whole blocks on the cuda backend), "
            "or unset it to let kvcached choose",
        ),
        (
            73728,
            20 * MiB,
            CUDA,
            "set KVCACHED_PAGE_SIZE_MB=36 or 18 (multiples of 18 MiB hold whole blocks on the cuda backend), "
            "or unset it to let kvcached choose",
        ),
        (  # a smaller block helps a power-of-two block that is larger than the page
            4 * MiB,
            2 * MiB,
            CUDA,
            "set KVCACHED_PAGE_SIZE_MB=4 (multiples of 4 MiB hold whole blocks on the cuda backend), "
            "or --block-size 8, or unset it to let kvcached choose",
        ),
    ],
)
def test_a_page_the_user_set_that_does_not_fit_is_refused_with_pages_true_for_the_backend(
    block: int, page: int, backend: str, tail: str
) -> None:
    tokens = 16 if block != MAMBA2 else None
    with pytest.raises(ConfigError) as e:
        pick(block, backend, page_bytes=page, page_set=True, tokens=tokens)
    msg = str(e.value)
    assert msg == (
        f"kvcached: a KV block takes {block} B, which does not divide the {mib(page)} MiB page KVCACHED_PAGE_SIZE_MB "
        f"sets; {tail}"
    )
    # Every page the hint names is read back exactly by the setting and holds whole blocks there.
    unit = 4096 if backend is HOST else CUDA_GRANULARITY
    named = msg.split("KVCACHED_PAGE_SIZE_MB=", 1)[1].split(" (", 1)[0].split(" or ")
    for text in named:
        s = Settings.from_env({"KVCACHED_PAGE_SIZE_MB": text})
        assert s.page_bytes_set and s.page_bytes % block == 0 and s.page_bytes % unit == 0, text
        assert pick(block, backend, page_bytes=s.page_bytes, page_set=True).page_bytes == s.page_bytes


def test_no_block_size_hint_where_a_smaller_block_cannot_divide_the_page() -> None:
    # 18432 = 2**11 * 9: halving the block never removes the 9, so no --block-size helps.
    with pytest.raises(ConfigError) as e:
        pick(18432, CUDA, page_bytes=2 * MiB, page_set=True, tokens=16)
    assert "--block-size" not in str(e.value)


def test_mib_is_exact() -> None:
    assert [mib(n) for n in (2 * MiB, 18 * MiB, 4096, 147456, MAMBA2, 10 * MiB)] == [
        "2",
        "18",
        "0.00390625",
        "0.140625",
        "1.03515625",
        "10",
    ]
    for n in (4096, MAMBA2, 2064384, 1 << 40):
        assert Fraction(mib(n)) * MiB == n
