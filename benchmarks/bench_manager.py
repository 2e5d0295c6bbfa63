"""KV cache manager on the host backend: ``alloc(1)`` + ``free`` of one block, ledger events included.

Each sample allocates one block and frees it again through ``KVCacheManager`` (which emits
``BlockAlloc`` / ``BlockFree`` to the ledger, and maps or unmaps pages as the ledger allows);
a page with other blocks in use is kept mapped, so this is the steady-state cost the scheduler
pays per block, not the cost of a map. Median over ``--runs`` runs of ``--n`` pairs, pure
Python and the mypyc-compiled ledger side by side.

    python benchmarks/bench_manager.py [--runs 7] [--n 20000]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(runs: int, n: int) -> dict[str, float | str]:
    from kvcached.backends.host import HostBackend
    from kvcached.kv_cache_manager import KVCacheManager, KVGeometry
    from kvcached.ledger import ledger as ledger_mod

    geo = KVGeometry(num_blocks=8192, block_bytes=196608, page_bytes=2 << 20)
    out: dict[str, float | str] = {"ledger_module": ledger_mod.__file__}
    for policy in ("ledger", "legacy"):
        samples = []
        for _ in range(runs):
            backend = HostBackend(page_bytes=2 << 20)
            m = KVCacheManager.standalone(geo, backend, policy=policy, min_reserved=0, max_reserved=10)
            keep = m.alloc(5)  # the page stays in use: no map or unmap in the loop
            gc.collect()
            t0 = time.perf_counter()
            for _ in range(n):
                m.free(m.alloc(1))
            samples.append((time.perf_counter() - t0) / n * 1e6)
            m.free(keep)
            backend.close()
        out[f"alloc_free_us_{policy}"] = statistics.median(samples)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.runs, args.n)))
        return 0
    from _builds import builds
    from _builds import child as run_child

    with tempfile.TemporaryDirectory() as tmp:
        argv = ("--runs", str(args.runs), "--n", str(args.n))
        res = {name: run_child(path, __file__, *argv) for name, path in builds(tmp).items()}
    print(f"median of {args.runs} runs of {args.n} alloc(1)+free pairs (host backend, ledger events included)")
    print(f"{'policy':10} {'pure Python':>14} {'compiled':>14} {'budget':>8}")
    for policy in ("ledger", "legacy"):
        k = f"alloc_free_us_{policy}"
        print(f"{policy:10} {res['pure'][k]:>12.2f}us {res['compiled'][k]:>12.2f}us {'<= 5us':>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
