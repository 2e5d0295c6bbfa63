"""Scaffolding both engines' tests share: never imported when serving.

A served engine loads its wing (``kvcached.vllm`` or ``kvcached.sglang``), the core and the
ledger; nothing there imports a ``testing`` package (``tests/test_layout.py`` holds that line).
Here: kvcached PR #598's cases as event sequences (``seed_cases``), synthetic workloads
(``synth``), the model stand-in whose KV bytes say which token wrote them (``stand_in``), tiny
random models made on the spot (``tiny_model``: a llama; ``tiny_kinds``: every model kind of PR
#598's GPU matrix), and the one registry of planted bugs the checks must catch (``plants``).
Each engine's own scaffolding is in its wing: ``kvcached.vllm.testing`` (vLLM's real scheduler
driven on a CPU, served scenarios, the main job) and ``kvcached.sglang.testing``. It is installed
with the package because ``kvreplay demo``, ``kvreplay make`` and the benchmarks use it; the
server harness and the demo need the ``testing`` extra (psutil, rich).
"""

__all__ = ["plants", "seed_cases", "stand_in", "synth", "tiny_kinds", "tiny_model"]
