"""The page-aware pool's evictable blocks: vLLM's LRU order, indexed by page.

Compiled with the pool (``kvcached.ledger.compiled.COMPILED_MODULES``): every block that joins
the prefix cache goes through ``__setitem__`` (about 270 a step on benchmarks/bench_bridge.py's
prefill mix), which interpreted, as an ``OrderedDict`` subclass with a Python ``__setitem__``,
cost about 6,600 instructions a block. It holds its ``OrderedDict`` instead of being one: mypyc
makes a native class of an ``OrderedDict`` subclass, and its garbage-collector traversal of the
dict crashed the interpreter (a segfault in ``odict_traverse`` under
``block_pool___CachedBlocks_traverse``; mypyc of mypy 2.4.1, CPython 3.11). The mapping methods
the pool uses keep ``OrderedDict``'s meaning (``tests/test_cached_blocks.py`` checks them
against one).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any


class CachedBlocks:
    """The evictable blocks in vLLM's LRU order (oldest first), indexed by page, so that eviction
    by page ranks the pages holding cached blocks, not every cached block (a cap of 16,000
    tokens is 1,000 blocks, ranked on every free past the cap). ``stamp`` is the order itself:
    its keys are the blocks, oldest first, and its values increase along it (a block moved to
    the front gets a stamp below all others); ``on_page`` holds each page's cached blocks in
    that order."""

    def __init__(self, page_of: Callable[[int], int]) -> None:
        self._page_of = page_of
        self.stamp: OrderedDict[int, int] = OrderedDict()
        self.on_page: dict[int, dict[int, None]] = {}
        self._hi = 0
        self._lo = 0

    # --- the mapping, as OrderedDict[int, None] ---------------------------------------------

    def __len__(self) -> int:
        return len(self.stamp)

    def __bool__(self) -> bool:
        return len(self.stamp) > 0

    def __contains__(self, b: object) -> bool:
        return b in self.stamp

    def __iter__(self) -> Iterator[int]:
        return iter(self.stamp)

    def __setitem__(self, b: int, v: None) -> None:
        self.add(b)

    def __delitem__(self, b: int) -> None:
        del self.stamp[b]
        self._forget(b)

    def add(self, b: int) -> None:
        """``self[b] = None``: a block already present keeps its place, as in an OrderedDict."""
        stamp = self.stamp
        if b in stamp:
            return
        self._hi += 1
        stamp[b] = self._hi
        p = self._page_of(b)
        blocks = self.on_page.get(p)
        if blocks is None:
            self.on_page[p] = {b: None}
        else:
            blocks[b] = None

    def _forget(self, b: int) -> None:
        p = self._page_of(b)
        blocks = self.on_page[p]
        del blocks[b]
        if not blocks:
            del self.on_page[p]

    def pop(self, b: int, *default: Any) -> Any:
        if b in self.stamp:
            del self.stamp[b]
            self._forget(b)
            return None
        if default:
            return default[0]
        raise KeyError(b)

    def popitem(self, last: bool = True) -> tuple[int, None]:
        b = self.stamp.popitem(last)[0]
        self._forget(b)
        return b, None

    def clear(self) -> None:
        self.stamp.clear()
        self.on_page.clear()

    def move_to_end(self, b: int, last: bool = True) -> None:
        stamp = self.stamp
        stamp.move_to_end(b, last)
        p = self._page_of(b)
        del self.on_page[p][b]
        if last:
            self._hi += 1
            stamp[b] = self._hi
            self.on_page[p][b] = None
        else:
            self._lo -= 1
            stamp[b] = self._lo
            self.on_page[p] = {b: None, **self.on_page[p]}

    def newest(self, page: int) -> int:
        """The stamp of the most recently used cached block of ``page``."""
        return self.stamp[next(reversed(self.on_page[page]))]
