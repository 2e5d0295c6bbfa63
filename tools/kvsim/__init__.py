"""kvsim: seeded simulation of the real engines' schedulers over kvcached, with faults.

``cli`` is the command; ``on_vllm`` runs vLLM's real scheduler and connector (through kvcached's
scheduler harness), ``on_sglang`` SGLang's real pool, allocator and HiCache. A tool, never
imported by a served process.
"""
