#!/usr/bin/env bash
# The test suite: installs what the tests need into .venv, runs every test (GPU tests skip
# without a GPU), then runs the ledger's tests again against the mypyc-compiled ledger, which
# is what `pip install kvcached` ships. Extra arguments go to the first pytest run.
source "$(dirname "$0")/_env.sh"
.venv/bin/python -m pytest -q "$@"
echo "--- the ledger's tests against the mypyc-compiled ledger"
bash scripts/build-compiled.sh .venv/compiled
KVCACHED_EXPECT_COMPILED=1 PYTHONPATH=.venv/compiled .venv/bin/python -P -m pytest -q -p no:cacheprovider \
    tests/test_ledger.py tests/test_ledger_model.py tests/test_journal.py
