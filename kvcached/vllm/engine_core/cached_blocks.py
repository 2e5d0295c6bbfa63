"""The page-aware pool's evictable blocks: vLLM's LRU order, indexed by page.

A module of its own because it stays interpreted when ``block_pool`` is compiled: mypyc makes a
native class of a subclass of ``OrderedDict``, and its garbage-collector traversal of the
dict crashed the interpreter (a segfault in ``odict_traverse`` under
``block_pool___CachedBlocks_traverse``; mypyc of mypy 2.4.1, CPython 3.11). Interpreted, it is the
C ``OrderedDict`` with a few Python methods on top, which is all it needs to be.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any


class CachedBlocks(OrderedDict[int, None]):
    """The evictable blocks in vLLM's LRU order (oldest first), indexed by page, so that eviction
    by page ranks the pages holding cached blocks, not every cached block (a cap of 16,000
    tokens is 1,000 blocks, ranked on every free past the cap). ``stamp`` orders blocks as the
    dict does; ``on_page`` holds each page's cached blocks in that order."""

    def __init__(self, page_of: Callable[[int], int]) -> None:
        super().__init__()
        self._page_of = page_of
        self.stamp: dict[int, int] = {}
        self.on_page: dict[int, dict[int, None]] = {}
        self._hi = self._lo = 0

    def __setitem__(self, b: int, v: None) -> None:
        if b in self:  # as OrderedDict: setting a present key keeps its place
            return
        super().__setitem__(b, v)
        self._hi += 1
        self.stamp[b] = self._hi
        self.on_page.setdefault(self._page_of(b), {})[b] = None

    def _forget(self, b: int) -> None:
        del self.stamp[b]
        p = self._page_of(b)
        blocks = self.on_page[p]
        del blocks[b]
        if not blocks:
            del self.on_page[p]

    def __delitem__(self, b: int) -> None:
        super().__delitem__(b)
        self._forget(b)

    def pop(self, b: int, *default: Any) -> Any:
        if b in self:
            super().pop(b)
            self._forget(b)
            return None
        if default:
            return default[0]
        raise KeyError(b)

    def popitem(self, last: bool = True) -> tuple[int, None]:
        b = super().popitem(last)[0]
        self._forget(b)
        return b, None

    def clear(self) -> None:
        super().clear()
        self.stamp.clear()
        self.on_page.clear()

    def move_to_end(self, b: int, last: bool = True) -> None:
        super().move_to_end(b, last)
        p = self._page_of(b)
        del self.on_page[p][b]
        if last:
            self._hi += 1
            self.stamp[b] = self._hi
            self.on_page[p][b] = None
        else:
            self._lo -= 1
            self.stamp[b] = self._lo
            self.on_page[p] = {b: None, **self.on_page[p]}

    def newest(self, page: int) -> int:
        """The stamp of the most recently used cached block of ``page``."""
        return self.stamp[next(reversed(self.on_page[page]))]
