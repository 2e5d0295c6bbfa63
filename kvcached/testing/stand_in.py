"""The model stand-in of the real-vLLM harness: KV bytes that say which token wrote them.

A freed-block copy is only visible as wrong bytes, so what the stand-in writes into a KV slot
must be a function of everything a real model's KV depends on (``ModelStandIn.kv_bytes``): the
whole token prefix (a request that reuses another's prefix expects the same bytes, as a real
model would produce), the KV group, the layer and the tensor-parallel rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

__all__ = ["ModelStandIn", "Row"]


@dataclass(frozen=True)
class Row:
    """One request of a step, as the model runner gets it when the step is scheduled."""

    req_id: str
    start: int  # first token position the step computes
    end: int
    block_ids: tuple[list[int], ...]  # per KV group
    samples: bool  # the step ends at the request's known tokens, so it samples the next one


class ModelStandIn:
    """The stand-in for the model: what it writes and what it samples follow from the tokens.

    NOTE: the stand-in keeps each request's tokens as the model runner knows them: under async
    scheduling that includes tokens it sampled before the scheduler has processed the step's
    output.
    """

    def __init__(
        self,
        block_size: int,
        page_bytes: int | Sequence[int],
        vocab_size: int,
        *,
        state_groups: Collection[int] = (),
    ) -> None:
        """``page_bytes``: the bytes of one layer's page the model writes, one for every group or
        per group; ``state_groups``: the groups whose blocks hold a state, not token slots."""
        self.block_size = block_size
        self._page_bytes = page_bytes
        self.state_groups = frozenset(state_groups)
        self.vocab_size = vocab_size
        self._tokens: dict[str, list[int]] = {}
        self._prefix_hashes: dict[str, list[bytes]] = {}

    def prompt(self, length: int, seed: int) -> list[int]:
        h = hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=32).digest()
        out: list[int] = []
        while len(out) < length:
            h = hashlib.blake2b(h, digest_size=32).digest()
            out.extend(self._token(h[i : i + 2]) for i in range(0, 32, 2))
        return out[:length]

    def add(self, req_id: str, prompt: Sequence[int]) -> None:
        self._tokens[req_id] = list(prompt)
        self._prefix_hashes.pop(req_id, None)  # a request id may be used again

    @staticmethod
    def _chain(prev: bytes, token: int) -> bytes:
        return hashlib.blake2b(prev + int(token).to_bytes(4, "little"), digest_size=16).digest()

    def _token(self, digest: bytes) -> int:
        """A token id other than 0 from hash bytes."""
        return 1 + int.from_bytes(digest, "little") % (self.vocab_size - 1)

    def prefix_hashes(self, req_id: str, upto: int) -> list[bytes]:
        """Prefix hashes h[p] of the request's tokens [0, p], so KV depends on the whole prefix."""
        tokens = self._tokens[req_id]
        hs = self._prefix_hashes.setdefault(req_id, [])
        prev = hs[-1] if hs else b""
        for p in range(len(hs), min(upto, len(tokens))):
            prev = self._chain(prev, tokens[p])
            hs.append(prev)
        return hs

    def continuation(self, prompt: Sequence[int], n: int) -> list[int]:
        """The ``n`` tokens a request with ``prompt`` samples (to pick a stop token, say)."""
        prev = b""
        for t in prompt:
            prev = self._chain(prev, t)
        out: list[int] = []
        for _ in range(n):
            out.append(self._token(prev[:4]))
            prev = self._chain(prev, out[-1])
        return out

    def page_bytes(self, group: int) -> int:
        """The bytes of one layer's page that the model writes in ``group``."""
        p = self._page_bytes
        return p if isinstance(p, int) else p[group]

    def token_bytes(self, group: int) -> int:
        """One token's slot in one layer's block of an attention group."""
        return self.page_bytes(group) // self.block_size

    def kv_bytes(self, req_id: str, position: int, group: int, layer: int, rank: int) -> bytes:
        """What the stand-in writes for one token slot of one layer on one rank; in a state
        group, the whole state after the prefix that ends at ``position``."""
        h = self.prefix_hashes(req_id, position + 1)[position]
        if group in self.state_groups:
            return hashlib.shake_128(h + bytes((group, layer, rank, 255))).digest(self.page_bytes(group))
        return hashlib.shake_128(h + bytes((group, layer, rank))).digest(self.token_bytes(group))

    def expected_block(self, req_id: str, k: int, n: int, group: int, layer: int, rank: int) -> bytes:
        """What block ``k`` of the request holds in one layer once ``n`` of its tokens are
        computed: their slots, or in a state group the state after token ``k * bs + n - 1``."""
        start = k * self.block_size
        if group in self.state_groups:
            return self.kv_bytes(req_id, start + n - 1, group, layer, rank)
        return b"".join(self.kv_bytes(req_id, p, group, layer, rank) for p in range(start, start + n))

    def bad_positions(
        self, got: bytes, req_id: str, k: int, n: int, group: int, layer: int, rank: int
    ) -> tuple[int, ...]:
        """The token positions of block ``k`` (its first ``n``) whose bytes in ``got`` are wrong;
        in a state group the state's last position, if the state is wrong."""
        start = k * self.block_size
        if group in self.state_groups:
            want = self.expected_block(req_id, k, n, group, layer, rank)
            return () if got[: len(want)] == want else (start + n - 1,)
        tb = self.token_bytes(group)
        return tuple(
            start + s
            for s in range(n)
            if got[s * tb : (s + 1) * tb] != self.kv_bytes(req_id, start + s, group, layer, rank)
        )

    def forward(self, rows: Sequence[Row], views: Sequence[Sequence[torch.Tensor]], rank: int) -> None:
        """Write every computed token's bytes into its block; ``views[group][layer]`` is
        (num_blocks, block bytes of one layer).

        NOTE: a state group (a Mamba / linear-attention group, vLLM's ``MambaSpec``) holds no
        tokens: a block holds the recurrent state after a prefix. So the stand-in writes, into the
        block of the step's last position (``cdiv(end, block_size) - 1``, where vLLM's "align" mode
        keeps the running state), bytes that name the whole prefix up to ``end``. It writes them
        over the state's real bytes, not the padding vLLM adds to reach the attention page, which
        the offloading worker does not copy either."""
        bs = self.block_size
        for row in rows:
            for g, ids in enumerate(row.block_ids):
                if g in self.state_groups:
                    # The state after the step's last token, in its block (vLLM's align mode
                    # copies the previous state forward and updates it in place there).
                    k = -(-row.end // bs) - 1
                    if row.end > row.start and 0 <= k < len(ids) and ids[k] != 0:
                        for layer, view in enumerate(views[g]):
                            data = self.kv_bytes(row.req_id, row.end - 1, g, layer, rank)
                            view[ids[k], : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.int8)
                    continue
                tb = self.token_bytes(g)
                p = row.start
                while p < row.end:
                    k = p // bs
                    stop = min(row.end, (k + 1) * bs)
                    if k < len(ids) and ids[k] != 0:
                        for layer, view in enumerate(views[g]):
                            data = b"".join(self.kv_bytes(row.req_id, q, g, layer, rank) for q in range(p, stop))
                            view[ids[k], (p % bs) * tb : (p % bs) * tb + len(data)] = torch.frombuffer(
                                bytearray(data), dtype=torch.int8
                            )
                    p = stop

    def sample(self, rows: Sequence[Row]) -> dict[str, list[int]]:
        """The token each sampling row samples, by request.

        NOTE: sampling is a function of the prefix too, so a request recomputed after a
        preemption samples the same token again."""
        out: dict[str, list[int]] = {}
        for row in (r for r in rows if r.samples):
            tokens = self._tokens[row.req_id]
            if row.end > len(tokens):
                raise RuntimeError(f"stand-in: {row.req_id} computed up to {row.end}, knows {len(tokens)} tokens")
            token = self._token(self.prefix_hashes(row.req_id, row.end)[row.end - 1][:4])
            if row.end == len(tokens):
                tokens.append(token)
            elif tokens[row.end] != token:  # recomputed after a preemption: the same prefix, the same token
                raise RuntimeError(f"stand-in: {row.req_id} sampled {token} at {row.end}, earlier {tokens[row.end]}")
            out[row.req_id] = [token]
        return out
