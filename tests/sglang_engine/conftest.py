"""What the SGLang wing's tests share: the HiCache stacks a test builds, closed after it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from kvcached.sglang.testing.stack import HiCacheStack


@pytest.fixture
def stacks() -> Iterator[list[HiCacheStack]]:
    made: list[HiCacheStack] = []
    yield made
    for s in made:
        s.close()
