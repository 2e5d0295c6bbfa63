"""Build hook: compile the ledger's hot path with mypyc where a compiler is available.

The ledger sits on vLLM's scheduler thread; compiled, ``apply`` runs about 2x faster than
under CPython (figures in the README). The compiled modules are built from the very same
typed source, so there is one ledger, not two. ``KVCACHED_MYPYC=0`` builds pure Python (the
README's test command does this for its editable install, so that an edited ``ledger.py`` is
what runs); a failed compile falls back to pure Python with a warning.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup

# ledger.py's hot handlers read the tables as native attributes only if tables.py is compiled
# with them; queries.py is the ledger's base class, so it is compiled with it too.
COMPILED = [
    "kvcached/ledger/ledger.py",
    "kvcached/ledger/checks.py",
    "kvcached/ledger/tables.py",
    "kvcached/ledger/queries.py",
]


def _ext_modules() -> list[object]:
    if os.environ.get("KVCACHED_MYPYC", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify

        return list(mypycify(COMPILED, opt_level="3"))
    except Exception as exc:  # no compiler or no mypyc: the pure-Python ledger is complete
        print(f"kvcached: building the pure-Python ledger ({exc})", file=sys.stderr)
        return []


setup(ext_modules=_ext_modules())
