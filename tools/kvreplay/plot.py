"""``kvreplay plot``: the samples of ``stats`` as a picture, to see where the memory went.

The pages of the KV range are drawn as a stack that always adds up to the whole range: in use
(holding blocks), empty but mapped (held for a pin or not yet given back) and free (unmapped),
with the pinned count as a line over it and each violation as a red tick at its build. A stack
answers the question a person has when looking at an elastic cache, "how much of the memory was
doing something", at a glance. Matplotlib is imported only here, with the Agg backend, so that
the other subcommands start fast and no display is ever needed. Long traces are averaged into at
most ``MAX_POINTS`` points (the pinned line keeps each bucket's maximum, so a spike survives).
"""

from __future__ import annotations

import argparse
import os
from typing import Final

import msgspec
from kvcli import format_size, plural

from .stats import Series, collect
from .tracefile import ReplayError, Trace, start_ledger

MAX_POINTS: Final = 2000
# What matplotlib's Agg backend writes without further packages (jpg and tif need Pillow): the
# file name is checked before the replay, so that ``-o plot.txt`` is a usage error at once
# instead of matplotlib's ValueError after a long replay.
FORMATS: Final = (".png", ".pdf", ".svg", ".eps", ".ps")
EXTRA: Final = "pip install '.[replay]' from the kvcached checkout"


def picture(text: str) -> str:
    """An argparse ``type`` for ``-o``: a file name matplotlib can write."""
    ext = os.path.splitext(text)[1].lower()
    if ext not in FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r}: give a file ending in {', '.join(FORMATS)}")
    return text


def _matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ReplayError(f"kvreplay plot needs matplotlib, which this environment lacks: {EXTRA}") from None


def _reduce(xs: list[int], ys: list[int], points: int, peak: bool) -> tuple[list[float], list[float]]:
    if len(xs) <= points:
        return [float(x) for x in xs], [float(y) for y in ys]
    n = len(xs)
    ox, oy = [], []
    for i in range(points):
        lo, hi = n * i // points, n * (i + 1) // points
        ox.append((xs[lo] + xs[hi - 1]) / 2)
        part = ys[lo:hi]
        oy.append(float(max(part)) if peak else sum(part) / len(part))
    return ox, oy


def draw(s: Series, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lg = s.ledger
    xs = list(s.build)
    fig, ax = plt.subplots(figsize=(10, 4.5), dpi=110)
    try:
        if xs:
            bx, in_use = _reduce(xs, list(s.values["in_use"]), MAX_POINTS, False)
            _, empty = _reduce(xs, list(s.values["empty"]), MAX_POINTS, False)
            _, free = _reduce(xs, list(s.values["free"]), MAX_POINTS, False)
            _, pinned = _reduce(xs, list(s.values["pinned"]), MAX_POINTS, True)
            # Few builds read best as steps (a value holds for the whole build); many as a curve.
            steps = len(bx) < 200
            ax.stackplot(
                bx,
                in_use,
                empty,
                free,
                labels=["in use (blocks allocated)", "empty, still mapped", "free (unmapped)"],
                colors=["#4878a8", "#e8a040", "#e8e8e8"],
                step="post" if steps else None,
            )
            style = "steps-post" if steps else "default"
            ax.plot(bx, pinned, color="#303030", linewidth=1.0, label="pinned", drawstyle=style)
            marked: set[str] = set()
            for build, invariant in s.violations:
                label = f"{invariant} violation" if invariant not in marked else None
                marked.add(invariant)
                ax.axvline(build, color="#c02020", linewidth=0.8, alpha=0.7, label=label)
        else:
            ax.text(0.5, 0.5, "no build boundaries in the trace", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("build")
        ax.set_ylabel(f"pages ({format_size(lg.header.page_bytes)} each)")
        ax.set_ylim(0, max(lg.num_pages, 1))
        how = "derived" if s.derived else "recorded"
        ax.set_title(
            f"{os.path.basename(s.path)}: policy {lg.policy.value}, {how} decisions, "
            f"{plural(len(lg.violations), 'violation')}",
            fontsize=10,
        )
        ax.legend(loc="upper right", fontsize=8, framealpha=0.9)
        fig.tight_layout()
        try:
            fig.savefig(out)
        except OSError as exc:
            raise ReplayError(f"{out}: cannot write the plot: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def cmd_plot(args: argparse.Namespace) -> int:
    _matplotlib()  # before the replay, which may take minutes
    with Trace(args.trace, progress=not args.no_progress) as trace:
        lg, skip = start_ledger(trace, args.policy, args.from_snapshot)
        s = collect(trace, lg, skip, args.derive)
    draw(s, args.output)
    builds, pages, violations = len(s.build), lg.num_pages, len(lg.violations)
    if args.json:
        doc = {"file": args.output, "builds": builds, "pages": pages, "violations": violations}
        print(msgspec.json.encode(doc).decode())
        return 0
    print(f"wrote {args.output}: {plural(builds, 'build')}, {plural(pages, 'page')}, {plural(violations, 'violation')}")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "plot",
        parents=[common],
        help="draw mapped, pinned and free pages over builds into a PNG (matplotlib)",
        description="Replay TRACE and draw, per build, the pages in use, empty but mapped and free as a stack, "
        "the pinned pages as a line and violations as red ticks.",
    )
    p.add_argument(
        "-o", "--output", required=True, type=picture, metavar="FILE.png", help=f"the picture ({', '.join(FORMATS)})"
    )
    p.add_argument("--json", action="store_true", help="what was drawn, as JSON: file, builds, pages, violations")
    p.set_defaults(func=cmd_plot)
