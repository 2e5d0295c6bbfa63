"""kvsim: seeded, reproducible simulation of vLLM's real scheduler and connector over kvcached.

Scaffolding (``kvcached.vllm.testing``): never imported by a served process. ``draw`` turns a seed
into a case (configuration and workload), ``execute`` runs it under a variant with the memory
checks of ``memory``, ``result`` says what a run found, ``shrink`` reduces a failing case; the
``kvsim`` command that runs them is ``tools/kvsim/cli.py``.
"""
