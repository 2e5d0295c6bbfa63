"""Print the requirements of an installed distribution, one per line, for ``pip install -r``.

Run with the target environment's interpreter after ``pip install --no-deps DIST``. Markers are
evaluated for this interpreter and extras left out; ``--override NAME==VERSION`` replaces the
distribution's own pin of NAME. Why: vLLM 0.34.0 pins ``flashinfer-python==0.7.3``, which the
package index here does not carry (0.7.2.post1 and 0.7.4 are there), so ``pip install
vllm==0.34.0`` fails to resolve; a user meets the same. Usage errors exit 2 in one line.
"""

from __future__ import annotations

import argparse
import sys
from importlib import metadata

from pip._vendor.packaging.requirements import InvalidRequirement, Requirement


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="requires.py", description=__doc__.splitlines()[0])
    ap.add_argument("dist", help="an installed distribution, e.g. vllm")
    ap.add_argument("--override", action="append", default=[], metavar="NAME==VERSION")
    args = ap.parse_args(argv)
    overrides: dict[str, str] = {}
    for text in args.override:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            print(f"requires.py: --override {text!r} is not a requirement like name==1.2", file=sys.stderr)
            return 2
        overrides[req.name.lower()] = text
    try:
        requires = metadata.requires(args.dist) or []
    except metadata.PackageNotFoundError:
        print(f"requires.py: {args.dist} is not installed in {sys.prefix}", file=sys.stderr)
        return 2
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        print(overrides.get(req.name.lower(), str(req)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
