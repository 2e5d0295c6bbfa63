"""What kvreplay, kvctl and kvsim promise alike: exit codes, one-line errors, ``--version``, units.

An operator scripts these three tools together (``kvctl dump`` then ``kvreplay check``, a kvsim
seed shrunk to a trace), so they must fail the same way (the exit codes below, ``Parser``,
``run``). Sizes print in their unit and counts agree with their nouns through the helpers here,
so the three tools read alike.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any, Final, NoReturn

from kvcached.errors import KvcachedError
from kvcached.ledger.findings import plural
from kvcached.settings import format_size
from kvcached.version import KVCACHED_VERSION

# A usage error (an unknown option, a value out of range, options that do not go together) is one
# line on stderr and exit 2, as argparse's own convention and ``grep``'s. A run that could not do
# its job (an unreadable trace, no engine answering, a violation found by a check) is one line and
# exit 1; success is 0.
OK: Final = 0
FAILED: Final = 1  # the run could not do its job, or a check found what it looks for
USAGE: Final = 2  # the command line itself is wrong
INTERRUPTED: Final = 130

__all__ = [
    "FAILED",
    "INTERRUPTED",
    "MAX_INT",
    "OK",
    "USAGE",
    "Parser",
    "format_size",
    "one_line",
    "plural",
    "positive_seconds",
    "run",
    "version",
    "whole",
]

# The largest integer msgpack carries signed, and the journal's bound on every integer
# (kvcached.ledger.events.INT64_MAX): a count, page or event index beyond it means nothing here.
MAX_INT: Final = 2**63 - 1


class Parser(argparse.ArgumentParser):
    """argparse's, but a usage error is one line (argparse prints the usage block first) and
    names the ``--help`` to read, and a word that starts with ``-`` and a digit is a value;
    subparsers made from it inherit the behaviour."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes only -5 and -.5 for negative numbers; -5M (a size) or -1e3 it took for an
        # unknown option ("unrecognized arguments: -5M"), never reaching the value's own check,
        # which says what is wrong with it. No option of these tools starts with a digit.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        top = self.prog.split()[0]
        hint = f"{self.prog} --help"
        self.exit(USAGE, f"{top}: {' '.join(message.split())} (see {hint})\n")


def whole(low: int, what: str, high: int = MAX_INT) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``low`` to ``high``, else one usage line that
    says the range (``--count -1``, ``--events 1e400``, ``--rows nan`` were tracebacks or
    silently meant something else)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: give {what} from {low:,} to {high:,}")
        return v

    parse.__name__ = what  # argparse names the type in some messages
    return parse


def positive_seconds(high: float) -> Callable[[str], float]:
    """An argparse ``type``: seconds above 0 and at most ``high``; NaN and infinities refused."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not (math.isfinite(v) and 0 < v <= high):
            raise argparse.ArgumentTypeError(f"{text!r}: give seconds above 0 and at most {high:g}")
        return v

    parse.__name__ = "seconds"
    return parse


def version(tool: str) -> str:
    """The ``--version`` line of ``tool``: one version for the package and its three tools."""
    return f"{tool} (kvcached {KVCACHED_VERSION})"


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def run(tool: str, body: Callable[[], int], *, debug_env: str, context: str = "") -> int:
    """Runs ``body`` under this package's promise (one line, the exit codes above) and returns its
    exit code (for ``sys.exit``).

    NOTE: an error kvcached raises on purpose (``KvcachedError``) or an ``OSError`` on a file the
    user named is a plain user error and is never called a bug. Only an exception nobody
    anticipated says "internal error", with the environment variable that shows its traceback
    (``debug_env``)."""
    on = f" {context}" if context else ""
    try:
        return body()
    except KvcachedError as exc:
        print(f"{tool}: {one_line(exc)}", file=sys.stderr)
        return FAILED
    except BrokenPipeError:
        # The reader went away (``| head``): not an error; keep Python's exit-time flush quiet.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return OK
    except KeyboardInterrupt:
        return INTERRUPTED
    except MemoryError:
        # Not a bug: an input may ask for more than the process may have (a trace's header
        # declaring 2**24 blocks makes ledger tables of 1 to 2 GB) under a memory limit.
        print(
            f"{tool}: out of memory{on}: the run needs more memory than this process may use; "
            "raise its limit (ulimit -v) or free memory",
            file=sys.stderr,
        )
        return FAILED
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{tool}: {where}{exc.strerror or one_line(exc)}", file=sys.stderr)
        return FAILED
    except Exception as exc:
        if os.environ.get(debug_env) == "1":
            raise
        print(
            f"{tool}: internal error{on}: {type(exc).__name__}: {one_line(exc)} "
            f"(a bug: please report it; {debug_env}=1 shows the traceback)",
            file=sys.stderr,
        )
        return FAILED
