"""kvcached's SGLang engine on CUDA pages: a HiCache backup whose copy runs after the flush, on a GPU.

The flush under a write-through backup (``kvcached.sglang.testing.scenarios``) with what a GPU
adds: the per-layer K and V tensors are bf16 views over the CUDA VMM range (``SglangEngine.buffers``,
which SGLang's ``set_kv_buffer`` writes by slot index), the copy is a real asynchronous
device-to-host copy into pinned memory on a side stream, held back behind a spin kernel
(``torch.cuda._sleep``) so that it runs after the flush, and its finish event is a
``torch.cuda.Event``, which the bridge polls as it polls SGLang's (``Bridge.poll``, ``query()``).

The GPU image has no SGLang (and no network to install it), so the pool is described by the fields
SGLang's ``MHATokenToKVPool`` gives kvcached's hook and the transfer by ``L2TransferEngine``'s
(``device_pool``, ``device_indices``); the rest is kvcached's SGLang engine as a server runs it.
Under ``ledger`` the pages stay mapped while the copy is pending and the host gets the bytes
written; under ``legacy`` the flush unmaps them under the copy (I1), and the copy reads the zero
page unless the driver's unmap waited for it (printed either way). Needs msgspec and anyio
(``scripts/gpu_check.sh`` installs the carried wheels).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from gpu_env import free_bytes, require_gpu

torch = require_gpu()
pytestmark = pytest.mark.gpu

from kvcached.ledger.events import JobKind, Policy  # noqa: E402
from kvcached.sglang import engine as sglang_engine  # noqa: E402

MiB = 1 << 20
LAYERS, HEADS, HEAD_DIM = 2, 8, 128  # 2 KiB a slot per region in bf16: 1,024 slots a 2 MiB page
SLOTS = 2048  # two pages of their own


def _pool() -> SimpleNamespace:
    return SimpleNamespace(
        size=4 * 1024 - 1,  # slot 0 is SGLang's padding slot: 4 pages in all
        page_size=1,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        v_head_dim=HEAD_DIM,
        store_dtype=torch.bfloat16,
        layer_num=LAYERS,
        kv_cache_layout="nhd",
    )


@pytest.mark.parametrize("policy", [Policy.LEGACY, Policy.LEDGER])
def test_flush_under_a_pending_backup_on_gpu(policy: Policy, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_engine, "sglang_version", lambda: "absent (GPU image)")
    before = free_bytes()
    pool = _pool()
    engine = sglang_engine.SglangEngine(
        pool, sglang_engine.SglangConfig(policy=policy, page_bytes=2 * MiB, backend="cuda")
    )
    bridge, manager = engine.bridge, engine.manager
    try:
        k, v = engine.buffers(torch.bfloat16, pool.size + 1, (HEADS, HEAD_DIM))
        assert k[0].is_cuda and k[0].shape == (pool.size + 1, HEADS, HEAD_DIM)
        bridge.step()
        slots = manager.alloc(SLOTS)
        bridge.step_done()
        index = torch.tensor(slots, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(1)
        written = []
        for buf in (*k, *v):  # the forward pass writes the request's KV (set_kv_buffer)
            data = torch.randn((SLOTS, HEADS, HEAD_DIM), generator=g, device="cuda").to(torch.bfloat16)
            buf[index] = data
            written.append(data.cpu())
        host = [torch.empty((SLOTS, HEADS, HEAD_DIM), dtype=torch.bfloat16, pin_memory=True) for _ in written]
        # HiCache's write-through backup: a copy on its own stream, after the forward's writes,
        # held back by a spin so that it reads the slots after the flush.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # about a second of spinning on one SM
            for src, dst in zip((*k, *v), host, strict=True):
                dst.copy_(src[index], non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        transfer = SimpleNamespace(device_pool=pool, device_indices=index)
        bridge.submitted(JobKind.STORE, [transfer], SimpleNamespace(finish_event=done))
        mapped = manager.state().mapped
        # /flush_cache: HiCacheController.reset drops the ack; the allocator's clear frees the slots.
        bridge.step()
        bridge.cache_reset()
        bridge.free(slots)
        bridge.step_done()
        bridge.step()
        assert not done.query(), "the copy ran before the flush: lengthen the spin"
        at_flush = manager.state().mapped
        torch.cuda.synchronize()  # the copy engine gets to it
        bridge.step()  # the poll sees the event done; the pins end; the pages may go
        bridge.step_done()
        after = manager.state().mapped
        same = all(torch.equal(h, w) for h, w in zip(host, written, strict=True))
        zeros = all(int(h.count_nonzero()) == 0 for h in host)
        codes = sorted({x.code for x in engine.ledger.violations})
        print(
            f"{policy.value}: pages mapped {mapped} -> {at_flush} at the flush -> {after} after the copy; "
            f"the copy read {'the bytes written' if same else 'zeros' if zeros else 'other bytes'}; violations {codes}"
        )
        if policy is Policy.LEDGER:
            assert same and codes == []
            assert at_flush == mapped, "the pinned pages stayed mapped while the copy was pending"
            assert after == 1, "once the copy was done, only the padding page is left"
        else:
            assert "unmap-under-job" in codes, codes  # I1
            assert at_flush == 1, "legacy unmapped the emptied pages at the flush"
    finally:
        engine.close()
    assert free_bytes() >= before - 2 * MiB, "device memory left behind"
