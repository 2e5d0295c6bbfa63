"""The invariants written next to the allocator's and the manager's fields hold after any moves.

``PageAllocator`` keeps a page in exactly one of ``_free``, ``_reserved`` and ``_in_use``, with
``_goable`` within ``_reserved``; ``KVCacheManager`` keeps per-page counts and free lists whose
sum ``_partial_free`` is what ``available_size`` and ``alloc`` trust. Random sequences of the
public calls (alloc, take, free, emptying a page, build boundaries, limits, under both policies
and every placement rule, with reserves and short last pages) must keep every one; the checker is shown to catch a
planted break of each kind it looks for.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_available_size import manager, move

from kvcached.kv_cache_manager import KVCacheManager, Placement


def broken(m: KVCacheManager) -> list[str]:
    """The invariants of the fields' comments that ``m`` and its allocator break now."""
    a = m.allocator
    out = []
    free, reserved, in_use = set(a._free), a._reserved, a._in_use
    if len(free) != len(a._free) or free & reserved or free & in_use or reserved & in_use:
        out.append("allocator: a page in two states")
    if free | reserved | in_use != set(range(a.num_pages)):
        out.append("allocator: a page in no state")
    if not a._goable <= reserved:
        out.append("allocator: a goable page that is not reserved")
    mapped = {p for p in range(a.num_pages) if m.backend.is_mapped(p)}
    if mapped != reserved | in_use:
        out.append("allocator: the backend's mapped pages are not the reserved and in-use ones")
    used = [0] * m.geometry.num_pages
    for b in range(m.geometry.num_blocks):
        if m._allocated[b]:
            used[m.page_of(b)] += 1
    if used != m._used or m.num_allocated != sum(m._allocated) or m.num_allocated != sum(m._used):
        out.append("manager: the per-page counts are not the allocated blocks")
    if set(m._free_in) - in_use or any(not f for f in m._free_in.values()):
        out.append("manager: a free list for a page not in use, or an empty one")
    for p in in_use:
        blocks = set(m._blocks_of(p))
        allocated = {b for b in blocks if m._allocated[b]}
        listed = m._free_in.get(p, [])
        if allocated & set(listed) or allocated | set(listed) != blocks or len(set(listed)) != len(listed):
            out.append(f"manager: page {p}'s blocks are not its allocated ones and its free list")
    if any(used[p] for p in range(m.geometry.num_pages) if p not in in_use):
        out.append("manager: a block allocated on a page not in use")
    if not {p for p, f in m._free_in.items() if f} <= set(m._partial):
        out.append("manager: a page with free blocks missing from the partial heap")
    if m._partial_free != sum(len(f) for f in m._free_in.values()):
        out.append("manager: _partial_free is not the free lists' length")
    counts = [0] * (m._bpp + 1)  # the buckets by free count that placement picks from
    for page, f in m._free_in.items():
        counts[len(f)] += 1
        if page not in m._bucket[len(f)]:
            out.append(f"manager: page {page} is missing from bucket {len(f)}")
    if counts != m._in_bucket:
        out.append(f"manager: bucket counts {m._in_bucket}, pages {counts}")
    if m._nonempty != sum(1 << k for k, n in enumerate(counts) if n):
        out.append("manager: the non-empty bits are not the buckets with pages")
    if m._entries != sum(len(h) for h in m._bucket):
        out.append("manager: _entries is not the heaps' length")
    return out


OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "take", "free", "free-page", "build", "limit"]), st.integers(0, 10**6)),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    placement=st.sampled_from(list(Placement)),
    per_page=st.sampled_from([1, 3, 8]),
    pages=st.integers(1, 6),
    short=st.integers(0, 7),
    policy=st.sampled_from(["ledger", "legacy"]),
    reserve=st.tuples(st.integers(0, 2), st.integers(0, 3)),
    ops=OPS,
)
def test_the_fields_invariants_hold_after_any_moves(
    placement: Placement,
    per_page: int,
    pages: int,
    short: int,
    policy: str,
    reserve: tuple[int, int],
    ops: list[tuple[str, int]],
) -> None:
    num_blocks = pages * per_page + short % per_page
    m = manager(num_blocks, per_page, policy, min_reserved=min(reserve), max_reserved=max(reserve))
    m.placement = placement
    held: list[int] = []
    build = 0
    try:
        assert broken(m) == []
        for op, x in ops:
            held, build = move(m, op, x, held, build)
            assert broken(m) == [], (op, broken(m))
    finally:
        m.backend.close()


@pytest.mark.parametrize(
    "plant, expected",
    [
        (lambda m: m.allocator._goable.add(next(iter(m.allocator._in_use))), "goable page that is not reserved"),
        (lambda m: m.allocator._reserved.add(next(iter(m.allocator._in_use))), "a page in two states"),
        (lambda m: setattr(m, "_partial_free", m._partial_free + 1), "_partial_free is not"),
        (lambda m: m._used.__setitem__(0, m._used[0] + 1), "per-page counts"),
        (lambda m: m._free_in[0].append(m._free_in[0][0]), "page 0's blocks"),
        (lambda m: m._partial.clear(), "missing from the partial heap"),
        (lambda m: m._in_bucket.__setitem__(1, m._in_bucket[1] + 1), "bucket counts"),
    ],
)
def test_the_checker_catches_each_planted_break(plant, expected: str) -> None:  # type: ignore[no-untyped-def]
    m = manager(16, 4, "ledger")
    try:
        m.alloc(3)  # page 0 in use, with one free block
        assert broken(m) == []
        plant(m)
        assert any(expected in line for line in broken(m)), broken(m)
    finally:
        m.backend.close()
