"""Test and demo scaffolding for kvcached under SGLang; a server never imports it.

``stack`` (one SGLang KV stack with HiCache on kvcached), ``copies`` (HiCache's copy engine on a
CPU), ``scenarios`` (the freed-copy cases on it; kvsim, in ``tools/kvsim``, drives it too),
``serve`` and ``server`` (SGLang serving here), ``cpu_platform`` (SGLang's CPU device
operations as an out-of-tree platform), ``mixed`` (an SGLang server beside ``vllm serve`` on one
budget).
"""

from __future__ import annotations

__all__ = ["copies", "cpu_platform", "gpu_only", "mixed", "scenarios", "serve", "server", "stack"]


def gpu_only() -> str | None:
    """Why this SGLang cannot place pages or run a model on a CPU, or None where it can.

    NOTE: SGLang 0.5.22 added platform capabilities (``sglang.srt.platforms.interface.
    PlatformCapabilities``, ``supports_triton``); before it, the paged allocator's
    ``alloc_extend`` / ``alloc_decode`` and the model layers launch Triton kernels unconditionally,
    and Triton has no CPU driver.
    """
    from sglang.srt.platforms import interface

    if hasattr(interface, "PlatformCapabilities"):
        return None
    from ..engine import sglang_version

    return (
        f"SGLang {sglang_version()} runs Triton kernels unconditionally in its paged allocator and its layers "
        "(platform capabilities came in 0.5.22): a GPU runs this, not this CPU"
    )
