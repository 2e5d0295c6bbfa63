#!/usr/bin/env bash
# The main job: replay a golden trace captured from vLLM 0.33.0's real scheduler and
# OffloadingConnector (a one-token request whose KV store is submitted after its blocks were
# freed), once as kvcached behaved before the offloading pins (legacy) and once with them
# (ledger): the first shows the freed-block copy, the second is clean.
source "$(dirname "$0")/_env.sh"
trace=${1:-finish-in-write-step}
echo "== $trace, captured under legacy (unmap a page as soon as it is empty):"
.venv/bin/kvreplay check "traces/$trace.legacy.kvj" --limit 1 && { echo "expected a violation under legacy" >&2; exit 1; }
echo
echo "== the same scenario captured under ledger (pages stay mapped while a copy may read them):"
.venv/bin/kvreplay check "traces/$trace.ledger.kvj"
echo
echo "== the legacy run's inputs replayed under both policies, side by side:"
.venv/bin/kvreplay compare "traces/$trace.legacy.kvj"
