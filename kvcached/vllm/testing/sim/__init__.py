"""kvsim: seeded, reproducible simulation of vLLM's real scheduler and connector over kvcached.

Scaffolding (``kvcached.testing``): never imported by a served process. ``draw`` turns a seed
into a case (configuration and workload), ``execute`` runs it under a variant with the memory
checks of ``memory``, ``shrink`` reduces a failing case, ``cli`` is the ``kvsim`` command.
"""
