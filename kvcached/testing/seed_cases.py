"""The freed-block-copy cases of upstream kvcached PR #598 and its review comment P2, as event sequences.

Each scenario is the order in which vLLM's scheduler and ``OffloadingConnector`` produce the
events (see ``shared/notes/vllm-offloading.md``: schedule -> build -> worker -> update), with no
allocator decisions in it: ``simulate.derive`` adds those under a policy. Under ``legacy`` each
shows an I1 violation; under ``ledger`` none. They are small enough to read, and they are the
built-in examples of the demo and of the ledger's tests.

Geometry: 2 MiB pages, 512 KiB blocks, so four blocks share a page and a page empties only
when all four are free, as with real pages.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from kvcached.ledger.events import (
    BlockAlloc,
    BlockFree,
    BuildBoundary,
    Event,
    Header,
    JobBuilt,
    JobKind,
    JobReported,
    MemoryLimit,
    PoolGeometry,
    PrefixCacheReset,
    RequestAdded,
    RequestFinished,
    RequestPreempted,
    WindowHold,
    WindowRelease,
)

MiB = 1 << 20
FULL, WINDOW = 0, 1
STORE, LOAD = JobKind.STORE, JobKind.LOAD


class Scenario(msgspec.Struct, frozen=True):
    name: str
    title: str
    story: str
    header: Header
    events: tuple[Event, ...]


def _header(name: str, pools: int = 1, workers: int = 1) -> Header:
    geo = PoolGeometry(block_bytes=512 * 1024, num_blocks=64)
    return Header(page_bytes=2 * MiB, pools=(geo,) * pools, workers=workers, meta={"scenario": name})


def finish_in_write_step() -> Scenario:
    """Case 1: a one-token request finishes in the step whose build stored its KV."""
    ev: list[Event] = [
        RequestAdded(0, "req-one-token"),
        BlockAlloc(FULL, (0, 1, 2, 3)),  # schedule(0): prefill
        JobBuilt(0, STORE, 0, ((0, 1, 2, 3),), 1),  # build 0 stores the prompt's blocks
        BuildBoundary(0),
        BlockFree(FULL, (0, 1, 2, 3)),  # update_from_output(0): one token, finished, freed
        RequestFinished(0),  # build 1: nothing left to store
        BuildBoundary(1),
        JobReported(0, 1),  # the worker submitted the store at the start of step 1
        BuildBoundary(2),
    ]
    return Scenario(
        "finish-in-write-step",
        "a request that finishes in the step that writes its KV",
        "The store built in step 0 is submitted by the worker at the start of step 1, but the "
        "request freed its blocks at the end of step 0.",
        _header("finish-in-write-step"),
        tuple(ev),
    )


def finished_store_next_build() -> Scenario:
    """Case 2: the store of a finished request's last block is built in the next build."""
    ev: list[Event] = [
        RequestAdded(0, "req-last-block"),
        BlockAlloc(FULL, (0, 1)),  # prefill: two full blocks
        JobBuilt(0, STORE, 0, ((0, 1),), 1),
        BuildBoundary(0),
        BlockAlloc(FULL, (2,)),  # decode spills into block 2
        BuildBoundary(1),
        JobReported(0, 1),  # blocks 0 and 1 are safely stored
        BlockFree(FULL, (0, 1, 2)),  # update_from_output(1): finished; no job for block 2 yet
        JobBuilt(1, STORE, 0, ((2,),), 1),  # build 2: request_finished asked for this store
        RequestFinished(0),
        BuildBoundary(2),
        JobReported(1, 1),
        BuildBoundary(3),
    ]
    return Scenario(
        "finished-store-next-build",
        "the last-block store of a finished request, built in the next build",
        "When the request frees its blocks no job exists yet: the connector creates the store of "
        "block 2 in the next build_connector_meta.",
        _header("finished-store-next-build"),
        tuple(ev),
    )


def sliding_window() -> Scenario:
    """Case 3: sliding-window blocks freed while the request runs are stored builds later."""
    ev: list[Event] = [
        RequestAdded(0, "req-window"),
        BlockAlloc(FULL, (0, 1)),
        BlockAlloc(WINDOW, (0, 1)),
        WindowHold(0, WINDOW, (0, 1)),
        BuildBoundary(0),
        BlockAlloc(FULL, (2,)),
        BlockAlloc(WINDOW, (4,)),  # the window moves on, onto the next page
        WindowHold(0, WINDOW, (4,)),
        BlockFree(WINDOW, (0, 1)),  # out of the window: freed while the request runs
        BuildBoundary(1),
        BuildBoundary(2),
        JobBuilt(0, STORE, 0, ((0, 1), (0, 1)), 1),  # build 3 stores them, ids kept by the connector
        BuildBoundary(3),
        JobReported(0, 1),
        BlockFree(FULL, (0, 1, 2)),
        BlockFree(WINDOW, (4,)),
        JobBuilt(1, STORE, 0, ((2,), (4,)), 1),
        RequestFinished(0),
        BuildBoundary(4),
        JobReported(1, 1),
        BuildBoundary(5),
    ]
    return Scenario(
        "sliding-window",
        "sliding-window blocks freed while running, stored builds later",
        "The connector keeps the freed window block ids and may store them in any later build, "
        "as long as vLLM has not reallocated them.",
        _header("sliding-window", pools=2),
        tuple(ev),
    )


def preempt_shrink(release_on_match: bool = True) -> Scenario:
    """Review comment P2 on kvcached PR #598: preemption with window holds while the limit is
    lowered and the prefix cache reset.

    ``release_on_match=False`` is the bridge before the review: holds of a preempted request
    are dropped only when it resumes, which it cannot while the shrink waits on those holds.
    """
    ev: list[Event] = [RequestAdded(0, "req-preempted-a"), RequestAdded(1, "req-preempted-b")]
    for req, blocks in ((0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))):
        ev += [BlockAlloc(FULL, blocks), BlockAlloc(WINDOW, blocks), WindowHold(req, WINDOW, blocks)]
    ev += [
        JobBuilt(0, STORE, 0, ((0, 1, 2, 3), (0, 1, 2, 3)), 1),
        BuildBoundary(0),
        MemoryLimit(1),  # another model on the GPU needs the memory back
        PrefixCacheReset(),  # reset_running_requests=True preempts both requests
        RequestPreempted(0),
        BlockFree(FULL, (0, 1, 2, 3)),
        BlockFree(WINDOW, (0, 1, 2, 3)),
        RequestPreempted(1),
        BlockFree(FULL, (4, 5, 6, 7)),
        BlockFree(WINDOW, (4, 5, 6, 7)),
        BuildBoundary(1),  # the connector flushes the preempted request's store
        JobReported(0, 1),
    ]
    build = 2
    for _ in range(20):  # both wait: resuming needs more blocks than the shrinking pool offers
        ev.append(BuildBoundary(build))
        build += 1
        if release_on_match and build == 5:
            # The scheduler tries to admit them: get_num_new_matched_tokens drops old block lists.
            ev += [WindowRelease(0), WindowRelease(1)]
    ev += [MemoryLimit(16), BlockAlloc(FULL, (0, 1, 2, 3)), BuildBoundary(build)]
    ev += [BlockFree(FULL, (0, 1, 2, 3)), RequestFinished(0), RequestFinished(1), BuildBoundary(build + 1)]
    name = "preempt-shrink" if release_on_match else "preempt-shrink-no-release"
    return Scenario(
        name,
        "kvcached PR #598, review comment P2: preempted requests with window holds while the limit "
        "is lowered and the prefix cache reset",
        "The shrink must not wait forever on the window holds of requests that cannot resume until the shrink is done.",
        _header(name, pools=2),
        tuple(ev),
    )


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "finish-in-write-step": finish_in_write_step,
    "finished-store-next-build": finished_store_next_build,
    "sliding-window": sliding_window,
    "preempt-shrink": preempt_shrink,
}
