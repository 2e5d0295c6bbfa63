"""SGLang scenarios whose journals are golden traces (``traces/sglang-*``), and the tests' steps.

``flush-under-backup``: a write-through backup is submitted (SGLang's tree backs up a node on
its first hit, ``write_through``), the server goes idle and ``/flush_cache`` resets the tree,
whose controller drops the backup's acknowledgement, and the allocator's ``clear`` frees its
slots; the copy runs after. ``legacy`` unmaps the pages at the free and the copy reads zeros
(I1); ``ledger`` keeps them until the copy is done.

    python -m kvcached.sglang.testing.scenarios --capture traces
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ...ledger.events import Policy
from ..engine import SglangConfig
from .stack import HiCacheStack

PAGE = 4096  # 64 slots of 2 heads x 8 x fp32, per page and region
SCENARIOS = ("flush-under-backup",)


def config(policy: Policy, journal_path: str | None = None) -> SglangConfig:
    """The scenarios' engine: host pages of 64 slots, no reserve, journal inline."""
    return SglangConfig(policy=policy, page_bytes=PAGE, backend="host", journal_path=journal_path)


def flush_under_backup(stack: HiCacheStack) -> tuple[dict[str, Any], dict[str, Any]]:
    """Returns the bytes written to the backed-up slots and what the copy put on the host."""
    stack.step()
    slots = stack.allocator.alloc(128)  # two whole pages of their own (WHOLE_PAGES)
    assert slots is not None
    written = stack.fill(slots, seed=1)
    host_slots = stack.controller.write(slots)  # write-through: the D->H copy is submitted, not done
    assert host_slots is not None and stack.copies.pending == 1
    stack.step()
    stack.flush()  # the server went idle: /flush_cache
    stack.step()
    stack.copies.run()  # the copy engine gets to it
    stack.step()
    return written, stack.host_bytes(host_slots)


def capture(directory: str) -> list[str]:
    """Run every scenario under both policies, journaled to ``directory/sglang-NAME.POLICY.kvj``."""
    paths = []
    for name in SCENARIOS:
        for policy in (Policy.LEGACY, Policy.LEDGER):
            path = os.path.join(directory, f"sglang-{name}.{policy.value}.kvj")
            if os.path.lexists(path):
                os.unlink(path)  # ours: a golden trace this command wrote before
            stack = HiCacheStack(config(policy, path))
            try:
                flush_under_backup(stack)
            finally:
                stack.close()
            paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capture", metavar="DIR", required=True, help="write the journals here")
    for path in capture(parser.parse_args().capture):
        print(path)


if __name__ == "__main__":
    main()
