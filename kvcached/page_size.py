"""The page kvcached maps and unmaps: chosen for the model's KV block when the user did not choose.

vLLM lays a region's blocks end to end (block ``b`` at ``b * block_bytes``), so a page can hold
only whole blocks when its size is a multiple of the block: otherwise a block would straddle two
pages and one of them could go while the block is live (``kv_layout.plan``). A page must also be
what the backend can map (``granularity``). Pages of whole blocks on a backend are therefore the
multiples of ``lcm(block, granularity)``. ``choose_page`` takes the user's page or picks one
(``_auto``), and otherwise refuses with a page that would fit.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from fractions import Fraction
from typing import Final

import msgspec

from .errors import ConfigError
from .settings import MAX_PAGE_MIB

MiB: Final = 1 << 20
DEFAULT_PAGE_BYTES: Final = 2 * MiB  # KVCACHED_PAGE_SIZE_MB's default (settings.PAGE_SIZE)
CUDA_GRANULARITY: Final = 2 * MiB  # cuMemGetAllocationGranularity's minimum on every GPU we serve
MAX_PAGE_BYTES: Final = MAX_PAGE_MIB * MiB  # the largest page KVCACHED_PAGE_SIZE_MB may set
# The largest page kvcached picks unasked: 32 times the default (32 CUDA granules). A page is the
# unit in which KV memory returns: it goes only once every block on it is free, and the reserve
# (KVCACHED_MIN/MAX_RESERVED_PAGES, 5 to 10 pages, in every layer's region) holds whole pages.
# At 64 MiB a page holds more KV than most requests use, the reserve is up to 640 MiB a region,
# and elasticity is already coarse; beyond it the user should choose (the refusal says what fits).
# It covers every block whose odd factor is at most 31 on CUDA (MLA's 576 = 64 x 9 included).
AUTO_MAX_PAGE_BYTES: Final = 64 * MiB


def granularity(backend: str) -> int:
    """The unit a page of ``backend`` ("host" or "cuda") must be a multiple of.

    NOTE: a page must be what the backend can map: a multiple of the OS page on the host backend
    (``mmap.PAGESIZE``, 4 KiB on x86), of the allocation granularity on CUDA (2 MiB; the CUDA
    backend checks the real device's when it is created)."""
    return mmap.PAGESIZE if backend == "host" else CUDA_GRANULARITY


def mib(n: int) -> str:
    """``n`` bytes in MiB, written exactly (``1.03515625``, ``18``): what ``KVCACHED_PAGE_SIZE_MB``
    reads back as exactly ``n``. The denominator is a power of two, 2**k, so the decimal has k places."""
    f = Fraction(n, MiB)
    k = f.denominator.bit_length() - 1
    digits = str(f.numerator * 5**k).rjust(k + 1, "0")
    return f"{digits[:-k]}.{digits[-k:]}" if k else digits


class PageChoice(msgspec.Struct, frozen=True, kw_only=True):
    """The page a KV layout uses, and what it costs against the default."""

    page_bytes: int
    block_bytes: int
    backend: str  # "host" or "cuda"
    default_bytes: int  # the page the user set, or the default when they did not
    chosen: bool  # kvcached chose a page other than the default (the setting was unset)

    @property
    def blocks_per_page(self) -> int:
        return self.page_bytes // self.block_bytes

    @property
    def unused_bytes(self) -> int:
        """Bytes of each page that hold no block (0 for every page ``choose_page`` returns,
        since the page is a multiple of the block; kept so the log line says so)."""
        return self.page_bytes % self.block_bytes

    @property
    def vs_default(self) -> Fraction:
        """How many default pages one page is."""
        return Fraction(self.page_bytes, self.default_bytes)

    def describe(self) -> str:
        """The log line's text when kvcached chose: what, why, and what it costs."""
        n = self.blocks_per_page
        cost = f"{n} block{'s' if n != 1 else ''} each, {self.unused_bytes} B unused per page"
        if self.vs_default > 1:
            cost += f", {_ratio(self.vs_default)} times the default"
        return (
            f"page size: a KV block takes {self.block_bytes} B, which does not divide the default "
            f"{mib(self.default_bytes)} MiB page; chose {mib(self.page_bytes)} MiB pages ({cost}) for the "
            f"{self.backend} backend (set KVCACHED_PAGE_SIZE_MB to choose)"
        )


def choose_page(
    block_bytes: int,
    *,
    backend: str,
    page_bytes: int = DEFAULT_PAGE_BYTES,
    page_set: bool = False,
    unit: int | None = None,
    tokens: int | None = None,
) -> PageChoice:
    """The page for blocks of ``block_bytes`` on ``backend``, or a one-line ``ConfigError`` that
    names a page which fits. ``page_bytes`` is the user's page if ``page_set``, else the default;
    ``unit`` overrides the backend's granularity; ``tokens`` is the block's size in tokens when
    its bytes scale with it (attention), for a ``--block-size`` hint, and None where they do not
    (a Mamba state).

    A page the user set is taken as it is, or refused with pages that would fit this backend
    (the nearest multiples of ``lcm(block, granularity)`` around it) and a ``--block-size`` only
    where a smaller block divides their page (``_set_refusal``). A page the user did not set is
    chosen by ``_auto``.

    NOTE: ``choose_page`` is pure and reads nothing: the engine core and every worker call it
    (through ``kv_layout.plan``) with the same inputs, so they agree on the page."""
    if block_bytes < 1 or page_bytes < 1:
        raise ConfigError(f"kvcached: a KV block of {block_bytes} B or a page of {page_bytes} B is no layout")
    g = unit or granularity(backend)
    fit = math.lcm(block_bytes, g)
    if page_set:
        if page_bytes % block_bytes == 0:
            return PageChoice(
                page_bytes=page_bytes, block_bytes=block_bytes, backend=backend, default_bytes=page_bytes, chosen=False
            )
        raise ConfigError(_set_refusal(block_bytes, page_bytes, fit, backend, g, tokens))
    page = _auto(block_bytes, g, page_bytes)
    if page is None:
        raise ConfigError(_auto_refusal(block_bytes, page_bytes, fit, backend, g, tokens))
    return PageChoice(
        page_bytes=page, block_bytes=block_bytes, backend=backend, default_bytes=page_bytes, chosen=page != page_bytes
    )


def _auto(block_bytes: int, g: int, default: int) -> int | None:
    """The page kvcached chooses when the user did not set one; None: it refuses.

    NOTE: the default page (``KVCACHED_PAGE_SIZE_MB``, 2 MiB, upstream kvcached's) fits every
    power-of-two block up to 2 MiB. It does not fit MLA's 576-wide latent (18432 B per 16
    tokens), a Mamba2 state (e.g. 1085440 B) or a block above 2 MiB. So kvcached chooses, in
    this order:

    1. The largest multiple of ``lcm(block, granularity)`` that is at most the default page (the
       default itself when the block divides it). That is a page near 2 MiB, so memory comes and
       goes in the steps the user would have got. On the host backend this serves almost every
       block (18432 B gives 56 blocks of a 1.96875 MiB page, a Mamba2 state of 1085440 B one of
       a 1.03515625 MiB page).
    2. Else ``lcm(block, granularity)`` itself, if it is at most ``AUTO_MAX_PAGE_BYTES`` (the
       CUDA backend's 18 MiB for MLA).
    3. Else nothing: kvcached refuses with the page that would fit, which the user may set."""
    fit = math.lcm(block_bytes, g)
    if fit <= default:
        return default // fit * fit
    return fit if fit <= AUTO_MAX_PAGE_BYTES else None


def _smaller_block(block_bytes: int, tokens: int | None, fits: Callable[[int], bool]) -> int | None:
    """The largest smaller ``--block-size`` (halvings of ``tokens``) whose block ``fits``; None if none."""
    if not tokens:
        return None
    n, b = tokens, block_bytes
    while n % 2 == 0 and b % 2 == 0:
        n, b = n // 2, b // 2
        if fits(b):
            return n
    return None


def _set_refusal(block: int, page: int, fit: int, backend: str, g: int, tokens: int | None) -> str:
    up = -(-page // fit) * fit
    down = page // fit * fit
    pages = [mib(p) for p in (up, down) if 0 < p <= MAX_PAGE_BYTES]
    what = (
        f"set KVCACHED_PAGE_SIZE_MB={' or '.join(pages)} (multiples of {mib(fit)} MiB hold whole blocks on the "
        f"{backend} backend)"
        if pages
        else f"no page up to {MAX_PAGE_MIB} MiB holds whole blocks on the {backend} backend"
    )
    n = _smaller_block(block, tokens, lambda b: page % b == 0)
    if n is not None:
        what += f", or --block-size {n}"
    if _auto(block, g, DEFAULT_PAGE_BYTES) is not None:
        what += ", or unset it to let kvcached choose"
    elif not pages and n is None:
        what += "; disable kvcached (ENABLE_KVCACHED=0)"
    return (
        f"kvcached: a KV block takes {block} B, which does not divide the {mib(page)} MiB page "
        f"KVCACHED_PAGE_SIZE_MB sets; {what}"
    )


def _auto_refusal(block: int, default: int, fit: int, backend: str, g: int, tokens: int | None) -> str:
    n = _smaller_block(block, tokens, lambda b: _auto(b, g, default) is not None)
    smaller = f"--block-size {n}" if n is not None else ""
    head = (
        f"kvcached: a KV block takes {block} B, which does not divide the default {mib(default)} MiB page, and the "
        f"smallest page of whole blocks on the {backend} backend is {mib(fit)} MiB"
    )
    if fit <= MAX_PAGE_BYTES:
        alt = f", or {smaller}" if smaller else ""
        return (
            f"{head}, more than the {mib(AUTO_MAX_PAGE_BYTES)} MiB kvcached chooses by itself (memory would come and "
            f"go in {mib(fit)} MiB steps); set KVCACHED_PAGE_SIZE_MB={mib(fit)} to accept that{alt}"
        )
    remedy = f"set {smaller}" if smaller else "disable kvcached (ENABLE_KVCACHED=0)"
    return f"{head}, more than a page may be ({MAX_PAGE_MIB} MiB); {remedy}"


def _ratio(r: Fraction) -> str:
    return str(r.numerator) if r.denominator == 1 else f"{float(r):.3g}"
