"""SGLang 0.5.23 serving on a CPU without sgl-kernel, through SGLang's own plugin interface (tests only).

SGLang's CPU mode (``SGLANG_USE_CPU_ENGINE=1``) imports sgl-kernel's CPU build in about a hundred
modules, and the package index has no such build. So an out-of-tree *platform*
(``CpuOotPlatform``) keeps SGLang's layers on their torch paths, and a general plugin
(``register``) supplies what a CPU still lacks. Neither entry point is kvcached's (``dist_info``):
kvcached's own plugin loads beside them, as on a GPU machine.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from .copies import copy_slots

NAME = "kvcached-test-cpu"


class CpuOotPlatform(CpuDeviceMixin, SRTPlatform):  # type: ignore[misc]  # SGLang is untyped here
    """SGLang's CPU device operations, declared out of tree.

    NOTE: SGLang's CPU device operations (``CpuDeviceMixin``) on an out-of-tree platform keep
    ``is_cpu()`` and ``is_cuda()`` false, so the layers take their torch paths. Being out of tree
    (``is_out_of_tree``) keeps rotary embedding off vLLM's kernels
    (``layers/rotary_embedding/base.py``). Attention is SGLang's ``torch_native``.
    """

    _enum = PlatformEnum.OOT
    capabilities = PlatformCapabilities()  # no Triton, no graph capture, no HiCache device kernels

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def is_pin_memory_available(self, device: Any = None) -> bool:
        return False


def activate() -> str:
    """The ``sglang.srt.platforms`` entry point: the platform class, by name."""
    return f"{__name__}.CpuOotPlatform"


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``sgl_kernel.kvcacheio.transfer_kv_direct``, done at once (a CPU has no copy stream).

    NOTE: HiCache's copy kernel: ``pool_host/mha.py`` and ``pool_host/mla.py`` bind
    ``transfer_kv_direct`` from ``sgl_kernel.kvcacheio`` only under CUDA. A torch copy stands in
    (``direct`` io, ``layer_first``)."""
    copy_slots(src_layers, dst_layers, src_indices, dst_indices)


def _unpinned_host_pool(original: Any, pool: Any, *args: Any, **kwargs: Any) -> Any:
    """A host pool built with ``pin_memory=False``: pinned memory (``cudaHostRegister``) needs a driver."""
    if len(args) > 5:  # MHATokenToKVPoolHost(buffer_info, ratio, size, page_size, layout, pin_memory, ...)
        args = (*args[:5], False, *args[6:])
    else:
        kwargs["pin_memory"] = False
    return original(pool, *args, **kwargs)


def _absorbed_mla(attn: Any, forward_batch: Any) -> Any:
    """DeepSeek's attention method on ``torch_native``: the absorbed MLA path.

    NOTE: with no handler registered for ``torch_native``, SGLang falls back to Triton's, whose
    MHA prefill (``forward_mha.py``, ``save_kv_cache=False``) hands the backend K and V it does not
    read (``torch_native`` reads K back from the pool), and the first prefill fails on a shape.
    The absorbed MLA path (``AttnForwardMethod.MLA``), which writes the latent and attends over
    it, is registered for it."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    return AttnForwardMethod.MLA


def _no_parser_no_tokens(original: Any, parser: Any, tokenizer: Any) -> Any:
    """The detokenizer's tool-call lookup, with no parser: no tokens.

    NOTE: ``parser/response_template.tool_close_tokens`` imports the function-call parser, hence
    xgrammar, before it looks at a parser of None."""
    return {} if parser is None else original(parser, tokenizer)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point; ``load_plugins`` runs it in every SGLang process.

    NOTE: what a CPU still lacks, the general plugin supplies through ``HookRegistry``: HiCache's
    copy kernel (``transfer_kv_direct``), the host pools' pinned memory (``_unpinned_host_pool``),
    DeepSeek's attention method on ``torch_native`` (``_absorbed_mla``) and the detokenizer's
    tool-call lookup (``_no_parser_no_tokens``)."""
    from sglang.srt.mem_cache.pool_host import mha, mla
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    mha.transfer_kv_direct = transfer_kv_direct
    mla.transfer_kv_direct = transfer_kv_direct
    for host in ("mha.MHATokenToKVPoolHost", "mla.MLATokenToKVPoolHost"):
        HookRegistry.register(f"sglang.srt.mem_cache.pool_host.{host}.__init__", _unpinned_host_pool, HookType.AROUND)
    AttentionBackendRegistry.register("torch_native", _absorbed_mla)
    HookRegistry.register(
        "sglang.srt.parser.response_template.tool_close_tokens", _no_parser_no_tokens, HookType.AROUND
    )


def dist_info(folder: str) -> str:
    """Write the distribution that names this module's entry points into ``folder`` (a fresh
    directory for ``PYTHONPATH``); returns ``folder``.

    NOTE: neither entry point is kvcached's: a test writes this small distribution beside this
    module's package and puts it on the server's ``PYTHONPATH``. So SGLang discovers the
    platform (``sglang.srt.platforms``) and the plugin (``sglang.srt.plugins``) as it would a
    vendor's."""
    info = os.path.join(folder, f"{NAME.replace('-', '_')}-0.1.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "x") as f:
        f.write(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: 0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "x") as f:
        f.write(
            f"[sglang.srt.platforms]\ncpu = {__name__}:activate\n\n[sglang.srt.plugins]\ncpu = {__name__}:register\n"
        )
    return folder
