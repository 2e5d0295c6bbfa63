"""Where SGLang calls into kvcached: a refusal there ends the process with one line.

SGLang's plugin loader (``load_plugins``) and its scheduler process log an ``Exception`` with its
traceback (and the loader goes on), so kvcached's ``ConfigError`` is turned into a
``SystemExit`` at each place SGLang calls in (the plugin, a hook, the allocator's constructor):
they let it through, and Python prints its message alone, with the prefix vLLM's refusals have.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from ..errors import ConfigError


def refuse(e: ConfigError) -> NoReturn:
    """End the SGLang process that met ``e`` with its one line, ``[kvcached] refused: ...``."""
    raise SystemExit("[kvcached] refused: " + str(e).removeprefix("kvcached: "))


@contextmanager
def refusing() -> Iterator[None]:
    """A ``ConfigError`` raised inside ends the process with its one line (``refuse``)."""
    try:
        yield
    except ConfigError as e:
        refuse(e)
