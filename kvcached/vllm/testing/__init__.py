"""vLLM's scaffolding: its real scheduler and connector driven on a CPU, and real servers.

``harness`` drives one real ``Scheduler`` with the real ``OffloadingConnector``, moving real
bytes (``records``: what it is configured with and records; ``host_engine``: kvcached under it
on host backends; ``kv_specs``: the model kinds it lays out); ``scenarios`` runs kvcached PR
#598's freed-block-copy cases on it (kvsim, in ``tools/kvsim``, drives it too). ``e2e`` starts
real ``vllm serve`` processes of a tiny model; ``demo`` is the
main job, ``elastic`` two engines on one budget, ``nodes`` two nodes on one machine,
``late_rank`` an offloading spec whose second rank acknowledges late, ``live_engine`` one
engine's ledger socket and ``LiveControl`` over a real manager (what kvctl and the HTTP routes
reach). Never imported by a served process.
"""

__all__ = [
    "demo",
    "e2e",
    "elastic",
    "harness",
    "host_engine",
    "kv_specs",
    "late_rank",
    "live_engine",
    "nodes",
    "records",
    "scenarios",
]
