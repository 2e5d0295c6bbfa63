"""Build hook: compile the ledger and what runs on vLLM's scheduler step with mypyc where a
compiler is available (the list is ``kvcached.ledger.compiled.COMPILED_MODULES``).

The ledger, the manager, the page-aware pool and the bridge sit on vLLM's scheduler thread;
compiled, the ledger's ``apply`` runs 3-5x faster than under CPython and kvcached's share of
the scheduler step falls by about half (figures in docs/benchmarks.md). The compiled modules are built
from the very same typed source, so there is one ledger, not two. ``KVCACHED_MYPYC=0`` builds
pure Python (the README's test command does this for its editable install, so that an edited
``ledger.py`` is what runs); a failed type check or compile falls back to pure Python with one
loud line (``OptionalBuildExt``), so that ``pip install .`` works on a machine without a compiler.
"""

from __future__ import annotations

import ast
import os
import re
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext


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


LOUD = "kvcached: building pure Python, about 3x slower on vLLM's scheduler step and in replay"


def _ext_modules() -> list[object]:
    if os.environ.get("KVCACHED_MYPYC", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify

        return list(mypycify(compiled_sources(), opt_level="3"))
    except (Exception, SystemExit) as exc:  # mypyc's type check exits on an error: pure Python is complete
        print(f"{LOUD}: mypyc could not compile the hot path ({exc!r})", file=sys.stderr)
        return []


class OptionalBuildExt(build_ext):  # type: ignore[misc]
    """``build_ext`` that falls back to pure Python, with one loud line, when compiling fails (no
    C compiler, ``CC=false``, missing headers): the compiled modules are the same source as the
    pure ones, so nothing is lost but speed. A partial build is removed, so that a wheel is
    either compiled or pure, never some of each."""

    def run(self) -> None:
        self._drop_stale_groups()
        try:
            super().run()
        except Exception as exc:  # CompileError, LinkError, a missing compiler, ...
            for path in self.get_outputs():
                if os.path.isfile(path) and not os.path.islink(path):
                    os.remove(path)
            self.extensions: list[object] = []
            print(f"{LOUD}: the C compiler failed ({type(exc).__name__}: {exc})", file=sys.stderr)

    def _drop_stale_groups(self) -> None:
        """mypyc names the library its modules share by a hash of their list: one that an earlier
        build of another list left in this build directory would ride along in the wheel."""
        ours = {os.path.basename(p) for p in self.get_outputs()}
        folder = self.build_lib
        if self.inplace or not os.path.isdir(folder):
            return
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            stale = re.fullmatch(r"[0-9a-f]{20}__mypyc\.cpython-[^/]+\.so", name) and name not in ours
            if stale and os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)


if __name__ == "__main__":  # setuptools runs this file as __main__; build-compiled.sh imports it for the list
    setup(ext_modules=_ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
