"""Scaffolding for tests, benchmarks, ``kvreplay demo`` and the main job: never imported when serving.

A ``vllm serve`` process loads ``kvcached.vllm``, ``kvcached.vllm.engine_core``, the core and the
ledger; nothing there imports this package (``tests/test_layout.py`` holds that line). What
lives here drives vLLM's real ``Scheduler`` and ``OffloadingConnector`` with a model stand-in
(``harness``, ``stand_in``, ``vllm_scenarios``), builds kvcached PR #598's cases as event sequences
(``seed_cases``) and synthetic workloads (``synth``), and starts real servers of a tiny llama
for the end-to-end tests and the demo (``tiny_model``, ``e2e``, ``demo``). It is installed
with the package because ``kvreplay demo``, ``kvreplay make`` and the benchmarks use it; the
server harness and the demo need the ``testing`` extra (psutil, rich).
"""
