"""kvsim: the command line of the seeded simulation in ``kvcached.vllm.testing.sim`` (``cli``)."""
