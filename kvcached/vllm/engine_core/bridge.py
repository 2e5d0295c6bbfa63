"""Ledger events from vLLM's scheduler-side calls, with vLLM left exactly as it is.

The connector copies blocks after vLLM has freed them (the three cases of kvcached PR #598), and
vLLM only waits for such a copy when it reallocates a block. kvcached must therefore learn, from
the connector's own public calls, which pages a copy may still read or write. ``install_bridge``
attaches a ``Bridge`` to the scheduler-side connector and to the block pool, and the bridge turns
each of their calls into ledger events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...errors import ConfigError
from ...ledger.events import (
    BuildBoundary,
    Event,
    JobBuilt,
    JobFailed,
    JobKind,
    JobReported,
    PrefixCacheReset,
    RequestAdded,
    RequestBlocks,
    RequestFinished,
    RequestPreempted,
    WindowHold,
    WindowRelease,
)
from ...ledger.recorder import Recorder
from .. import patches

# vLLM keeps one block pool for all KV groups (a block id names the same slot in every group's
# tensors), so the ledger sees a single pool, 0.
POOL = 0


def window_groups(kv_cache_config: Any) -> frozenset[int]:
    """KV groups whose freed blocks the connector may still store later: sliding-window groups,
    and Mamba groups outside "align" mode (whose states are not stored in the handing-off pass)."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

    out = set()
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        mamba_not_aligned = isinstance(spec, MambaSpec) and getattr(spec, "mamba_cache_mode", None) != "align"
        if isinstance(spec, SlidingWindowSpec) or mamba_not_aligned:
            out.add(i)
    return frozenset(out)


def _preempted_status() -> Any:
    """vLLM's ``RequestStatus.PREEMPTED`` (None without vLLM, where no request is matched)."""
    try:
        from vllm.v1.request import RequestStatus
    except ImportError:
        return None
    return RequestStatus.PREEMPTED


# A scheduled request given blocks in a step: its id, its block ids per KV group, and whether it
# was admitted in that step (new or resumed) rather than running on.
_Given = tuple[str, tuple[list[int], ...], bool]


def _given(so: Any) -> list[_Given]:
    """The scheduled requests given blocks in a step (new ones first, then the rest in
    ``scheduled_cached_reqs`` order): all of a new or resumed request's blocks, the appended ones
    of a running request (vLLM's ``Scheduler._make_cached_request_data``)."""
    cached = so.scheduled_cached_reqs
    # NOTE: vLLM 0.34 re-sends a resumed request in full among scheduled_new_reqs
    # (Scheduler.schedule: "A resumed request is re-sent in full, like a new one") and dropped
    # CachedRequestData.resumed_req_ids; before, it was a cached request named there.
    resumed = getattr(cached, "resumed_req_ids", ())
    out: list[_Given] = [(new.req_id, new.block_ids, True) for new in so.scheduled_new_reqs]
    for rid, groups in zip(cached.req_ids, cached.new_block_ids, strict=True):
        if groups:  # None: no block given in this step
            out.append((rid, groups, rid in resumed))
    return out


def _block_ids(spec: Any) -> tuple[int, ...]:
    ids = spec.block_ids
    if hasattr(ids, "tolist"):
        listed = ids.tolist()
        # vLLM's BlockIDsLoadStoreSpec keeps a numpy int32 array, whose tolist() gives Python
        # ints already: no int() call per block (one a block on every job of every build).
        if ids.dtype.kind in "iu":
            return tuple(listed)
        ids = listed
    return tuple(int(b) for b in ids)


class Bridge:
    """Holds the wrapped calls' originals and the request-id interning.

    NOTE: each event has one source: those of the calls wrapped here, the bridge's; blocks, the
    manager's; pages, the allocator's. The bridge only records: the allocator learns which pages
    the events released when the engine's wrapper of the scheduler call drains it, once, at the
    end of the call (``scheduler_calls``), as vLLM's ``Scheduler.schedule`` drains
    ``BlockPool.take_events`` once a step. The recorder calls nobody back."""

    def __init__(
        self,
        connector: Any | None,
        recorder: Recorder,
        *,
        workers: int,
        windows: frozenset[int],
    ) -> None:
        self.connector = connector  # None: no KV connector, only the prefix-cache reset
        self.recorder = recorder
        self._ledger = recorder.ledger
        self.workers = workers
        self.windows = windows
        self.build = 0
        self._req_ids: dict[str, int] = {}
        self._next_req = 0
        self._held: set[int] = set()  # requests with window holds
        # Requests whose preemption is recorded, until they are scheduled again or finish.
        self._preempted: dict[int, str] = {}
        self._preempted_status = _preempted_status()
        self._orig: dict[str, Callable[..., Any]] = {}
        self._fresh: set[int] = set()  # blocks vLLM's pool handed out since the last build
        self.null_block = 0  # vLLM's null block id (BlockPool.null_block): held for ever, no request's

    # --- helpers ------------------------------------------------------------------------------

    def req(self, request_id: str) -> int:
        r = self._req_ids.get(request_id)
        if r is None:
            r = self._next_req
            self._next_req += 1
            self._req_ids[request_id] = r
            self._emit(RequestAdded(r, request_id))
        return r

    def _emit(self, ev: Event) -> None:
        self.recorder.emit(ev)

    def _job_blocks(self, spec: Any) -> tuple[int, ...]:
        """A job's device blocks, vLLM's null block left out. NOTE: from vLLM 0.34 a store job
        keeps a chunk's null pages (a sliding window's dropped blocks) as placeholders in its
        spec (OffloadingConnectorScheduler: "must not be fenced as a live allocation"): the null
        block is no request's, is never freed and its page never unmapped, so a job over it
        pins nothing and stores no request's KV."""
        ids = _block_ids(spec)
        null = self.null_block
        return tuple(b for b in ids if b != null) if null in ids else ids

    # --- the wrapped calls --------------------------------------------------------------------

    def on_new_request(self, request: Any) -> Any:
        """The request is named (interned to a small integer)."""
        self.req(request.request_id)
        return self._orig["on_new_request"](request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        """NOTE: native matching drops the request's old block lists, so its window holds end
        (review comment P2 on kvcached PR #598); in-flight job pins are untouched."""
        r = self._req_ids.get(request.request_id)
        if r is not None and r not in self._preempted and request.status is self._preempted_status:
            # Preempted between steps (``Scheduler.reset_prefix_cache(reset_running_requests=
            # True)``), and matched, maybe admitted, before the output that lists it in
            # ``preempted_req_ids`` is built: record the preemption now, before matching drops
            # its holds, or the ledger keeps a running request "preempted".
            self._preempted[r] = request.request_id
            self._emit(RequestPreempted(r))
        if r is not None and r in self._held:
            # The connector is about to clear this request's old block lists: nothing it holds
            # a window for can be stored any more (kvcached PR #598, review comment P2). Job pins stay with their jobs.
            self._held.discard(r)
            self._emit(WindowRelease(r))
        return self._orig["get_num_new_matched_tokens"](request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """The step's events. Which blocks each scheduled request was given in this step, fresh
        or shared (``RequestBlocks``, for the ledger's I5: a store copies only its request's
        blocks). Window holds for blocks newly given to sliding-window (and non-align Mamba)
        groups. One ``JobBuilt`` per load and store job with its GPU block ids. Preempted and
        finished requests, then the build boundary."""
        given = _given(scheduler_output)
        owners = self._owners(given, scheduler_output)
        if self.windows:
            for rid, groups, _ in given:
                self._hold(rid, groups)
        meta = self._orig["build_connector_meta"](scheduler_output)
        emit, workers = self._emit, self.workers
        after = self._record_owners(owners, meta) if owners else ()
        # Sorted: vLLM hands some of these over as sets of strings, whose order changes with the
        # hash seed, and a journal of the same run must be the same bytes (golden traces).
        for job_id, job in sorted(meta.load_jobs.items()):
            emit(JobBuilt(int(job_id), JobKind.LOAD, self.req(job.req_id), (self._job_blocks(job.dst_spec),), workers))
        for job_id, job in sorted(meta.store_jobs.items()):
            emit(JobBuilt(int(job_id), JobKind.STORE, self.req(job.req_id), (self._job_blocks(job.src_spec),), workers))
        for r, fresh, shared in after:
            emit(RequestBlocks(r, POOL, fresh, shared))
        preempted = self._preempted
        for rid in sorted(scheduler_output.preempted_req_ids or ()):
            r = self.req(rid)
            if r not in preempted:  # not seen at matching: preempted within this schedule
                preempted[r] = rid
                emit(RequestPreempted(r))
        if preempted:  # scheduled in this step: running again
            scheduled = scheduler_output.num_scheduled_tokens
            for r in [r for r, rid in preempted.items() if rid in scheduled]:
                del preempted[r]
        for rid in sorted(scheduler_output.finished_req_ids or ()):
            done = self._req_ids.pop(rid, None)
            if done is not None:
                self._held.discard(done)
                preempted.pop(done, None)
                emit(RequestFinished(done))
        emit(BuildBoundary(self.build, self.recorder.stamp()))
        self.build += 1
        return meta

    def _owners(self, given: list[_Given], so: Any) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """Which blocks each scheduled request was given in this step (``_given``), as (request,
        fresh, shared): fresh if vLLM's pool handed them out in this step, else shared (prefix
        hits, or blocks a resumed request holds again)."""
        # Running requests are scheduled first (vLLM's ``Scheduler.schedule``), then waiting ones
        # (new or resumed) in the order they were admitted, which is ``num_scheduled_tokens``'.
        running = [(rid, groups) for rid, groups, admitted in given if not admitted]
        waiting = [(rid, groups) for rid, groups, admitted in given if admitted]
        if len(waiting) > 1:
            # Their places in that order, looked up from its end, where they are (a dict of every
            # scheduled request cost ~350 instructions a request, ~190 a prefill-heavy step).
            scheduled = so.num_scheduled_tokens
            left = {rid for rid, _ in waiting}
            order: dict[str, int] = {}
            i = len(scheduled)
            for rid in reversed(scheduled):
                i -= 1
                if rid in left:
                    order[rid] = i
                    left.discard(rid)
                    if not left:
                        break
            waiting.sort(key=lambda g: order.get(g[0], 0))
        fresh: set[Any] = self._fresh  # looked up by vLLM's own id objects (below)
        out: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        for rid, groups in running + waiting:
            # vLLM caches a full block as soon as it is allocated, so a request scheduled later
            # in the same step may hold a block handed out fresh in it as a prefix hit: the
            # first request to hold it in scheduling order is the one its KV is written for.
            new: list[Any] = []
            shared: list[Any] = []
            for group in groups:
                # vLLM's block ids, kept as the objects they are: only looked up and stored
                # (typed int, each would be unboxed and boxed again for every lookup).
                ids: list[Any] = group
                for b in ids:
                    if b in fresh:
                        fresh.discard(b)
                        new.append(b)
                    elif b:  # 0: vLLM's null block (skipped window positions)
                        shared.append(b)
            if new or shared:
                out.append((self.req(rid), tuple(new), tuple(shared)))
        fresh.clear()
        return out

    def _record_owners(
        self, owners: list[tuple[int, tuple[int, ...], tuple[int, ...]]], meta: Any
    ) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """Emit ``RequestBlocks`` before the build's jobs; return those to be emitted only after
        them, as (request, fresh, shared): the writes told late, then the holds of the same
        blocks by requests that hit them in this step.

        A fresh block is written by the forward of this step, but a store job that vLLM puts in
        ``jobs_to_flush`` copies before that forward (the worker's ``handle_preemptions`` waits
        for it first). vLLM 0.33 does so with the last store of a request that finished in the
        previous step, whose freed blocks this schedule may give to another request: that store
        reads the finished request's own KV. Such a block (read by flushed stores, and by no
        unflushed store but its new holder's own) is told as held now and as written after the
        jobs, or the ledger would see a foreign store (I5) that is none.

        A request scheduled later in the same step may hold such a block as a prefix hit:
        vLLM's ``KVCacheManager.allocate_slots`` caches a request's full blocks when it
        allocates them (``cache_blocks``), before ``Scheduler.schedule`` matches the next
        waiting request (``get_computed_blocks``). What that request reads there is the KV its
        first holder writes in this step, its own prefix: its hold is told after that write
        too, or its own later store of the block would be I5's foreign store. No
        unflushed store of this build reads a block told late (or it would be told at once),
        so moving the hold past the jobs hides nothing a store here copies."""
        flushed: set[int] = set()
        unflushed: dict[int, set[int]] = {}  # block -> requests of unflushed stores that read it
        flush = meta.jobs_to_flush
        if flush:
            for job_id, job in meta.store_jobs.items():
                ids = _block_ids(job.src_spec)
                if job_id in flush:
                    flushed.update(ids)
                else:
                    r = self.req(job.req_id)
                    for b in ids:
                        unflushed.setdefault(b, set()).add(r)
        late: set[int] = set()  # blocks whose write is told after the jobs
        written: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        if flushed:
            for r, new, _ in owners:
                later = tuple(b for b in new if b in flushed and unflushed.get(b, set()) <= {r})
                if later:
                    late.update(later)
                    written.append((r, later, ()))
        hits: list[tuple[int, tuple[int, ...], tuple[int, ...]]] = []
        for r, new, shared in owners:
            if late:
                later = tuple(b for b in new if b in late)  # its own writes told late: held now
                held = tuple(b for b in shared if b in late)  # same-step hits on them: held after
                if later or held:
                    new = tuple(b for b in new if b not in late)
                    shared = (*(b for b in shared if b not in late), *later)
                if held:
                    hits.append((r, (), held))
                if not new and not shared:
                    continue
            self._emit(RequestBlocks(r, POOL, new, shared))
        return written + hits

    def _hold(self, request_id: str, groups: tuple[list[int], ...]) -> None:
        blocks = tuple(b for g in sorted(self.windows) if g < len(groups) for b in groups[g] if b)
        if blocks:
            r = self.req(request_id)
            self._held.add(r)
            self._emit(WindowHold(r, POOL, blocks))

    def update_connector_output(self, connector_output: Any) -> Any:
        """One ``JobReported`` per job per step, with the summed count."""
        out = self._orig["update_connector_output"](connector_output)
        meta = connector_output.kv_connector_worker_meta
        completed = getattr(meta, "completed_jobs", None)
        if completed:
            # NOTE: vLLM 0.34's workers report a failed copy as completed and name it in
            # failed_jobs (OffloadingWorkerMetadata.mark_completed(job_id, success=False)): the
            # failure is recorded first, then the report releases the pins as for any other.
            failed = getattr(meta, "failed_jobs", None) or ()
            for job_id, count in completed.items():
                if job_id in failed:
                    self._emit(JobFailed(int(job_id)))
                self._emit(JobReported(int(job_id), int(count)))
        return out

    def close_build(self) -> None:
        """Without a connector: close the open build if freed pages wait for one. Nothing else
        ends a build there (``build_connector_meta`` is never called), and no copy can have
        captured a freed block; the engine's scheduler calls call this (``scheduler_calls``)."""
        ledger = self._ledger
        if ledger.pending_grace_pages():
            self.recorder.emit(BuildBoundary(ledger.build, self.recorder.stamp()))

    def has_pending_push_work(self) -> bool:
        """NOTE: also true while grace pins still need a build to drain, so that an idle engine
        keeps stepping until every page the ledger holds can go."""
        return bool(self._orig["has_pending_push_work"]()) or self.recorder.ledger.pending_grace_pages() > 0

    # --- the wrapped block pool calls -----------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[Any]:
        """The block pool's, noted to tell a request's fresh blocks (its KV is written there) from
        its prefix hits (``_owners``)."""
        blocks: list[Any] = self._orig["get_new_blocks"](num_blocks)
        self._fresh.update([b.block_id for b in blocks])
        return blocks

    def reset_prefix_cache(self) -> bool:
        """NOTE: this wraps the block pool's reset (vLLM's own, underneath the page-aware pool)
        for ``PrefixCacheReset``, so that a reset is recorded before the frees it causes. An
        engine without a KV connector gets a bridge of this call alone (``offloading=False``)."""
        ok = bool(self._orig["reset_prefix_cache"]())
        if ok:
            self._emit(PrefixCacheReset())
        return ok


def install_bridge(scheduler: Any, recorder: Recorder, *, offloading: bool = True) -> Bridge:
    """Attach a bridge to ``scheduler.connector`` (kvcached's OffloadingConnector, scheduler role:
    it reports its scheduler-side calls to the bridge) and shadow the block pool's prefix-cache
    reset and ``get_new_blocks``, to feed ``recorder``.
    ``offloading=False``: a scheduler without a KV connector, the reset only.

    NOTE: ``scheduler.connector`` is kvcached's subclass of vLLM's OffloadingConnector, which
    vLLM itself builds through its connector factory (``connector``). Each of the bridged calls
    goes to the bridge, which calls vLLM's; no class and no module of vLLM changes.

    Refuses, with one line saying what to change, a scheduler without an OffloadingConnector
    (unless ``offloading=False``), and a block pool already made page-aware (install the bridge
    first, so that a reset is recorded before the frees the page-aware pool makes of it).
    """
    connector = getattr(scheduler, "connector", None) if offloading else None
    on_connector = patches.by_name("offloading bridge")
    on_pool = patches.by_name("prefix-cache reset and fresh blocks, recorded")
    if offloading:
        name = type(connector).__name__
        if connector is None or name != "OffloadingConnector":
            raise ConfigError(
                f"kvcached's offloading bridge needs vLLM's OffloadingConnector as the only KV connector; "
                f"this scheduler has {name if connector is not None else 'none'}: set "
                "kv_transfer_config={'kv_connector': 'OffloadingConnector', ...} or disable kvcached"
            )
        from .connector import OffloadingConnector

        if not isinstance(connector, OffloadingConnector):
            raise ConfigError(
                f"kvcached's offloading bridge needs the OffloadingConnector of {patches.CONNECTOR_MODULE} "
                f"(vLLM's, reporting to kvcached); this one is {type(connector).__module__}'s: set "
                f"kv_transfer_config's kv_connector_module_path to {patches.CONNECTOR_MODULE} (ENABLE_KVCACHED=1 "
                "does so at startup) or disable kvcached"
            )
        patches.check_object(connector, on_connector)
    pool = scheduler.kv_cache_manager.block_pool
    if patches.installed_on(pool, patches.by_name("page-aware block pool")):
        raise ConfigError("install kvcached's bridge before its page-aware pool (the pool's reset wraps the bridge's)")
    patches.check_object(pool, on_pool)
    if connector is not None:
        parallel = scheduler.vllm_config.parallel_config
        workers, windows = int(parallel.world_size), window_groups(scheduler.kv_cache_config)
    else:
        workers, windows = 1, frozenset()
    bridge = Bridge(connector, recorder, workers=workers, windows=windows)
    bridge.null_block = int(pool.null_block.block_id)
    if connector is not None:
        bridge._orig.update(connector.vllm_calls())
        connector.kvcached_bridge = bridge
        patches.mark(connector, on_connector)
    # Fresh blocks matter only to stores (I5): without a connector only the reset is recorded.
    on_pool_calls: dict[str, Callable[..., Any]] = {"reset_prefix_cache": bridge.reset_prefix_cache}
    if connector is not None:
        on_pool_calls["get_new_blocks"] = bridge.get_new_blocks
    bridge._orig.update(patches.shadow(pool, on_pool, on_pool_calls))
    return bridge
