"""The reserve: empty pages an engine keeps mapped so that the next allocation maps nothing.

Upstream kvcached's ``KVCACHED_MIN_RESERVED_PAGES`` / ``KVCACHED_MAX_RESERVED_PAGES``, plus
``KVCACHED_MAX_RESERVED_BYTES`` here: a page is one page in every layer, region and replica, so
its cost grows with the model, and a byte bound keeps a large model's reserve from holding a
neighbour's share. The same bounds under every engine, from one function.
"""

from __future__ import annotations

from ..errors import ConfigError


def reserve_pages(min_pages: int, max_pages: int, max_bytes: int, page_cost: int) -> tuple[int, int]:
    """The reserve's bounds in pages, ``(low, high)``, where a page costs ``page_cost`` bytes and
    ``max_bytes`` (0: none) bounds the high mark; the low mark never exceeds the high one."""
    if min_pages < 0 or max_pages < 0 or max_bytes < 0:
        raise ConfigError(f"the reserve's bounds must be >= 0, got {min_pages}..{max_pages} pages, {max_bytes} B")
    hi = max_pages
    if max_bytes:
        hi = min(hi, max_bytes // page_cost)
    return min(min_pages, hi), hi
