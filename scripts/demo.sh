#!/usr/bin/env bash
# The main job: replay the seed's freed-block-copy scenarios under legacy and ledger.
source "$(dirname "$0")/_env.sh"
exec .venv/bin/kvreplay demo "$@"
