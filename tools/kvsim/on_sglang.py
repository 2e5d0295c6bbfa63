"""kvsim's SGLang variant: seeded random traffic over SGLang's real pool, allocator and HiCache.

A case is drawn from its seed alone (``draw``): overlap scheduling on or off, and steps of the
actions SGLang's scheduler and tree cache take, played over ``HiCacheStack`` (SGLang's own parts;
only the copy kernels are the deferring stand-in). The checks:

* ``attended-bytes``: what a forward reads is its request's;
* ``store-bytes``: an acknowledged backup holds the node's bytes; ``load-bytes``: a loaded node holds them;
* ``unmapped-touch``: a backup a flush orphaned does not copy from an unmapped page;
* ``ledger`` (I1-I5 over the run's events), ``leftover`` (no copy left pinned at the end), ``crash``.

Variants: ``ledger`` (shipped), ``legacy`` (unmap when empty), and two planted bugs the checks
must catch, ``no-hold`` and ``no-poll`` (``run_case``).
"""

from __future__ import annotations

import random
import traceback
from typing import Any, Final

import msgspec
import torch

from kvcached.ledger.events import Policy
from kvcached.sglang.testing.scenarios import config
from kvcached.sglang.testing.stack import HiCacheStack, same
from kvcached.testing.plants import planted

CHECKS: Final = ("attended-bytes", "store-bytes", "load-bytes", "unmapped-touch", "ledger", "leftover", "crash")
PLANTED: Final = ("no-hold", "no-poll")  # variants that are planted bugs
VARIANTS: Final = ("ledger", "legacy", *PLANTED)
SIZE = 1023  # slots; 16 pages of 64
STALL = 8  # steps a copy may wait for the copy engine at most


class Case(msgspec.Struct, frozen=True):
    seed: int
    overlap: bool
    steps: tuple[tuple[tuple[str, int], ...], ...]

    def describe(self) -> str:
        n = sum(len(s) for s in self.steps)
        return f"{len(self.steps)} steps, {n} actions, overlap {'on' if self.overlap else 'off'}"


class Failure(msgspec.Struct, frozen=True):
    check: str
    step: int
    detail: str


class Result(msgspec.Struct, frozen=True):
    seed: int
    variant: str
    failures: tuple[Failure, ...]
    flushes: int
    stores: int
    loads: int

    @property
    def ok(self) -> bool:
        return not self.failures

    def checks(self) -> list[str]:
        return sorted({f.check for f in self.failures}, key=CHECKS.index)


def draw(seed: int) -> Case:
    """The case of ``seed``: overlap on or off, and 8-40 steps of 1-4 actions each.

    NOTE: the actions (played by ``_Run._act``):

    * ``arrive n``: a request gets ``n`` slots (``alloc``) and the next step's forward writes KV
      bytes that identify it;
    * ``finish``: the oldest running request ends (once its forward has run); its KV is kept as a
      tree node and backed up (``write``, write-through) when no backup is in flight, else freed;
    * ``evict``: a node whose backup is acknowledged leaves the device (``free_segment``);
    * ``load``: a node on the host only comes back (``load``, then ``start_loading``);
    * ``drop``: a node off the device leaves the host tier too;
    * ``copies k``: the copy engine finishes ``k`` of the queued copies (and any copy queued
      ``STALL`` steps ago has finished by the next step);
    * ``flush``: when ``Scheduler.is_fully_idle`` would say so (no request running, no load in
      flight, under overlap no forward in flight), ``/flush_cache`` (the controller's reset, the
      host pool's ``clear``, the allocator's ``clear``).
    """
    rng = random.Random(seed)
    kinds = ("arrive", "arrive", "finish", "finish", "evict", "load", "drop", "copies", "copies", "flush")
    steps = []
    for _ in range(rng.randint(8, 40)):
        actions = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(kinds)
            arg = rng.randint(1, 160) if kind == "arrive" else rng.randint(0, 3) if kind == "copies" else 0
            actions.append((kind, arg))
        steps.append(tuple(actions))
    return Case(seed, rng.random() < 0.5, tuple(steps))


class _Node:
    def __init__(self, data: dict[str, torch.Tensor], slots: torch.Tensor | None, host: torch.Tensor | None) -> None:
        self.data = data
        self.slots = slots  # device slots, None once evicted
        self.host = host  # host slots, None until backed up or once dropped
        self.backed = False  # its backup's acknowledgement was seen
        self.loading = False
        self.copied_at = 0  # the copy stand-in's count once its backup has run


class _Run:
    def __init__(self, case: Case, variant: str) -> None:
        self.case = case
        policy = Policy.LEGACY if variant == "legacy" else Policy.LEDGER
        self.stack = HiCacheStack(config(policy), size=SIZE)
        self.hold = case.overlap
        # (request, its slots, the bytes its first forward wrote; None until that forward)
        self.running: list[tuple[int, torch.Tensor, dict[str, torch.Tensor] | None]] = []
        self.freed_last_step: list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]] = []
        self.nodes: list[_Node] = []
        self.orphans: list[_Node] = []
        self.queued_at: list[tuple[int, int]] = []  # (step, the copy stand-in's count after it)
        self.failures: dict[str, Failure] = {}
        self.step = 0
        self.next_req = 0
        self.flushes = self.stores = self.loads = 0

    def fail(self, check: str, detail: str) -> None:
        self.failures.setdefault(check, Failure(check, self.step, detail))

    # --- one step -----------------------------------------------------------------------------

    def begin_step(self) -> None:
        """One step's start and its forward.

        NOTE: each step begins as SGLang's does: kvcached's step hook, then the tree's ack drain.
        The forward of a step reads the KV of every running request. Under overlap scheduling it
        also reads that of the requests the previous step's results freed (``event_loop_overlap``
        launched this forward before processing them)."""
        s = self.stack
        # A copy engine makes progress: a copy queued STALL steps ago has run by now (the
        # ledger holds a pin to ending within 16 builds, I4, and a GPU copy takes microseconds).
        while self.queued_at and self.queued_at[0][0] <= self.step - STALL:
            self.run_copies(self.queued_at.pop(0)[1])
        s.engine.bridge.hold_frees = self.hold
        s.step()
        self.drain_acks()
        # Under overlap, the forward launched before the last step's results were processed
        # reads the requests those results freed; the forwards after it (which write the slots
        # anew) come after it on the stream, so it reads them first.
        for req, slots, data in self.freed_last_step if self.case.overlap else []:
            if not same(data, s.device_bytes(slots)):
                self.fail("attended-bytes", f"request {req}'s KV read by a forward is not its own")
        self.freed_last_step = []
        # This step's forward: it writes the KV of the requests that arrived, then reads all.
        for i, (req, slots, wrote) in enumerate(self.running):
            if wrote is None:
                self.running[i] = (req, slots, s.fill(slots, seed=req))
        for req, slots, wrote in self.running:
            if wrote is None or not same(wrote, s.device_bytes(slots)):
                self.fail("attended-bytes", f"request {req}'s KV read by a forward is not its own")

    def run_copies(self, upto: int) -> None:
        """The copy engine runs the queued copies up to mark ``upto``, one at a time. A backup
        the flush orphaned is checked as it runs: its bytes no longer matter to SGLang (its
        host slots were freed, its device slots may have been reused, which SGLang's stream
        order makes safe), but on a GPU a copy from an unmapped page faults."""
        s = self.stack
        bpp = s.engine.geometry.blocks_per_page
        while s.copies.ran < upto:
            for node in [n for n in self.orphans if n.copied_at == s.copies.ran + 1]:
                self.orphans.remove(node)
                assert node.slots is not None
                pages = {int(b) // bpp for b in node.slots.tolist()}
                if not all(s.engine.ledger.is_mapped(p) for p in pages):
                    self.fail("unmapped-touch", "a backup orphaned by a flush copied from a page unmapped under it")
            s.copies.run(s.copies.ran + 1)

    def drain_acks(self) -> None:
        s = self.stack
        for queue, loading in ((s.controller.ack_write_queue, False), (s.controller.ack_load_queue, True)):
            while queue and queue[0].finish_event.query():
                queue.pop(0)
                for node in self.nodes:
                    if loading and node.loading:
                        node.loading = False
                        self.loads += 1
                        if node.slots is None or not same(node.data, s.device_bytes(node.slots)):
                            self.fail("load-bytes", "a loaded node does not hold its bytes")
                    elif not loading and node.host is not None and not node.backed:
                        node.backed = True
                        self.stores += 1
                        if not same(node.data, s.host_bytes(node.host)):
                            self.fail("store-bytes", "an acknowledged backup does not hold its node's bytes")
                # SGLang merges queued ops into one ack; each of these queues held one op at a time.
                break

    def act(self, kind: str, arg: int) -> None:
        s = self.stack
        before = s.copies.queued
        self._act(kind, arg)
        if s.copies.queued > before:
            self.queued_at.append((self.step, s.copies.queued))

    def _act(self, kind: str, arg: int) -> None:
        s = self.stack
        if kind == "arrive":
            slots = s.allocator.alloc(arg)
            if slots is not None:
                self.running.append((self.next_req, slots, None))  # written by the next forward
                self.next_req += 1
        elif kind == "finish" and self.running and self.running[0][2] is not None:
            req, slots, data = self.running.pop(0)
            assert data is not None
            host = s.controller.write(slots) if arg % 2 == 0 and self._no_write_pending() else None
            if host is not None:
                node = _Node(data, slots, host)
                node.copied_at = s.copies.queued
                self.nodes.append(node)
            else:
                s.allocator.free(slots)
                self.freed_last_step.append((req, slots, data))
        elif kind == "evict":
            for node in self.nodes:
                if node.backed and node.slots is not None and not node.loading:
                    s.allocator.free_segment(node.slots, start_pos=0)
                    node.slots = None
                    break
        elif kind == "load" and not any(n.loading for n in self.nodes):
            for node in self.nodes:
                if node.slots is None and node.host is not None:
                    slots = s.controller.load(node.host)
                    if slots is not None:
                        node.slots, node.loading = slots, True
                        s.controller.start_loading()
                    break
        elif kind == "drop":
            for node in self.nodes:
                if node.slots is None and node.host is not None and not node.loading:
                    s.host.free(node.host)
                    self.nodes.remove(node)
                    break
        elif kind == "copies":
            self.run_copies(min(s.copies.queued, s.copies.ran + arg))
        elif kind == "flush" and self._idle():
            s.flush()
            # A backup still copying is SGLang's no more (the reset dropped its ack), but the copy
            # still runs (``orphans``, checked in ``run_copies``).
            self.orphans += [n for n in self.nodes if not n.backed and n.host is not None]
            self.nodes.clear()
            self.flushes += 1

    def _idle(self) -> bool:
        """``Scheduler.is_fully_idle``: nothing running, and under overlap no forward in flight
        (``last_batch`` empty, ``result_queue`` drained): not in the step a request ended in."""
        in_flight = self.case.overlap and self.freed_last_step
        return not self.running and not in_flight and not any(n.loading for n in self.nodes)

    def _no_write_pending(self) -> bool:
        # One backup at a time keeps the ack-to-node bookkeeping exact (SGLang would merge them).
        return not self.stack.controller.ack_write_queue

    def finish(self) -> None:
        s = self.stack
        self.run_copies(s.copies.queued)
        self.step += 1
        self.begin_step()
        self.step += 1
        self.begin_step()
        for v in s.engine.ledger.violations:
            self.fail("ledger", f"{v.invariant} {v.code}: {v.message}")
        left = len(s.engine.ledger.tables.jobs)  # the ledger's view: a bridge may have forgotten them
        if left:
            self.fail("leftover", f"{left} copies still pin pages")


def run_case(case: Case, variant: str) -> Result:
    """Play ``case`` under ``variant``; a crash is a finding, never an exception.

    NOTE: the two planted bugs come from ``kvcached.testing.plants``: ``no-hold`` (overlap frees
    recorded at once) and ``no-poll`` (copies whose acknowledgement a reset dropped are forgotten)."""
    with planted(*((variant,) if variant in PLANTED else ())):
        return _run_case(case, variant)


def _run_case(case: Case, variant: str) -> Result:
    run: Any = None
    try:
        run = _Run(case, variant)
        for i, actions in enumerate(case.steps):
            run.step = i
            run.begin_step()
            for kind, arg in actions:
                run.act(kind, arg)
        run.finish()
    except Exception as e:  # a crash is a finding, with where it came from
        where = traceback.extract_tb(e.__traceback__)[-1]
        failure = Failure("crash", getattr(run, "step", 0), f"{type(e).__name__}: {e} ({where.name}:{where.lineno})")
        if run is None:
            return Result(case.seed, variant, (failure,), 0, 0, 0)
        run.failures.setdefault("crash", failure)
    finally:
        if run is not None:
            run.stack.close()
    failures = tuple(run.failures[c] for c in CHECKS if c in run.failures)
    return Result(case.seed, variant, failures, run.flushes, run.stores, run.loads)
