"""Test-wide setup: say which ledger build is under test, and refuse a silent fallback."""

from __future__ import annotations

import os

import pytest

from kvcached.ledger import ledger as _ledger

COMPILED = _ledger.__file__.endswith((".so", ".pyd"))


def pytest_report_header() -> str:
    return f"kvcached ledger: {'compiled (mypyc)' if COMPILED else 'pure Python'} from {_ledger.__file__}"


@pytest.fixture(autouse=True, scope="session")
def _expected_build() -> None:
    if os.environ.get("KVCACHED_EXPECT_COMPILED") == "1" and not COMPILED:
        pytest.fail("KVCACHED_EXPECT_COMPILED=1 but the pure-Python ledger was imported", pytrace=False)
