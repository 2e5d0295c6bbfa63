"""The page-aware pool's index of cached blocks (``CachedBlocks``) agrees with a plain
``OrderedDict`` under every operation the pool uses, and its per-page view is that order split
by page. (With ``move_to_end(last=False)`` leaving the page view alone, the restore path of a
failed ``get_new_blocks``, this fails within a few examples.)"""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached.vllm.engine_core.cached_blocks import CachedBlocks

OPS = st.lists(
    st.tuples(st.sampled_from(["set", "del", "pop", "popitem", "front", "back", "clear"]), st.integers(0, 11)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_cached_blocks_agree_with_an_ordered_dict(ops: list[tuple[str, int]]) -> None:
    page_of = lambda b: b // 4  # noqa: E731
    got, want = CachedBlocks(page_of), OrderedDict[int, None]()
    for op, b in ops:
        for d in (got, want):
            if op == "set":
                d[b] = None
            elif op == "del" and b in d:
                del d[b]
            elif op == "pop":
                d.pop(b, None)
            elif op == "popitem" and d:
                d.popitem(last=b % 2 == 0)
            elif op in ("front", "back") and b in d:
                d.move_to_end(b, last=op == "back")
            elif op == "clear" and b == 0:
                d.clear()
        assert list(got) == list(want)
        assert sorted(got, key=got.stamp.__getitem__) == list(want)
        split: dict[int, list[int]] = {}
        for x in want:
            split.setdefault(page_of(x), []).append(x)
        assert {p: list(bs) for p, bs in got.on_page.items()} == split
        for p, bs in split.items():
            assert got.newest(p) == got.stamp[bs[-1]]
