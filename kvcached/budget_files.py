"""A budget's two files: the state engines share (``BudgetFile``), and the lock it is read under.

``kvcached.budget`` is what an engine does with a budget; this module is how the state is kept:
a small JSON file in a per-user directory (``budget_dir``), changed only under ``flock`` of a
lock file beside it (``_Files``), both regular files of this user, never followed through a link.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator

import msgspec

from .errors import ConfigError, ServiceError
from .ledger.files import kind
from .settings import BUDGET_NAME

NAME = BUDGET_NAME  # as KVCACHED_BUDGET takes it (settings.py)
# Seconds a process waits for a budget's lock before refusing: a holder keeps it for a read and a
# rename (microseconds), so a lock held this long means a stuck or stopped process.
LOCK_WAIT = 10.0
_VERSION = 1
# The most bytes of state rewritten in place: within one page, which a write at offset 0 fills
# in one step (the kernel checks for a fatal signal only between pages).
_IN_PLACE = 4096


class BudgetError(ServiceError):
    """The budget's directory or file cannot be used (another user's, a link, not a budget)."""


class Share(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's part of a budget, as the file keeps it.

    NOTE: a share is keyed by pid, process start time and a per-process tag. The start time
    (``/proc/<pid>/stat`` field 22) is there so that a pid reused by another process is not taken
    for the engine. The tag is there because one process may run several engines, as the tests do.
    """

    pid: int
    start: int  # the process's start time in clock ticks since boot (0 where /proc is absent)
    tag: int  # which Budget object of that process
    bytes: int
    # Bytes this engine waits for (``Budget.join``): no other engine is granted them, and the
    # others give back toward them (``asked``). A default, so that older files still decode.
    claim: int = 0
    # Bytes this engine, serving, is short of (``Budget.ask``), and the wall-clock time (Unix
    # seconds) the ask holds until: the others give back toward it, but the bytes are not kept
    # for it, so that two engines short at once do not bar each other from what is free.
    ask: int = 0
    ask_until: float = 0.0

    def wants(self, now: float) -> int:
        """What this engine waits for or is short of at ``now``."""
        return self.claim + (self.ask if self.ask_until > now else 0)


class BudgetFile(msgspec.Struct, frozen=True, kw_only=True):
    version: int = _VERSION
    size: int | None = None  # None: no bound yet
    shares: tuple[Share, ...] = ()

    @property
    def used(self) -> int:
        return sum(s.bytes for s in self.shares)

    def claimed_by_others(self, mine: Callable[[Share], bool]) -> int:
        return sum(s.claim for s in self.shares if not mine(s))

    def wanted_by_others(self, mine: Callable[[Share], bool], now: float) -> int:
        return sum(s.wants(now) for s in self.shares if not mine(s))


def budget_dir() -> str:
    """The per-user directory of budgets (made if need be).

    NOTE: it is ``$XDG_RUNTIME_DIR/kvcached/`` or ``/dev/shm/kvcached-<uid>/``, mode 0700, and
    checked to be the user's own and not a link (``_own_dir``)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "kvcached")
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"kvcached-{os.getuid()}")


def _own_dir(path: str) -> None:
    """Make ``path`` (0700) or accept it only if it is this user's own directory, not a link."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise BudgetError(
            f"budget directory {path} is not a directory of this user with mode 0700; remove it or set XDG_RUNTIME_DIR"
        )


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot); None if no such process or a zombie;
    0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return 0
    # comm (field 2) may hold spaces and parentheses: fields after the last ')' are plain.
    fields = data[data.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        # Dead, only its exit status left: an engine core killed with SIGKILL is reparented to
        # pid 1, and a container's pid 1 that is not an init never reaps it (seen here: its
        # /proc entry stays, start time and all), so its share would be held for good.
        return None
    return int(fields[19])  # field 22 of the whole line


def _alive(share: Share) -> bool:
    start = _start_time(share.pid)
    if start is None:
        return False
    if share.start and start:
        return start == share.start
    try:  # no /proc here: the pid alone says it
        os.kill(share.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise ConfigError(f"budget name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)")


def _what(path: str) -> str:
    """What is at ``path``, in words, for a refusal."""
    try:
        mode = os.lstat(path).st_mode
    except OSError as exc:
        return f"unusable ({exc.strerror})"
    return "another user's file" if stat.S_ISREG(mode) else kind(mode)


def _open_regular(path: str, flags: int) -> int:
    """Open ``path`` only if it is a regular file of this user: never through a link
    (``O_NOFOLLOW``), never waiting on a FIFO (``O_NONBLOCK``: opening one to read would block
    until a writer came, and every engine's next page map with it). ``FileNotFoundError`` passes;
    anything else is refused in one line that says what is there."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise BudgetError(f"{path} is {_what(path)}, not a budget's regular file; remove it") from exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise BudgetError(f"{path} is {_what(path)}, not a budget's regular file; remove it")
    return fd


class _Files:
    """The lock file and the state file of one budget: regular files of this user only.

    NOTE: the state is read and changed only under ``fcntl.flock`` of the lock file beside it.
    Since every reader takes the lock, a change rewrites the file in place (``write``): one
    ``pwrite`` of at most a page, which a killed process leaves whole. A larger state is written
    beside and renamed over. A grant and a release cost about 11 us each on tmpfs, against 140 us
    when each change wrote a new file and looked up every engine in ``/proc``.
    """

    def __init__(self, name: str, directory: str | None) -> None:
        _check_name(name)
        d = directory or budget_dir()
        _own_dir(d)
        self.dir = d
        self.path = os.path.join(d, f"budget-{name}.json")
        lock = os.path.join(d, f"budget-{name}.lock")
        self.lock = lock
        self.lock_fd = _open_regular(lock, os.O_RDWR | os.O_CREAT)
        self._fd: int | None = None  # the state file (``_state``), and which file it is
        self._id = (0, 0)
        self._len = 0  # the state file's length at the last read or write

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        os.close(self.lock_fd)

    def _state(self) -> tuple[int, int] | None:
        """The state file, kept open between changes, and its length; None if there is none yet.

        Reopened when the path names another file than the one held: replaced by an older
        kvcached's rename, or removed. Under the lock."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            st = None
        if self._fd is not None and (st is None or (st.st_ino, st.st_dev) != self._id):
            os.close(self._fd)
            self._fd = None
        if st is None:
            return None
        if self._fd is None:
            try:
                fd = _open_regular(self.path, os.O_RDWR)
            except FileNotFoundError:
                return None
            held = os.fstat(fd)
            self._fd, self._id = fd, (held.st_ino, held.st_dev)
            st = held
        return self._fd, st.st_size

    def read(self) -> BudgetFile:
        found = self._state()
        if found is None:
            self._len = 0
            return BudgetFile()
        fd, size = found
        data = os.pread(fd, size, 0)
        self._len = len(data)
        try:
            state = msgspec.json.decode(data, type=BudgetFile)
        except msgspec.DecodeError as exc:
            raise BudgetError(f"{self.path} is not a kvcached budget ({exc}); remove it") from exc
        if state.version != _VERSION:
            raise BudgetError(f"{self.path}: budget format {state.version}, this kvcached reads {_VERSION}")
        return state

    def write(self, state: BudgetFile) -> None:
        """Replace the state read under the same lock. Readers read under the lock too, so the
        state may be rewritten in place: one ``pwrite`` at offset 0 of at most ``_IN_PLACE``
        bytes (padded with JSON's blanks to the old length, never truncated), which a process
        killed mid-call leaves whole. A new or larger file is written beside and renamed over."""
        data = msgspec.json.encode(state)
        if self._fd is not None and len(data) <= _IN_PLACE and self._len <= _IN_PLACE:
            if len(data) < self._len:
                data += b" " * (self._len - len(data))
            os.pwrite(self._fd, data, 0)
            self._len = len(data)
            return
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".budget-")
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)  # atomic: a reader sees the old state or the new one

    def _lock(self) -> None:
        """The lock, waited for at most ``LOCK_WAIT`` seconds (polled: ``flock`` has no timeout)."""
        deadline: float | None = None
        pause = 0.0001
        while True:
            try:
                fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            now = time.monotonic()
            if deadline is None:
                deadline = now + LOCK_WAIT
            elif now >= deadline:
                raise BudgetError(
                    f"{self.lock} has been locked by another process for over {LOCK_WAIT:.0f} s "
                    "(a stopped or stuck kvcached engine or kvctl?); stop it, or remove the file if none runs"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    @contextlib.contextmanager
    def locked(self, *, reclaim: bool = False) -> Iterator[BudgetFile]:
        """The state under the lock; ``reclaim``: dead engines' shares dropped first (and written)."""
        self._lock()
        try:
            state = self.read()
            if reclaim:
                state = self.reclaim(state)
            yield state
        finally:
            fcntl.flock(self.lock_fd, fcntl.LOCK_UN)

    def read_locked(self) -> BudgetFile:
        """The state as it is, read under the lock and not reclaimed (a read, no change)."""
        with self.locked(reclaim=False) as state:
            return state

    def reclaim(self, state: BudgetFile) -> BudgetFile:
        """``state`` without the shares of dead processes (written if any went); under the lock.

        Asked only where a dead share could matter (joining, resizing, a grant that would fall
        short): it reads ``/proc`` for each share, which was 40% of a grant's cost when every
        change did it.

        NOTE: ``usage`` shows the shares of dead processes as dead and does not count them. So an
        engine killed with SIGKILL holds nothing another engine needs."""
        live = tuple(s for s in state.shares if _alive(s))
        if len(live) == len(state.shares):
            return state
        state = msgspec.structs.replace(state, shares=live)
        self.write(state)
        return state
