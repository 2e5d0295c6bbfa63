"""kvsim on vLLM: seeded, reproducible simulation of vLLM's real scheduler and connector over kvcached.

``draw`` turns a seed into a case (configuration and workload), ``execute`` runs it under a
variant with the memory checks of ``memory``, ``result`` says what a run found, ``shrink``
reduces a failing case. It drives vLLM through kvcached's scheduler harness
(``kvcached.vllm.testing.harness``), by its public accessors only.
"""
