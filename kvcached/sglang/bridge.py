"""The SGLang bridge: the ledger's events from SGLang's calls, so no HiCache copy reads an unmapped page.

SGLang guards HiCache's copies in two ways (``managers/cache_controller.py``): a tree node is
not freed until its copy is acknowledged (``lock_ref``, the ack queues drained by the tree's
``writing_check`` / ``loading_check``), and stream fences order the *reuse* of freed slots
after the forward pass. An unmap is not a reuse, and two paths free a copy's slots before its
acknowledgement: the cache reset (``HiCacheController.reset`` drops ``ack_write_queue`` and
``ack_load_queue`` without waiting, and ``Scheduler.flush_cache`` only asks ``is_fully_idle``,
which ignores in-flight copies; the allocator's ``clear`` then frees every slot), and a
write-back backup, which holds no lock at all. So kvcached pins the pages a copy touches from
its submission to its completion, as the vLLM bridge does for the OffloadingConnector's jobs.

Both directions go through one choke point, ``L2TransferEngine.submit_device_to_host`` /
``submit_host_to_device`` (``mem_cache/l2_transfer.py``): each returns a ``TransferCompletion``
whose ``finish_event`` SGLang keeps in its ``HiCacheAck`` (and, from 0.5.23, hands to the
allocator's ``set_hicache_transfer_done_event``). The bridge records a ``JobBuilt`` for the
device slots of the transfers and returns the completion with that event wrapped
(``_Acknowledged``): the first time SGLang learns the copy is done (``query()`` true, or
``synchronize()`` returned) the job is reported, on whichever path asks. A copy whose
acknowledgement the reset dropped is not waited for (the flush returns as SGLang's does): its
pages stay pinned, mapped under the freed slots, and each scheduler step polls its event, so the
pin ends when the copy does rather than never (I4). A scheduler step
(``Scheduler.get_next_batch_to_run``, which starts by draining HiCache's acks) is a build
boundary: a page emptied by a free waits for the next one, for the forward pass of the step
that freed it; under overlap scheduling a free is recorded one boundary late (``hold_frees``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..ledger.events import (
    BuildBoundary,
    JobBuilt,
    JobKind,
    JobReported,
    PrefixCacheReset,
    RequestAdded,
    RequestFinished,
)

if TYPE_CHECKING:
    from ..kv_cache_manager import KVCacheManager
    from ..ledger.recorder import Recorder


class _Acknowledged:
    """A transfer's finish event that reports its job the first time SGLang sees it complete.

    Everything but ``query`` and ``synchronize`` goes to the event as it is (``wait``,
    ``record``, ``elapsed_time``), so streams and timings behave as before.
    """

    __slots__ = ("_bridge", "_event", "_job")

    def __init__(self, event: Any, bridge: Bridge, job: int) -> None:
        self._event = event
        self._bridge = bridge
        self._job = job

    def query(self) -> bool:
        done = bool(self._event.query())
        if done:
            self._bridge.reported(self._job)
        return done

    def synchronize(self) -> None:
        self._event.synchronize()
        self._bridge.reported(self._job)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._event, name)


class Bridge:
    """Events from SGLang's calls into one engine's ledger (see the module docstring)."""

    def __init__(self, recorder: Recorder, manager: KVCacheManager, pool: Any, page_size: int) -> None:
        self.recorder = recorder
        self.manager = manager
        self.pool = pool  # the SGLang pool whose slots are the manager's blocks
        self.page_size = page_size
        self.build = 0
        self._next_job = 0
        # Jobs submitted and not yet acknowledged, with their wrapped events (the reset waits on them).
        self.outstanding: dict[int, _Acknowledged] = {}
        # Planted-bug switch for the tests (``tests/sglang``): without the poll, a copy whose
        # acknowledgement a reset dropped pins its pages for ever (I4).
        self.poll_orphans = True
        # Overlap scheduling (``Scheduler.event_loop_overlap``): step k's results are processed,
        # and its finished requests freed, after step k + 1's forward is launched, which may still
        # read those slots (it was built before they finished) until step k + 1's results are
        # processed, after the next boundary. So a free is held until the boundary after it and
        # recorded then: its grace ends one boundary later, when that forward is done.
        self.hold_frees = False
        self.held: list[int] = []

    # --- scheduler ----------------------------------------------------------------------------

    def step(self) -> None:
        """A scheduler step begins: the previous one's forward pass is done."""
        self.recorder.emit(BuildBoundary(self.build, self.recorder.stamp()))
        self.build += 1
        if self.held:
            held, self.held = self.held, []
            self.manager.free(held)
        self.poll()
        self.manager.drain_releasable()

    def free(self, slots: list[int]) -> None:
        """The allocator frees ``slots`` (blocks, at page_size 1)."""
        if self.hold_frees:
            self.held += slots
            return
        self.manager.free(slots)
        self.manager.drain_releasable()

    # --- HiCache copies -----------------------------------------------------------------------

    def submitted(self, kind: JobKind, transfers: Any, completion: Any) -> Any:
        """``L2TransferEngine.submit_*`` returned ``completion`` for ``transfers``: pin the device
        slots of those on kvcached's pool until it completes; returns the completion SGLang keeps."""
        blocks: set[int] = set()
        pool, ps = self.pool, self.page_size
        for t in transfers:
            if t.device_pool is pool:
                blocks.update((t.device_indices // ps).tolist() if ps > 1 else t.device_indices.tolist())
        if not blocks:
            return completion
        job = self._next_job
        self._next_job += 1
        # A HiCache copy belongs to tree nodes, not to a request; the ledger's jobs name one, so
        # each copy is its own request, finished once submitted: I4 then holds every copy to
        # ending within the ledger's liveness bound, as it holds a finished vLLM request's jobs.
        name = f"hicache-{'write' if kind is JobKind.STORE else 'load'}-{job}"
        self.recorder.emit(RequestAdded(job, name))
        self.recorder.emit(JobBuilt(job, kind, job, (tuple(sorted(blocks)),), 1))
        self.recorder.emit(RequestFinished(job))
        event = _Acknowledged(completion.finish_event, self, job)
        self.outstanding[job] = event
        return completion._replace(finish_event=event)

    def reported(self, job: int) -> None:
        if self.outstanding.pop(job, None) is None:
            return  # acknowledged before (SGLang polls a finished event again, e.g. after a reset)
        self.recorder.emit(JobReported(job, 1))
        self.manager.drain_releasable()

    def poll(self) -> None:
        """Report the copies that finished without SGLang asking: those whose acknowledgements
        ``HiCacheController.reset`` dropped. Their pages stay pinned until then."""
        if not self.poll_orphans:
            return
        for event in list(self.outstanding.values()):
            event.query()

    def cache_reset(self) -> None:
        """The allocator is about to free every slot (``flush_cache``'s ``clear``), held ones too."""
        self.held = []
        self.recorder.emit(PrefixCacheReset())
