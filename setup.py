"""Build hook: compile the ledger and what runs on vLLM's scheduler step with mypyc where a
compiler is available (the list is ``kvcached.ledger.compiled.COMPILED_MODULES``).

The ledger, the manager, the page-aware pool and the bridge sit on vLLM's scheduler thread;
compiled, the ledger's ``apply`` runs 3-5x faster than under CPython and kvcached's share of
the scheduler step falls by about half (figures in the README). The compiled modules are built
from the very same typed source, so there is one ledger, not two. ``KVCACHED_MYPYC=0`` builds
pure Python (the README's test command does this for its editable install, so that an edited
``ledger.py`` is what runs); a failed compile falls back to pure Python with a warning.
"""

from __future__ import annotations

import ast
import os
import sys

from setuptools import setup


def compiled_sources() -> list[str]:
    """The source files of ``kvcached.ledger.compiled.COMPILED_MODULES``, read without importing
    the package (its dependencies need not be installed yet when this runs)."""
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "kvcached", "ledger", "compiled.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "COMPILED_MODULES":
            assert node.value is not None
            return [m.replace(".", "/") + ".py" for m in ast.literal_eval(node.value)]
    raise RuntimeError("kvcached/ledger/compiled.py defines no COMPILED_MODULES")


def _ext_modules() -> list[object]:
    if os.environ.get("KVCACHED_MYPYC", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify

        return list(mypycify(compiled_sources(), opt_level="3"))
    except (Exception, SystemExit) as exc:  # mypyc's type check exits on an error: pure Python is complete
        print(f"kvcached: building the pure-Python ledger ({exc!r})", file=sys.stderr)
        return []


if __name__ == "__main__":  # setuptools runs this file as __main__; build-compiled.sh imports it for the list
    setup(ext_modules=_ext_modules())
