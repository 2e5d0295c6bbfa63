"""The ledger's slow paths: building witnesses for violations, and the liveness checks (I4).

Kept apart from ``ledger.py`` so that the hot handlers there stay short and readable: they only
detect that something is wrong (a comparison, a membership test) and call here to say what.
A witness is the few events that explain a violation, with their indices and builds, because
that is what a maintainer can act on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from .events import JobBuilt, JobKind
from .findings import ChainLink

if TYPE_CHECKING:
    from .ledger import Ledger


def _links(lg: Ledger, *links: ChainLink) -> tuple[ChainLink, ...]:
    """Fill in builds from event indices; drop links to events before the trace (index -1)."""
    return tuple(
        c if c.build >= 0 else msgspec.structs.replace(c, build=lg.build_of(c.index)) for c in links if c.index >= 0
    )


def _kind(kind: int) -> str:
    return "store" if kind == JobKind.STORE else "load"


def bad_pool(lg: Ledger, pool: int, what: str) -> None:
    lg._violate("I3", "unknown-pool", f"{what} names pool {pool}; the header has {len(lg.header.pools)}")


def bad_block(lg: Ledger, pool: int, block: int, what: str) -> bool:
    nb = lg.header.pools[pool].num_blocks
    lg._violate("I3", "block-out-of-range", f"{what} names block {block} of pool {pool}, which has {nb}")
    return False


def lost_blocks(lg: Ledger, ev: JobBuilt) -> None:
    """A job reads or writes blocks whose data is gone; say which, and how it got there."""
    for pool, ids in enumerate(ev.blocks):
        pages = [lg._bpage[pool][b] for b in ids]
        if ev.kind == JobKind.STORE:
            if _store_of_lost_blocks(lg, ev, pool, ids, pages):
                return
        elif not all(lg._mapped[p] for p in pages):
            _load_into_unmapped(lg, ev, pool, ids, pages)
            return


def _store_of_lost_blocks(lg: Ledger, ev: JobBuilt, pool: int, ids: Sequence[int], pages: Sequence[int]) -> bool:
    """A store job reads blocks never written, or whose page was unmapped after they were."""
    bepoch, epoch = lg._bepoch[pool], lg._epoch
    unwritten = [(b, p) for b, p in zip(ids, pages, strict=True) if bepoch[b] < 0]
    lost = [(b, p) for b, p in zip(ids, pages, strict=True) if 0 <= bepoch[b] != epoch[p]]
    if unwritten and not lg.lossy:
        b, p = unwritten[0]
        lg._violate(
            "I3", "job-on-unwritten-block",
            f"store job {ev.job} reads block {b} of pool {pool}, never allocated", job=ev.job, page=p,
        )
    if not lost:
        return False
    b, p = lost[0]
    more = f" (+{len(lost) - 1} more block(s))" if len(lost) > 1 else ""
    chain = _links(
        lg,
        ChainLink(step="alloc", index=lg._balloc_ix[pool][b], build=-1, what=f"block {b} written (allocated)"),
        ChainLink(step="free", index=lg._bfree_ix[pool][b], build=-1, what=f"block {b} freed"),
        ChainLink(step="unmap", index=lg._unmap_ix[p], build=-1, what=f"page {p} unmapped"),
        ChainLink(step="late copy", index=lg.index, build=lg.build, what=f"store job {ev.job} built over block {b}"),
    )
    lg._violate(
        "I1", "copy-of-lost-block",
        f"store job {ev.job} copies block {b} of pool {pool} after its page {p} was unmapped "
        f"(the copy reads zeros or another tenant's bytes){more}",
        page=p, job=ev.job, request=lg.request_name(ev.req), chain=chain,
    )
    return True


def _load_into_unmapped(lg: Ledger, ev: JobBuilt, pool: int, ids: Sequence[int], pages: Sequence[int]) -> None:
    b, p = next((b, p) for b, p in zip(ids, pages, strict=True) if not lg._mapped[p])
    chain = _links(lg, ChainLink(step="late copy", index=lg.index, build=lg.build, what=f"load job {ev.job} built"))
    lg._violate(
        "I1", "copy-of-lost-block", f"load job {ev.job} writes block {b} of pool {pool} into unmapped page {p}",
        page=p, job=ev.job, request=lg.request_name(ev.req), chain=chain,
    )


def unmap_under_jobs(lg: Ledger, p: int) -> None:
    """The page goes while jobs still copy from or to it: the freed-block copy itself."""
    for job in lg.jobs_on(p):
        kind, req, _, workers, reported, build, index = lg._jobs[job]
        chain = _links(
            lg,
            ChainLink(step="pin", index=index, build=build, what=f"{_kind(kind)} job {job} built over page {p}"),
            ChainLink(step="free", index=lg._pfree_ix[p], build=-1, what=f"last block on page {p} freed"),
            ChainLink(step="unmap", index=lg.index, build=lg.build, what=f"page {p} unmapped"),
        )
        lg._job_violation.setdefault(job, []).append(len(lg.violations))
        lg._violate(
            "I1", "unmap-under-job",
            f"page {p} unmapped while {_kind(kind)} job {job} still waits on {workers - reported} worker(s)",
            page=p, job=job, request=lg.request_name(req), chain=chain,
        )


def late_copy(lg: Ledger, job: int) -> None:
    """A job whose page was unmapped under it has now completed: that is the late copy."""
    for vi in lg._job_violation.pop(job, ()):
        v = lg.violations[vi]
        link = ChainLink(step="late copy", index=lg.index, build=lg.build, what=f"job {job} completed its copy")
        lg.violations[vi] = msgspec.structs.replace(v, chain=(*v.chain, link))


def finished_request(lg: Ledger, req: int, n: int) -> None:
    """I4: a finished request's jobs must be reported within ``liveness_builds`` builds."""
    if req not in lg._finished or not lg._req_jobs.get(req):
        return
    job = min(j for j, st in lg._jobs.items() if st[1] == req)  # rare: scanning the jobs is fine
    _, _, pages, workers, reported, _, _ = lg._jobs[job]
    since = lg._finished[req]
    lg._violate(
        "I4", "pin-outlives-request",
        f"job {job} of request {lg.request_name(req)}, finished in build {since}, still pins {len(pages)} "
        f"page(s) {n - since} builds later (waiting on {workers - reported} worker(s))",
        job=job, request=lg.request_name(req), page=pages[0] if pages else None,
    )


def shrink(lg: Ledger, n: int) -> None:
    """I4 while over the memory limit: the shrink must finish once the pins allow it."""
    k = lg.liveness_builds
    if lg._releasable:
        if lg._stall_since is None:
            lg._stall_since = n
        elif n - lg._stall_since > k and not lg._stall_reported:
            lg._stall_reported = True
            lg._violate(
                "I4", "shrink-stalled",
                f"{lg.mapped_pages} pages mapped over a limit of {lg.limit} for {n - lg._stall_since} builds "
                f"while {len(lg._releasable)} page(s) could be unmapped",
                page=min(lg._releasable),
            )
    else:
        lg._stall_since = None
    for req, since in lg._preempted.items():
        held = lg._req_holds.get(req)
        if held and n - since > k and req not in lg._hold_reported:
            lg._hold_reported.add(req)
            lg._violate(
                "I4", "holds-block-shrink",
                f"window holds of request {lg.request_name(req)}, preempted in build {since}, keep {len(held)} "
                f"page(s) mapped over the limit of {lg.limit} for {n - since} builds",
                request=lg.request_name(req), page=min(held),
            )
