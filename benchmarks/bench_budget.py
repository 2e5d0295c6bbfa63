"""What a shared budget costs an engine: its file operations and a scheduler call under it.

Two figures, each measured for this work tree and for a reference commit (default: the one
before strict grants) side by side in one run, each in a child process whose
``PYTHONPATH`` is that tree's ``kvcached`` (the reference is checked out with ``git worktree``
into a temporary folder):

* a grant and a release of one page's bytes (``try_acquire`` + ``release``) with four engines
  on the budget, in microseconds per pair, on tmpfs (``/dev/shm``);
* a decode-shaped scheduler call on a manager: the free-block count asked once per running
  request (64), one request's block allocated, one request's block freed, the build boundary
  and the call's drain, with and without a budget; the difference is what the budget adds to a
  call. Before, the count read the budget's headroom (a locked read, at most every 5 ms) and
  a page the count promised could be mapped over the budget's size; now the count leases what
  it promises and the drain gives back the rest.

    .venv/bin/python benchmarks/bench_budget.py [--ref COMMIT] [--calls 4000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REF = "a90ffd1"  # before strict grants and in-place budget writes

CHILD = textwrap.dedent(
    """
    import json, os, sys, tempfile, time
    from kvcached.backends.host import HostBackend
    from kvcached.budget import Budget
    from kvcached.kv_cache_manager import KVCacheManager, KVGeometry
    from kvcached.ledger.events import BuildBoundary

    calls = int(sys.argv[1])
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = tempfile.mkdtemp(dir=base)
    os.chmod(d, 0o700)
    PAGE = 64 * 1024
    b = Budget.open("bench", 1 << 40, directory=d)
    others = [Budget.open("bench", None, directory=d) for _ in range(3)]
    t = time.perf_counter()
    for _ in range(calls):
        b.try_acquire(PAGE)
        b.release(PAGE)
    pair = (time.perf_counter() - t) / calls * 1e6

    def step_cost(budget):
        geo = KVGeometry(num_blocks=4096, block_bytes=PAGE // 16, page_bytes=PAGE)
        m = KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE), budget=budget)
        running = [m.alloc(1) for _ in range(64)]
        best = float("inf")
        for rep in range(3):
            t = time.perf_counter()
            for i in range(calls):
                for _ in range(64):  # vLLM's allocate_slots asks once per running request
                    m.available_size()
                running.append(m.alloc(1))
                m.free(running.pop(0))
                m.recorder.emit(BuildBoundary(rep * calls + i))
                m.drain_releasable()
            best = min(best, (time.perf_counter() - t) / calls * 1e6)
        m.backend.close()
        return best

    alone = step_cost(None)
    shared = step_cost(b)
    print(json.dumps({"pair_us": pair, "call_us": alone, "call_budget_us": shared}))
    """
)


def measure(tree: str, calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run(
        [sys.executable, "-P", "-c", CHILD, str(calls)], env=env, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise SystemExit(f"bench_budget: the child for {tree} failed: {out.stderr.strip().splitlines()[-1:]}")
    result: dict[str, float] = json.loads(out.stdout)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default=REF, help=f"the commit to compare with (default {REF})")
    ap.add_argument("--calls", type=int, default=4000)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-budget-")
    ref_tree = os.path.join(tmp, "ref")
    try:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", ref_tree, args.ref],
            check=True,
            capture_output=True,
        )
        rows = {f"ref {args.ref}": measure(ref_tree, args.calls), "this tree": measure(str(ROOT), args.calls)}
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", ref_tree], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print("| code | grant + release, us | call alone, us | call under a budget, us | budget adds, us |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in rows.items():
        added = r["call_budget_us"] - r["call_us"]
        print(f"| {name} | {r['pair_us']:.1f} | {r['call_us']:.1f} | {r['call_budget_us']:.1f} | {added:.1f} |")


if __name__ == "__main__":
    main()
