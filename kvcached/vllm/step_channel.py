"""The scheduler's page decisions, carried to every worker by the step vLLM already sends it.

The scheduler (engine-core process) decides when a logical page is mapped or unmapped; the KV
memory lives in each worker (one per tensor-parallel rank, in its own process under vLLM's ``mp``
and Ray executors, on its own GPU). Upstream kvcached broadcasts those decisions over Unix sockets
of its own; here they ride vLLM's per-step message instead, so every executor vLLM has carries
them and nothing else is opened. Engine side, the manager's backends are ``DecisionBackend``
objects: they keep the backend contract (a page is mapped or not, exactly) and write each
decision on logical page ``p`` into a ``PageLog``. At the end of ``Scheduler.schedule()`` what
the log holds is attached to the returned ``SchedulerOutput`` as ``kvcached_page_ops``, a tuple
of ints: vLLM pickles that dataclass with its ``__dict__`` to every worker (the ``mp`` executor's
shared-memory queue, ``shm_broadcast.MessageQueue.enqueue``; Ray's compiled graph; the ``uni``
executor hands the object itself). Worker side, ``GPUModelRunner.execute_model`` (which every
executor's worker path ends in, Ray's ``execute_model_ray`` included) first applies the ops to
this worker's own range, then runs the step. When the engine goes idle (``EngineCore.has_work``
is false) with decisions pending, they go out through vLLM's ``collective_rpc``, the path vLLM
uses for its utility calls, so an idle engine still gives memory back. docs/design.md ("Tensor
parallel: decisions ride the step") says why this ordering is safe.

Message: ``(seq, blocks_per_page, op, ...)``; ``op >= 0`` maps logical page ``op``, ``op < 0``
unmaps page ``~op``. ``seq`` counts batches from 1; a worker refuses a gap (a batch an executor
lost would leave its memory out of step with the ledger), and batch 1 first drops whatever
vLLM's warm-up wrote. ``blocks_per_page`` lets each worker check that its own plan puts blocks
on the same pages as the scheduler's.
"""

from __future__ import annotations

import threading
from typing import Final

from ..errors import ConsistencyError
from .patches import by_name

# The attribute of vLLM's ``SchedulerOutput`` that carries a batch, as the patch table adds it.
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

    def record(self, op: int) -> None:
        with self._lock:
            self._ops.append(op)

    @property
    def pending(self) -> bool:
        return bool(self._ops)

    def take(self) -> tuple[int, ...]:
        with self._lock:
            self.seq += 1
            ops, self._ops = self._ops, []
        if ops:
            self.batches += 1
        return (self.seq, self.blocks_per_page, *ops)
