"""The SGLang bridge: the ledger's events from SGLang's calls, so no HiCache copy reads an unmapped page.

SGLang guards HiCache's copies against the *reuse* of freed slots, but an unmap is not a reuse.
Two paths free a copy's slots before its acknowledgement: the cache reset
(``Scheduler.flush_cache``, ``Bridge.cache_reset``) and a write-back backup, which holds no lock
at all. So kvcached pins the pages a copy touches from its submission to its completion
(``Bridge.submitted``, ``Bridge.poll``), as the vLLM bridge does for the OffloadingConnector's
jobs. A scheduler step is a build boundary (``Bridge.step``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..engine.steps import OpsPerStep, StepEnds
from ..ledger.events import (
    BuildBoundary,
    JobBuilt,
    JobKind,
    JobReported,
    PrefixCacheReset,
    RequestAdded,
    RequestFinished,
    WindowHold,
)

if TYPE_CHECKING:
    from ..kv_cache_manager import KVCacheManager
    from ..ledger.recorder import Recorder


class Bridge:
    """Events from SGLang's calls into one engine's ledger.

    NOTE: SGLang guards HiCache's copies in two ways (``managers/cache_controller.py``). A tree
    node is not freed until its copy is acknowledged (``lock_ref``, the ack queues drained by the
    tree's ``writing_check`` / ``loading_check``). Stream fences order the *reuse* of freed slots
    after the forward pass. An unmap is not a reuse, and two paths free a copy's slots before its
    acknowledgement: the cache reset (``cache_reset``) and a write-back backup, which holds no
    lock at all. So kvcached pins the pages a copy touches from its submission to its completion.
    """

    def __init__(self, recorder: Recorder, manager: KVCacheManager, pool: Any, page_size: int) -> None:
        self.recorder = recorder
        self.manager = manager
        self.pool = pool  # the SGLang pool whose slots are the manager's blocks
        self.page_size = page_size
        self.ends = StepEnds(manager)  # each call's drain, each step's page ops (``step_done``)
        self.build = 0
        self._next_job = 0
        # Jobs submitted and not yet seen done, with their finish events.
        self.outstanding: dict[int, Any] = {}
        # Overlap scheduling (``Scheduler.event_loop_overlap``): in step k the results of step
        # k - 1 are processed, and its finished requests freed, after step k's forward was
        # launched, which may still read those slots (it was built before they finished) until
        # step k's results are processed, in step k + 1. So the pages of a step's frees are held
        # (``WindowHold`` by a request standing for that step's forward) until the boundary of
        # step k + 2. The slots are free at once: SGLang evicts and allocates in one step, and
        # its own stream order makes their reuse safe; only the unmap must wait.
        self.hold_frees = False
        # Called at each step on the scheduler's thread (``control.SglangControl.apply``): what
        # kvctl asked for from the live socket's thread.
        self.on_step: Callable[[], None] | None = None
        self._holds: list[tuple[int, int]] = []  # (step, the request holding its frees' pages)
        # SGLang's event loop steps continuously, idle or not (about 25 steps a second on this
        # CPU). A step after which nothing was recorded, while the ledger is settled (no job,
        # grace, hold or deadline a boundary would move), would add a boundary that ends
        # nothing, so it is not recorded: an idle engine journals nothing, and the flight
        # recorder's window is not filled with idle steps. ``_quiet_at``: the ledger's event
        # count after the last boundary.
        self._quiet_at = -1
        # Inside ``get_next_batch_to_run`` (admission, chunking, decode growth: where SGLang
        # counts and then allocates): counts lease the shared budget's room until the step ends.
        self.scheduling = False

    # --- scheduler ----------------------------------------------------------------------------

    def step(self) -> None:
        """A scheduler step begins: the previous one's forward pass is done.

        NOTE: a scheduler step (``Scheduler.get_next_batch_to_run``, which starts by draining
        HiCache's acks) is a build boundary. A page emptied by a free waits for the next one, for
        the forward pass of the step that freed it; under overlap scheduling one boundary more
        (``hold_frees``). A step after which nothing happened records no boundary (an idle
        engine's loop keeps stepping).
        """
        ledger = self.recorder.ledger
        if ledger.index != self._quiet_at or self._holds or not ledger.settled:
            self.recorder.emit(BuildBoundary(self.build, self.recorder.stamp()))
            self.build += 1
            while self._holds and self._holds[0][0] <= self.build - 2:
                self.recorder.emit(RequestFinished(self._holds.pop(0)[1]))  # that forward is done
            self._quiet_at = ledger.index
        if self.on_step is not None:
            self.on_step()
        self.poll()
        self.ends.drain()
        self.scheduling = True

    def step_done(self) -> None:
        """The step has built its batch: the budget's room its counts leased and its allocations
        did not map goes back, so that another engine can map it while this one runs or idles."""
        self.scheduling = False
        self.ends.drain()
        self.ends.step_ended()

    @property
    def page_ops(self) -> OpsPerStep:
        """Page maps and unmaps per step."""
        return self.ends.ops

    def free(self, slots: list[int]) -> None:
        """The allocator frees ``slots`` (blocks, at page_size 1)."""
        if self.hold_frees:
            if not self._holds or self._holds[-1][0] != self.build:
                req = self._next_id()
                self.recorder.emit(RequestAdded(req, f"forward-{self.build}"))
                self._holds.append((self.build, req))
            self.recorder.emit(WindowHold(self._holds[-1][1], 0, tuple(slots)))
        self.manager.free(slots)
        if not self.scheduling:  # within a step, its end drains (a lease may still stand on it)
            self.ends.drain()

    def _next_id(self) -> int:
        n = self._next_job
        self._next_job += 1
        return n

    # --- HiCache copies -----------------------------------------------------------------------

    def submitted(self, kind: JobKind, transfers: Any, completion: Any) -> Any:
        """``L2TransferEngine.submit_*`` returned ``completion`` for ``transfers``: pin the device
        slots of those on kvcached's pool until it completes; returns the completion SGLang keeps.

        NOTE: both directions go through one choke point, ``L2TransferEngine.submit_device_to_host``
        / ``submit_host_to_device`` (``mem_cache/l2_transfer.py``). Each returns a
        ``TransferCompletion`` whose ``finish_event`` SGLang keeps in its ``HiCacheAck``. The
        bridge records a ``JobBuilt`` for the device slots of the transfers and keeps the event.
        The event is left as SGLang made it: SGLang passes it to CUDA (``Event.elapsed_time`` in
        the tree's ``writing_check``, a stream's ``wait_event`` in 0.5.23's unified pool), which
        takes no stand-in.
        """
        blocks: set[int] = set()
        pool, ps = self.pool, self.page_size
        for t in transfers:
            if t.device_pool is pool:
                blocks.update((t.device_indices // ps).tolist() if ps > 1 else t.device_indices.tolist())
        if not blocks:
            return completion
        job = self._next_id()
        # A HiCache copy belongs to tree nodes, not to a request; the ledger's jobs name one, so
        # each copy is its own request, finished once submitted: I4 then holds every copy to
        # ending within the ledger's liveness bound, as it holds a finished vLLM request's jobs.
        name = f"hicache-{'write' if kind is JobKind.STORE else 'load'}-{job}"
        self.recorder.emit(RequestAdded(job, name))
        self.recorder.emit(JobBuilt(job, kind, job, (tuple(sorted(blocks)),), 1))
        self.recorder.emit(RequestFinished(job))
        self.outstanding[job] = completion.finish_event
        return completion

    def poll(self) -> None:
        """Report the copies whose finish events are done (the step drains the pages after).

        NOTE: this runs at each scheduler step, before SGLang drains its acks. A pin can therefore
        outlast its copy by one step, never the reverse: SGLang frees a node's slots only after it
        has seen the ack, which the poll before it has seen too, or a step later.
        """
        for job, event in list(self.outstanding.items()):
            if event.query():
                del self.outstanding[job]
                self.recorder.emit(JobReported(job, 1))

    def cache_reset(self) -> None:
        """The allocator is about to free every slot (``flush_cache``'s ``clear``).

        NOTE: this reset frees a copy's slots before its acknowledgement.
        ``HiCacheController.reset`` drops ``ack_write_queue`` and ``ack_load_queue`` without
        waiting, and ``Scheduler.flush_cache`` only asks ``is_fully_idle``, which ignores
        in-flight copies; the allocator's ``clear`` then frees every slot. A copy whose
        acknowledgement a reset dropped is not waited for (the flush returns as SGLang's does). It
        stays outstanding, its pages stay mapped under the freed slots, and the poll ends its pin
        when the copy is done rather than never (I4).

        NOTE: the copies in flight stay in ``outstanding``: SGLang's reset drops their
        acknowledgements (``HiCacheController.reset``), but a copy still reads its pages until its
        finish event says it is done, so ``poll`` goes on asking (forgetting them here would pin
        their pages for ever, I4: the ``no-poll`` planted bug of ``kvcached.testing.plants``).
        """
        self.recorder.emit(PrefixCacheReset())
