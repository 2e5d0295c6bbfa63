"""kvsim's checks on memory itself: bytes attended, stored and loaded, and pages touched.

The ledger checks its own events; these checks look at what the KV memory holds, so they also
catch what the events do not say (a vLLM bug that stores the wrong block, a pool that hands out
a block on an unmapped page). ``MemoryChecks`` hooks three places of the real-vLLM harness, all
on the worker side, where a real GPU would touch memory: the model stand-in's forward
(``_forward``), and each worker's copy function before a store and after a load (``_copy``). A
block touched there must be on a mapped page (``_touch``) and hold, token by token, the bytes the
stand-in writes for its request's prefix (``_verify``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from kvcached.backends.host import HostBackend
from kvcached.testing.stand_in import Row
from kvcached.vllm.testing.harness import Harness
from kvsim.on_vllm.result import Findings


class MemoryChecks:
    """The memory checks of one harness; with ``backends`` None, pages are not checked, only bytes."""

    def __init__(self, h: Harness, backends: Sequence[HostBackend] | None, findings: Findings) -> None:
        self.h = h
        self.backends = list(backends) if backends is not None else None
        self.f = findings
        self.bs = h.block_size
        self.block_bytes = h.block_bytes
        self.states = h.state_groups
        self.tb = [h.model.token_bytes(g) for g in range(len(h.group_layer_names))]  # a token's slot, per group
        self.expected: dict[tuple[bytes, int, int, int], bytes] = {}
        self.verified: dict[tuple[int, int, int], tuple[int, int, bytes, int]] = {}
        self.gen: dict[tuple[int, int], int] = {}  # (rank, block) -> writes seen
        self.page_gen: dict[tuple[int, int], int] = {}  # (rank, page) -> maps and unmaps seen
        self.bytes_checked = 0
        model = h.model
        orig_forward = model.forward
        model.forward = functools.partial(self._forward, orig_forward)  # type: ignore[method-assign]
        for rank, worker in enumerate(h.transfer_workers):
            worker.copy_fn = functools.partial(self._copy, rank, worker.copy_fn)
        if self.backends is not None:
            for rank, b in enumerate(self.backends):
                for name in ("map_page", "unmap_page"):
                    setattr(b, name, functools.partial(self._page_event, rank, getattr(b, name)))

    # --- hooks --------------------------------------------------------------------------------

    def _page_event(self, rank: int, orig: Callable[[int], None], index: int) -> None:
        orig(index)
        self.page_gen[(rank, index)] = self.page_gen.get((rank, index), 0) + 1

    def _forward(self, orig: Callable[..., None], rows: Sequence[Row], views: Any, rank: int) -> None:
        """The model stand-in's forward, checked.

        NOTE: every block a step writes, and then every block each scheduled request attends to,
        must be on a mapped page and hold, token by token, the bytes the stand-in writes for that
        request's prefix. A request attends to every non-null block of its table up to the step's
        end: its own earlier tokens, prefix-cache hits and loaded blocks alike. A sliding-window
        group is attended within its table's non-null blocks. A state group's block holds the state
        after its last computed token (``_verify``), so the forward reads one block, the state its
        step starts from (``cdiv(start, bs) - 1``), checked before the forward overwrites it."""
        step, bs = self.h.executing_step, self.bs
        written = []
        for row in rows:
            for g, ids in enumerate(row.block_ids):
                last = -(-row.end // bs)
                first = last - 1 if g in self.states else row.start // bs  # a state: its one block
                for k in range(first, last):
                    if k < len(ids) and ids[k]:
                        written.append(ids[k])
                        self._touch(rank, ids[k], step, row.req_id, "the forward writes it")
                if g in self.states and row.start > 0:  # the state the step starts from, before it is updated
                    k = -(-row.start // bs) - 1
                    b = ids[k] if k < len(ids) else 0
                    if b and self._touch(rank, b, step, row.req_id, "the state update reads it"):
                        self._verify(rank, g, b, row.req_id, k, row.start - k * bs, "attended-bytes", step)
        orig(rows, views, rank)
        for b in written:
            self.gen[(rank, b)] = self.gen.get((rank, b), 0) + 1
        for row in rows:  # what attention reads: the whole table up to the step's end
            for g, ids in enumerate(row.block_ids):
                if g in self.states:
                    continue
                for k in range(min(len(ids), -(-row.end // bs))):
                    b = ids[k]
                    if b and self._touch(rank, b, step, row.req_id, "attention reads it"):
                        self._verify(rank, g, b, row.req_id, k, min(bs, row.end - k * bs), "attended-bytes", step)

    def _copy(self, rank: int, orig: Callable[..., None], plan: Any, dev: Any, host: Any) -> None:
        """A worker's copy function, checked.

        NOTE: before a store copies, the blocks it names must be on mapped pages and hold the
        job's request's KV for the block positions it names (a store of another request's block
        puts foreign KV under this request's key). After a load copies, the blocks it wrote hold
        the request's KV."""
        step = self.h.executing_step
        req = self.h.job_request(plan.job_id)
        spec = plan.device_spec
        kind = "store" if plan.is_store else "load"
        blocks: list[tuple[int, int, int]] = []  # (group, block index in the request, block id)
        ids = [int(b) for b in spec.block_ids]
        positions = self.h.store_positions.get(plan.job_id) if plan.is_store else None
        if positions is not None and len(positions) == len(ids):
            # A store may skip chunks the CPU tier already holds: each block's position is that
            # of the chunk whose key it is stored under, not ``block_indices`` plus its rank. The
            # block is the one the copy reads (the worker's spec), not the scheduler's record.
            blocks = [(g, k, b) for (g, k, _), b in zip(positions, ids, strict=True)]
        else:
            off = 0
            for g, (n, first) in enumerate(zip(spec.group_sizes, spec.block_indices, strict=True)):
                blocks += [(g, int(first) + i, ids[off + i]) for i in range(int(n))]
                off += int(n)
        reachable = [self._touch(rank, b, step, req, f"{kind} job {plan.job_id} copies it") for _, _, b in blocks]
        if plan.is_store and req is not None:
            for (g, k, b), ok in zip(blocks, reachable, strict=True):
                if ok or self.backends is not None:  # exposed: reads zeros, as unchecked memory would
                    self._verify(rank, g, b, req, k, self.bs, "store-bytes", step, job=plan.job_id)
        orig(plan, dev, host)
        if not plan.is_store:
            for _, _, b in blocks:
                self.gen[(rank, b)] = self.gen.get((rank, b), 0) + 1
            if req is not None:
                for g, k, b in blocks:
                    self._verify(rank, g, b, req, k, self.bs, "load-bytes", step, job=plan.job_id)

    # --- the checks ---------------------------------------------------------------------------

    def _touch(self, rank: int, block: int, step: int, req: str | None, what: str) -> bool:
        """Whether the block is on mapped pages; if not, record it and expose the pages.

        NOTE: pages are asked through the host backend's checking mode (``HostBackend.unmapped_in``):
        an unmapped page is ``PROT_NONE`` there, so an access the checks did not announce kills the
        run with SIGSEGV rather than reading zeros. A detected access is recorded and the page
        exposed, so the run goes on as an unchecked backend would (reading zeros), and the byte
        checks see that too."""
        if self.backends is None:
            return True
        backend = self.backends[rank]
        bad = backend.unmapped_in(block * self.block_bytes, self.block_bytes)
        if not bad:
            return True
        self.f.fail(
            "unmapped-touch",
            step,
            f"block {block} on unmapped page {bad[0]} (rank {rank}): {what}",
            block=block,
            request=req,
        )
        for p in bad:
            backend.expose(p)
        return False

    def _page_of(self, rank: int, block: int) -> int:
        if self.backends is None:
            return 0
        page: int = block * self.block_bytes // self.backends[rank].page_bytes
        return page

    def _verify(
        self, rank: int, g: int, block: int, req: str, k: int, n: int, check: str, step: int, job: int | None = None
    ) -> bool:
        """Tokens ``k*bs .. k*bs+n-1`` of ``req`` in ``block`` hold the stand-in's bytes.

        NOTE: per KV group, by its kind. An attention group's block holds token slots (MLA's slot
        is one 1,152-byte latent). A state group's block (vLLM's ``MambaSpec``, "align" mode) holds
        the state after its last computed token, so a stored or loaded state block ``k`` must hold
        the state after token ``(k + 1) * bs - 1``. Only the state's real bytes count: vLLM pads
        the page to the attention page, and the offloading worker copies the unpadded bytes.

        NOTE: a block verified once is not hashed again until it is written (forward or load) or
        its page is mapped or unmapped, which keeps a seed to about a second."""
        if n <= 0:
            return True
        model = self.h.model
        start = k * self.bs
        hs = model.prefix_hashes(req, start + n)
        if len(hs) < start + n:  # the model runner does not know these tokens: nothing to compare
            return True
        page = self._page_of(rank, block)
        stamp = (self.gen.get((rank, block), 0), self.page_gen.get((rank, page), 0), hs[start + n - 1], n)
        key = (rank, g, block)
        if self.verified.get(key) == stamp:
            return True
        tb, state = self.tb[g], g in self.states
        for layer, view in enumerate(self.h.layer_views(rank, g)):
            if state:  # the state after the block's last computed token
                last = start + n - 1
                want = self._expected(req, last, hs[last], g, layer, rank)
                got = view[block].numpy().tobytes()[: len(want)]
            else:
                got = view[block].numpy().tobytes()[: n * tb]
                want = b"".join(self._expected(req, p, hs[p], g, layer, rank) for p in range(start, start + n))
            self.bytes_checked += len(want)
            if got != want:
                bad = (
                    n - 1
                    if state
                    else next(i for i in range(n) if got[i * tb : (i + 1) * tb] != want[i * tb : (i + 1) * tb])
                )
                who = f"{'store' if check == 'store-bytes' else 'load'} job {job}: " if job is not None else ""
                zero = " (all zeros)" if not any(got) else ""
                self.f.fail(
                    check,
                    step,
                    f"{who}block {block} (rank {rank}, group {g}, layer {layer}) holds wrong bytes{zero} for token "
                    f"{start + bad} of request {req} (block index {k})",
                    block=block,
                    request=req,
                )
                self.verified.pop(key, None)
                return False
        self.verified[key] = stamp
        return True

    def _expected(self, req: str, p: int, h: bytes, g: int, layer: int, rank: int) -> bytes:
        """The bytes of token ``p``, memoized by its prefix hash, group, layer and rank."""
        key = (h, g, layer, rank)  # the bytes depend on the prefix, not on the request
        out = self.expected.get(key)
        if out is None:
            out = self.h.model.kv_bytes(req, p, g, layer, rank)
            self.expected[key] = out
        return out
