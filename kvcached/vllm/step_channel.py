"""The scheduler's page decisions, carried to every worker by the step vLLM already sends it.

The scheduler (engine-core process) decides when a logical page is mapped or unmapped; the KV
memory lives in each worker (one per tensor-parallel rank, in its own process under vLLM's ``mp``
and Ray executors, on its own GPU). Upstream kvcached broadcasts those decisions over Unix sockets
of its own. Here they ride vLLM's per-step message instead (``ATTR``), so every executor vLLM has
carries them and nothing else is opened. Under a shared budget, an unmap's bytes go back only
once its batch is applied (``DeferredRelease``).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Final

from ..errors import ConsistencyError
from .patches import by_name

if TYPE_CHECKING:
    from ..budget import Budget

# The attribute of vLLM's ``SchedulerOutput`` that carries a batch, as the patch table adds it.
#
# Engine side, the manager's backends are ``DecisionBackend`` objects: they keep the backend
# contract (a page is mapped or not, exactly) and write each decision on logical page ``p`` into a
# ``PageLog``. At the end of ``Scheduler.schedule()`` what the log holds is attached to the
# returned ``SchedulerOutput`` as ``kvcached_page_ops``, a tuple of ints. vLLM pickles that
# dataclass with its ``__dict__`` to every worker (the ``mp`` executor's shared-memory queue,
# ``shm_broadcast.MessageQueue.enqueue``; Ray's compiled graph; the ``uni`` executor hands the
# object itself).
#
# Worker side, ``GPUModelRunner.execute_model`` (which every executor's worker path ends in, Ray's
# ``execute_model_ray`` included) first applies the ops to this worker's own range, then runs the
# step. When the engine goes idle (``EngineCore.has_work`` is false) with decisions pending, they
# go out through vLLM's ``collective_rpc``, the path vLLM uses for its utility calls, so an idle
# engine still gives memory back. docs/design.md ("Tensor parallel: decisions ride the step") says
# why this ordering is safe.
ATTR: Final = by_name("page decisions ride the step").attrs[0]


class ChannelError(ConsistencyError):
    """A worker received page decisions out of order, or for another page geometry."""


class PageLog:
    """Decisions on logical pages since the last batch was taken; thread-safe (``kvctl limit``
    decides on the ledger service's thread)."""

    def __init__(self, blocks_per_page: int) -> None:
        self.blocks_per_page = blocks_per_page
        self.seq = 0
        self._ops: list[int] = []
        self._lock = threading.Lock()
        self.batches = 0  # batches sent with at least one op (for the tests and the log)
        # Budget bytes of the unmaps recorded since the last batch, then per batch sent and not
        # yet known applied: (seq, bytes), oldest first (``DeferredRelease``).
        self._held = 0
        self._unapplied: list[tuple[int, int]] = []
        self._due_since: float | None = None  # monotonic time the batch to take became non-empty

    def record(self, op: int) -> None:
        with self._lock:
            self._ops.append(op)
            if self._due_since is None:
                self._due_since = time.monotonic()

    def hold(self, nbytes: int) -> None:
        """Keep ``nbytes`` of budget for the unmaps recorded so far, until their batch is applied."""
        with self._lock:
            self._held += nbytes
            if nbytes and self._due_since is None:
                self._due_since = time.monotonic()

    @property
    def held_bytes(self) -> int:
        """Budget bytes kept for unmaps the workers may not have applied yet."""
        with self._lock:
            return self._held + sum(n for _, n in self._unapplied)

    def applied(self, seq: int) -> int:
        """Every batch up to ``seq`` reached every worker (batches apply in order): the budget
        bytes their unmaps kept, now free to give back."""
        with self._lock:
            done = [n for s, n in self._unapplied if s <= seq]
            self._unapplied = [(s, n) for s, n in self._unapplied if s > seq]
        return sum(done)

    @property
    def pending(self) -> bool:
        """Whether a batch is due: decisions, or budget bytes kept for unmaps, not taken yet."""
        return self._due_since is not None

    def due_for(self, now: float) -> float:
        """Seconds the batch to take has been due at ``now`` (0.0: nothing is due)."""
        since = self._due_since
        return 0.0 if since is None else max(0.0, now - since)

    def take(self) -> tuple[int, ...]:
        """The next batch, as the message the workers receive: ``(seq, blocks_per_page, op, ...)``.

        NOTE: ``op >= 0`` maps logical page ``op``, ``op < 0`` unmaps page ``~op``. ``seq``
        counts batches from 1; a worker refuses a gap (a batch an executor lost would leave its
        memory out of step with the ledger), and batch 1 first drops whatever vLLM's warm-up
        wrote. ``blocks_per_page`` lets each worker check that its own plan puts blocks on the
        same pages as the scheduler's."""
        with self._lock:
            self.seq += 1
            ops, self._ops = self._ops, []
            self._due_since = None
            if self._held:
                self._unapplied.append((self.seq, self._held))
                self._held = 0
        if ops:
            self.batches += 1
        return (self.seq, self.blocks_per_page, *ops)


class DeferredRelease:
    """The engine core's hand on a shared budget (``kvcached.page_allocator.PageBudget``): grants
    and the return of unspent leases go straight to the budget; the bytes of an unmap wait in the
    page log until its batch is applied (``release_applied``).

    NOTE: an unmap decided in the engine core frees nothing yet: the workers still hold the page
    until they apply the batch. So the page's bytes are not given back when the allocator decides
    but when the batch is known applied. That is when the model output of the step that carried
    it has reached ``Scheduler.update_from_output`` (every rank applies its batch before its
    forward pass, and the output rank's forward waits for every rank's collectives), or when an
    idle engine's ``collective_rpc`` flush has returned. Otherwise a neighbour's worker could map
    those bytes while this engine's still held them, and on a GPU its ``cuMemCreate`` would
    fail."""

    def __init__(self, budget: Budget, page_log: PageLog) -> None:
        self.budget = budget
        self.name = budget.name
        self._log = page_log

    def acquire_up_to(self, nbytes: int, unit: int) -> int:
        return self.budget.acquire_up_to(nbytes, unit)

    def release(self, nbytes: int) -> None:
        self.budget.release(nbytes)

    def release_unmapped(self, nbytes: int) -> None:
        self._log.hold(nbytes)

    def ask(self, nbytes: int) -> None:
        self.budget.ask(nbytes)

    def headroom(self) -> int | None:
        return self.budget.headroom()

    def room(self) -> int | None:
        return self.budget.room()

    def release_applied(self, seq: int) -> int:
        """Batch ``seq`` and those before it were applied by every worker: give back what their
        unmaps kept; returns the bytes."""
        n = self._log.applied(seq)
        if n:
            self.budget.release(n)
        return n
