#!/usr/bin/env bash
# The test suite: installs what the tests need into .venv, then runs them (GPU tests skip
# without a GPU). Extra arguments go to pytest.
source "$(dirname "$0")/_env.sh"
exec .venv/bin/python -m pytest -q "$@"
