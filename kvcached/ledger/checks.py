"""The ledger's slow paths: building witnesses for violations, and the liveness checks (I4).

Kept apart from ``ledger.py`` so that the hot handlers there stay short and readable: they only
detect that something is wrong (a comparison, a membership test) and call here to say what.
A witness is the few events that explain a violation, with their indices and builds, because
that is what a maintainer can act on. The checks take the ledger's state (``LedgerTables``),
not the ledger: everything they read is there, and so is ``violate``, the one thing they write
through besides the liveness flags; they neither see nor call the rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from .events import JobBuilt, JobKind
from .findings import ChainLink, plural
from .tables import LedgerTables


def _links(t: LedgerTables, *links: ChainLink) -> tuple[ChainLink, ...]:
    """Fill in builds from event indices; drop links to events before the trace (index -1)."""
    return tuple(
        c if c.build >= 0 else msgspec.structs.replace(c, build=t.build_of(c.index)) for c in links if c.index >= 0
    )


def _kind(kind: int) -> str:
    return "store" if kind == JobKind.STORE else "load"


def bad_pool(t: LedgerTables, pool: int, what: str) -> None:
    t.violate("I3", "unknown-pool", f"{what} names pool {pool}; the header has {len(t.header.pools)}")


def bad_block(t: LedgerTables, pool: int, block: int, what: str) -> bool:
    nb = t.header.pools[pool].num_blocks
    t.violate("I3", "block-out-of-range", f"{what} names block {block} of pool {pool}, which has {nb}")
    return False


def lost_blocks(t: LedgerTables, ev: JobBuilt) -> None:
    """A job reads or writes blocks whose data is gone; say which, and how it got there."""
    for pool, ids in enumerate(ev.blocks):
        pages = [t.bpage[pool][b] for b in ids]
        if ev.kind == JobKind.STORE:
            if _store_of_lost_blocks(t, ev, pool, ids, pages):
                return
        elif not all(t.mapped[p] for p in pages):
            _load_into_unmapped(t, ev, pool, ids, pages)
            return


def _store_of_lost_blocks(t: LedgerTables, ev: JobBuilt, pool: int, ids: Sequence[int], pages: Sequence[int]) -> bool:
    """A store job reads blocks never written, or whose page was unmapped after they were."""
    bepoch, epoch = t.bepoch[pool], t.epoch
    unwritten = [(b, p) for b, p in zip(ids, pages, strict=True) if bepoch[b] < 0]
    lost = [(b, p) for b, p in zip(ids, pages, strict=True) if 0 <= bepoch[b] != epoch[p]]
    if unwritten and not t.lossy:
        b, p = unwritten[0]
        t.violate(
            "I3",
            "job-on-unwritten-block",
            f"store job {ev.job} reads block {b} of pool {pool}, never allocated",
            job=ev.job,
            page=p,
        )
    if not lost:
        return False
    b, p = lost[0]
    more = f" (+{plural(len(lost) - 1, 'more block')})" if len(lost) > 1 else ""
    chain = _links(
        t,
        ChainLink(step="alloc", index=t.balloc_ix[pool][b], build=-1, what=f"block {b} written (allocated)"),
        ChainLink(step="free", index=t.bfree_ix[pool][b], build=-1, what=f"block {b} freed"),
        ChainLink(step="unmap", index=t.unmap_ix[p], build=-1, what=f"page {p} unmapped"),
        ChainLink(step="late copy", index=t.index, build=t.build, what=f"store job {ev.job} built over block {b}"),
    )
    t.violate(
        "I1",
        "copy-of-lost-block",
        f"store job {ev.job} copies block {b} of pool {pool} after its page {p} was unmapped "
        f"(the copy reads zeros or another tenant's bytes){more}",
        page=p,
        job=ev.job,
        request=t.request_name(ev.req),
        chain=chain,
    )
    return True


def _load_into_unmapped(t: LedgerTables, ev: JobBuilt, pool: int, ids: Sequence[int], pages: Sequence[int]) -> None:
    b, p = next((b, p) for b, p in zip(ids, pages, strict=True) if not t.mapped[p])
    chain = _links(t, ChainLink(step="late copy", index=t.index, build=t.build, what=f"load job {ev.job} built"))
    t.violate(
        "I1",
        "copy-of-lost-block",
        f"load job {ev.job} writes block {b} of pool {pool} into unmapped page {p}",
        page=p,
        job=ev.job,
        request=t.request_name(ev.req),
        chain=chain,
    )


def store_owner(t: LedgerTables, ev: JobBuilt) -> None:
    """I5: a store job copies only blocks its request holds, or held, since they were last written.

    A block another request was given fresh (``RequestBlocks.fresh``) after this request last
    held it holds the other request's KV: stored under this request's key, a later turn that
    hits that key loads someone else's KV. vLLM 0.33.0's ``OffloadingConnectorScheduler`` does
    so after a connector reset with sliding windows: it keeps stale window block ids of a
    request (only ids re-allocated in the current batch are cleared) and stores them under it.
    """
    # Run for every store job once owners are known (a few hundred blocks a scheduler step), so
    # written for mypyc like the ledger's hot handlers: the ids stay the event's int objects,
    # which in pool 0 (vLLM's only pool) are the block keys themselves (``pool << 32 | b``: a
    # new int object per lookup, twice a block), and the tables are read through ``Any`` locals.
    owned: dict[Any, Any] = t.owned.get(ev.req) or {}
    written: dict[Any, Any] = t.written
    groups: tuple[tuple[Any, ...], ...] = ev.blocks
    bad: list[tuple[int, int, int, list[int]]] | None = None  # (pool, block, held since or -1, [written at, by])
    for pool in range(len(groups)):
        base: Any = pool << 32
        for b in groups[pool]:
            key = base | b if pool else b
            held: int = owned.get(key, -1)  # unboxed: compared natively
            at: int = written.get(key, -1)
            if held < 0 or at > held:
                if bad is None:
                    bad = []
                bad.append((pool, b, held, [at, t.written_by[key] if at >= 0 else -1]))
    if bad is None:
        return
    pool, b, held, (at, by) = bad[0]
    more = f" (+{plural(len(bad) - 1, 'more block')})" if len(bad) > 1 else ""
    mine, theirs = t.request_name(ev.req), t.request_name(by) if by >= 0 else "another request"
    if held < 0:
        why = f"which request {mine} never held"
    else:
        why = f"which request {theirs} was given fresh after {mine} last held it"
    chain = _links(
        t,
        ChainLink(step="hold", index=held, build=-1, what=f"request {mine} holds block {b}"),
        ChainLink(step="alloc", index=at, build=-1, what=f"block {b} given fresh to request {theirs}"),
        ChainLink(step="late copy", index=t.index, build=t.build, what=f"store job {ev.job} built over block {b}"),
    )
    t.violate(
        "I5",
        "store-of-foreign-block",
        f"store job {ev.job} of request {mine} copies block {b} of pool {pool}, {why} "
        f"(its KV is saved under {mine}'s key){more}",
        page=t.bpage[pool][b] if b < len(t.bpage[pool]) else None,
        job=ev.job,
        request=mine,
        chain=chain,
    )


def unmap_under_jobs(t: LedgerTables, p: int) -> None:
    """The page goes while jobs still copy from or to it: the freed-block copy itself."""
    for job in t.jobs_on(p):
        kind, req, _, workers, reported, build, index, _ = t.jobs[job]
        chain = _links(
            t,
            ChainLink(step="pin", index=index, build=build, what=f"{_kind(kind)} job {job} built over page {p}"),
            ChainLink(step="free", index=t.pfree_ix[p], build=-1, what=f"last block on page {p} freed"),
            ChainLink(step="unmap", index=t.index, build=t.build, what=f"page {p} unmapped"),
        )
        t.job_violation.setdefault(job, []).append(len(t.violations))
        t.violate(
            "I1",
            "unmap-under-job",
            f"page {p} unmapped while {_kind(kind)} job {job} still waits on {plural(workers - reported, 'worker')}",
            page=p,
            job=job,
            request=t.request_name(req),
            chain=chain,
        )


def late_copy(t: LedgerTables, job: int) -> None:
    """A job whose page was unmapped under it has now completed: that is the late copy."""
    for vi in t.job_violation.pop(job, ()):
        v = t.violations[vi]
        link = ChainLink(step="late copy", index=t.index, build=t.build, what=f"job {job} completed its copy")
        t.violations[vi] = msgspec.structs.replace(v, chain=(*v.chain, link))


def finished_request(t: LedgerTables, req: int, n: int) -> None:
    """I4: a finished request's jobs must be reported within ``liveness_builds`` builds."""
    if req not in t.finished:  # its jobs have all been reported
        return
    job = min(j for j, st in t.jobs.items() if st[1] == req)  # rare: scanning the jobs is fine
    _, _, pages, workers, reported, _, _, _ = t.jobs[job]
    since = t.finished[req]
    t.violate(
        "I4",
        "pin-outlives-request",
        f"job {job} of request {t.request_name(req)}, finished in build {since}, still pins "
        f"{plural(len(pages), 'page')} {plural(n - since, 'build')} later "
        f"(waiting on {plural(workers - reported, 'worker')})",
        job=job,
        request=t.request_name(req),
        page=pages[0] if pages else None,
    )


def shrink(t: LedgerTables, n: int) -> None:
    """I4 while over the memory limit: the shrink must finish once the pins allow it."""
    k = t.liveness_builds
    if t.releasable:
        if t.stall_since is None:
            t.stall_since = n
        elif n - t.stall_since > k and not t.stall_reported:
            t.stall_reported = True
            t.violate(
                "I4",
                "shrink-stalled",
                f"{plural(t.mapped_pages, 'page')} mapped over a limit of {t.limit} for "
                f"{plural(n - t.stall_since, 'build')} while {plural(len(t.releasable), 'page')} could be unmapped",
                page=min(t.releasable),
            )
    else:
        t.stall_since = None
    # The clock of a preempted request's holds runs from when they began to block the shrink:
    # the later of its preemption and the build the pages went over the limit.
    began = n if t.over_limit_since is None else t.over_limit_since
    for req, since in t.preempted.items():
        held = t.req_holds.get(req)
        start = max(since, began)
        if held and n - start > k and req not in t.hold_reported:
            t.hold_reported.add(req)
            t.violate(
                "I4",
                "holds-block-shrink",
                f"window holds of request {t.request_name(req)}, preempted in build {since}, keep "
                f"{plural(len(held), 'page')} mapped over the limit of {t.limit} for {plural(n - start, 'build')}",
                request=t.request_name(req),
                page=min(held),
            )
