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
    that order (built when first asked for)."""

    def __init__(self, page_of: Callable[[int], int], num_blocks: int = 0) -> None:
        # Called with and returning objects (see ``add``): typed ``int``, mypyc would unbox both.
        self._page_of: Callable[[Any], Any] = page_of
        # ``page_of`` of blocks 0 .. num_blocks - 1, asked once (a block's page never changes):
        # a list read instead of a generic call of the manager's method (~700 instructions) for
        # every block that joins or leaves the cache. Each page is one int object.
        same: dict[Any, Any] = {}
        self._pages: list[Any] = [same.setdefault(p, p) for p in map(page_of, range(num_blocks))]
        self.stamp: OrderedDict[int, int] = OrderedDict()
        self._on_page: dict[int, dict[int, None]] = {}
        self._indexed = False  # ``_on_page`` is built and kept once asked for (``on_page``)
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

    def add(self, b: Any) -> None:
        """``self[b] = None``: a block already present keeps its place, as in an OrderedDict."""
        # Every block that joins the prefix cache comes here: ``b`` and its page stay the objects
        # the caller and ``page_of`` gave (typed ``int``, each use as a key was a new int object,
        # six a block) and the stamp is boxed once.
        stamp = self.stamp
        if b in stamp:
            return
        hi = self._hi + 1
        self._hi = hi
        stamp[b] = hi
        if self._indexed:
            self._index(b)

    def _index(self, b: Any) -> None:
        p = self._page(b)
        on_page: dict[Any, Any] = self._on_page
        blocks = on_page.get(p)
        if blocks is None:
            on_page[p] = {b: None}
        else:
            blocks[b] = None

    @property
    def on_page(self) -> dict[int, dict[int, None]]:
        """Each page's cached blocks, in the LRU order (read only). Built from ``stamp`` when first
        asked for (eviction by page: a cache cap, a shrink) and kept from then on: a pool that
        never evicts by page keeps no index, whose upkeep was a third of what a block joining
        the cache cost (a dict insertion that often resizes, ~700 instructions)."""
        if not self._indexed:
            self._indexed = True
            self._on_page = {}
            for b in self.stamp:
                self._index(b)
        return self._on_page

    def _page(self, b: Any) -> Any:
        i: int = b
        pages = self._pages
        if 0 <= i < len(pages):
            return pages[i]
        return self._page_of(b)

    def _forget(self, b: Any) -> None:
        if not self._indexed:
            return
        p = self._page(b)
        on_page: dict[Any, Any] = self._on_page
        blocks = on_page[p]
        del blocks[b]
        if not blocks:
            del on_page[p]

    def discard(self, b: Any) -> None:
        """``self.pop(b, None)``, without the tuple a call with ``*default`` makes."""
        if b in self.stamp:
            del self.stamp[b]
            self._forget(b)

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
        self._on_page.clear()

    def move_to_end(self, b: int, last: bool = True) -> None:
        stamp = self.stamp
        stamp.move_to_end(b, last)
        if last:
            self._hi += 1
            stamp[b] = self._hi
        else:
            self._lo -= 1
            stamp[b] = self._lo
        if not self._indexed:
            return
        on_page = self._on_page
        p = self._page(b)
        del on_page[p][b]
        if last:
            on_page[p][b] = None
        else:
            on_page[p] = {b: None, **on_page[p]}

    def newest(self, page: int) -> int:
        """The stamp of the most recently used cached block of ``page``."""
        return self.stamp[next(reversed(self.on_page[page]))]
