"""One memory budget shared by the engines of one machine, without a daemon.

kvcached exists so that several models share one GPU's memory: an idle engine gives its KV
pages back and a busy one maps them. Engines that name the same budget (``KVCACHED_BUDGET``)
map pages only within it. An engine's allocator takes a page's bytes (every layer, region and
replica) before mapping it, with ``Budget.acquire_up_to``, and ``Budget.release`` gives them
back. There is no daemon to crash or to start first: the budget is a small JSON file in a
per-user directory (``budget_dir``), changed only under a lock (``_Files``). An engine that
starts on a full budget waits for room (``Budget.join``).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator

import msgspec

from .errors import ConfigError, ServiceError
from .ledger.files import kind
from .settings import BUDGET_NAME, format_size

NAME = BUDGET_NAME  # as KVCACHED_BUDGET takes it (settings.py)
# Seconds a process waits for a budget's lock before refusing: a holder keeps it for a read and a
# rename (microseconds), so a lock held this long means a stuck or stopped process.
LOCK_WAIT = 10.0
_VERSION = 1
# The most bytes of state rewritten in place: within one page, which a write at offset 0 fills
# in one step (the kernel checks for a fatal signal only between pages).
_IN_PLACE = 4096
_tags = itertools.count(1)


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


class BudgetFile(msgspec.Struct, frozen=True, kw_only=True):
    version: int = _VERSION
    size: int | None = None  # None: no bound yet
    shares: tuple[Share, ...] = ()

    @property
    def used(self) -> int:
        return sum(s.bytes for s in self.shares)

    def claimed_by_others(self, mine: Callable[[Share], bool]) -> int:
        return sum(s.claim for s in self.shares if not mine(s))


class EngineUsage(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    bytes: int
    alive: bool


class BudgetUsage(msgspec.Struct, frozen=True, kw_only=True):
    """What ``usage()`` reports: the size (None: unbounded), the bytes in use, per engine, and
    the bytes joining engines wait for (``claimed``)."""

    name: str
    size: int | None
    used: int
    engines: tuple[EngineUsage, ...]
    claimed: int = 0

    @property
    def headroom(self) -> int | None:
        return None if self.size is None else max(0, self.size - self.used)


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


class Budget:
    """This engine's handle on a named budget: acquire bytes before mapping, release on unmap."""

    def __init__(self, name: str, files: _Files) -> None:
        self.name = name
        self._files = files
        self.pid = os.getpid()
        self.start = _start_time(self.pid) or 0
        self.tag = next(_tags)
        self.held = 0  # bytes this engine holds in the budget
        self._closed = False

    @classmethod
    def open(cls, name: str, size_bytes: int | None = None, *, directory: str | None = None) -> Budget:
        """Join the budget ``name`` (made if new); ``size_bytes`` > 0 sets its size."""
        if size_bytes is not None and size_bytes < 0:
            raise ConfigError(f"budget {name}: size must be >= 0 bytes, got {size_bytes}")
        budget = cls(name, _Files(name, directory))
        size = size_bytes or None
        budget._change(
            lambda s: msgspec.structs.replace(
                s,
                size=s.size if size is None else size,
                shares=(*s.shares, Share(pid=budget.pid, start=budget.start, tag=budget.tag, bytes=0)),
            ),
            reclaim=True,
        )
        return budget

    def _mine(self, s: Share) -> bool:
        return s.pid == self.pid and s.tag == self.tag

    def _change(self, fn: Callable[[BudgetFile], BudgetFile | None], *, reclaim: bool = False) -> BudgetFile:
        if self._closed:
            raise BudgetError(f"budget {self.name} is closed")
        with self._files.locked(reclaim=reclaim) as state:
            new = fn(state)
            if new is not None and new is not state:
                self._files.write(new)
                state = new
        return state

    def _with_bytes(self, state: BudgetFile, delta: int) -> BudgetFile:
        shares = []
        found = False
        for s in state.shares:
            if self._mine(s):
                found = True
                s = msgspec.structs.replace(s, bytes=s.bytes + delta)
            shares.append(s)
        if not found:  # our share was dropped (our start time misread): take it back
            shares.append(Share(pid=self.pid, start=self.start, tag=self.tag, bytes=self.held + delta))
        return msgspec.structs.replace(state, shares=tuple(shares))

    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` if the budget has them, else nothing."""
        return self.acquire_up_to(nbytes, nbytes) == nbytes

    def acquire_up_to(self, nbytes: int, unit: int) -> int:
        """Take as many whole ``unit``s of ``nbytes`` as the budget has room for, in one change;
        returns the bytes taken (a multiple of ``unit``, possibly 0).

        NOTE: an engine's allocator takes a page's bytes this way before mapping it; its
        free-block count leases what it promises vLLM (``kvcached.page_allocator``).

        The shares of dead processes are dropped only when the room falls short, so a grant
        that fits costs one locked read and one write."""
        if nbytes <= 0 or unit <= 0:
            return 0
        granted = 0

        def take(state: BudgetFile) -> BudgetFile | None:
            nonlocal granted
            room = nbytes if state.size is None else min(nbytes, self._room(state))
            if room < nbytes and any(s.pid != self.pid for s in state.shares):
                state = self._files.reclaim(state)
                room = min(nbytes, self._room(state))
            granted = room - room % unit
            return self._with_bytes(state, granted) if granted else state

        self._change(take)
        self.held += granted
        return granted

    def _room(self, state: BudgetFile) -> int:
        """What this engine may be granted in ``state`` (a sized one): what is free, less what
        other engines wait for (their claims)."""
        return max(0, (state.size or 0) - state.used - state.claimed_by_others(self._mine))

    def join(self, nbytes: int, wait: float, *, poll: float = 0.1) -> float:
        """Wait until this engine could be granted ``nbytes`` (capped at the budget's size), for
        at most ``wait`` seconds; returns the seconds waited (0.0 exactly: it had room at once).
        Meanwhile the bytes are claimed: no other engine is granted them, and engines that hold
        more than their floor give back toward them (``asked``, which their controls read).
        Raises ``BudgetError`` in one line at the bound, naming what holds the budget.

        NOTE: an engine that starts on a full budget joins: it claims the bytes it needs to serve
        (its floor, one request of ``max_model_len``), so no other engine is granted them, and
        waits. The engines that hold more than their own floor read what is asked of them
        (``asked``) from their ledger service's thread. They give back
        (``page_allocator.PageAllocator.yield_to``): empty reserve pages first, then
        prefix-cached pages no request uses, down to their floor. The joiner goes on once the
        bytes are free, or refuses to start in one line after ``KVCACHED_JOIN_WAIT_S``."""
        t0 = time.monotonic()
        claimed = False
        while True:
            with self._files.locked(reclaim=True) as state:
                want = 0 if state.size is None else min(nbytes, state.size)
                room = self._room(state) if want else 0
                claim = want if room < want else 0
                if claim != self._claim_in(state):
                    self._files.write(self._with_claim(state, claim))
            waited = time.monotonic() - t0
            if claim == 0:
                return waited if claimed else 0.0
            claimed = True
            if waited >= wait:
                self._set_claim(0)
                raise BudgetError(
                    f"budget {self.name} has {format_size(room)} free for this engine's {format_size(want)} after "
                    f"{wait:g} s ({_holders(state, self._mine)}); lower a neighbour's limit (kvctl limit), raise the "
                    "budget (kvctl budget) or KVCACHED_JOIN_WAIT_S"
                )
            time.sleep(poll)

    def _claim_in(self, state: BudgetFile) -> int:
        return next((s.claim for s in state.shares if self._mine(s)), 0)

    def _with_claim(self, state: BudgetFile, claim: int) -> BudgetFile:
        shares = tuple(msgspec.structs.replace(s, claim=claim) if self._mine(s) else s for s in state.shares)
        return msgspec.structs.replace(state, shares=shares)

    def _set_claim(self, claim: int) -> None:
        self._change(lambda s: self._with_claim(s, claim) if self._claim_in(s) != claim else None)

    def asked(self) -> int:
        """Bytes other engines wait for beyond what is free: what engines over their floor are
        asked to give back (each engine reads the same figure; 0 when nobody waits)."""
        state = self._files.read_locked()
        claimed = state.claimed_by_others(self._mine)
        if not claimed or state.size is None:
            return 0
        return max(0, claimed - max(0, state.size - state.used))

    def yield_cap(self, page_cost: int, floor_pages: int) -> int | None:
        """The most pages this engine may keep while others wait (None: nobody does): what it
        holds less what is asked of it, not below its floor. Every byte given back lowers both
        alike, so the cap stays put while the pages go, however late their bytes return."""
        asked = self.asked()
        if not asked:
            return None
        return max(floor_pages, (self.held - asked) // page_cost)

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` of what this engine holds."""
        nbytes = min(nbytes, self.held)
        if nbytes <= 0:
            return
        self._change(lambda s: self._with_bytes(s, -nbytes))
        self.held -= nbytes

    def release_unmapped(self, nbytes: int) -> None:
        """Give back the bytes of pages this process has unmapped: its own memory, gone already."""
        self.release(nbytes)

    def set_size(self, nbytes: int | None) -> None:
        """Bound the budget at ``nbytes`` (None: unbounded); what is in use stays mapped."""
        self._change(lambda s: msgspec.structs.replace(s, size=nbytes), reclaim=True)

    def headroom(self) -> int | None:
        """Bytes the budget can still grant (None: unbounded), read now. Only what an engine's
        state says reads it (a count leases instead: ``kvcached.page_allocator``), so it is not
        cached as it was when every free-block count read it."""
        return self.usage().headroom

    def room(self) -> int | None:
        """Bytes this engine could be granted now (None: unbounded), read and not taken: a count
        that no map follows (a report) asks this rather than leasing."""
        state = self._files.read_locked()
        return None if state.size is None else self._room(state)

    def usage(self) -> BudgetUsage:
        return _usage(self.name, self._files)

    def usage_and_share(self) -> tuple[BudgetUsage, int]:
        """``usage()`` and the bytes this engine holds (0 if its share was dropped), from one read
        of the budget's file, so that the two agree."""
        state = self._files.read_locked()
        return _usage_of(self.name, state), next((s.bytes for s in state.shares if self._mine(s)), 0)

    def close(self) -> None:
        """Give back this engine's share (all of it) and leave the budget; once."""
        if self._closed:
            return
        self._change(lambda s: msgspec.structs.replace(s, shares=tuple(x for x in s.shares if not self._mine(x))))
        self._closed = True
        self.held = 0
        self._files.close()


def _usage(name: str, files: _Files) -> BudgetUsage:
    """Read, not reclaimed: a dead engine shows as such (its bytes are not counted as used, and
    the next change drops its share)."""
    return _usage_of(name, files.read_locked())


def _holders(state: BudgetFile, mine: Callable[[Share], bool]) -> str:
    """``held by pid 1234: 64 MiB, pid 5678: 16 MiB`` for a one-line refusal."""
    held = [f"pid {s.pid}: {format_size(s.bytes)}" for s in state.shares if not mine(s) and s.bytes]
    return "held by " + ", ".join(held) if held else "held by no other engine"


def _usage_of(name: str, state: BudgetFile) -> BudgetUsage:
    engines: dict[tuple[int, bool], int] = {}
    for s in state.shares:  # one line per process, however many engines it runs
        key = (s.pid, _alive(s))
        engines[key] = engines.get(key, 0) + s.bytes
    return BudgetUsage(
        name=name,
        size=state.size,
        used=sum(b for (_, alive), b in engines.items() if alive),
        engines=tuple(EngineUsage(pid=p, bytes=b, alive=a) for (p, a), b in sorted(engines.items())),
        claimed=sum(s.claim for s in state.shares if _alive(s)),
    )


def budget_exists(name: str, *, directory: str | None = None) -> bool:
    """Whether an engine or ``kvctl budget NAME SIZE`` has made budget ``name``, asked without
    making anything (``budget_usage`` opens its lock file, which would create the name)."""
    _check_name(name)
    d = directory or budget_dir()
    return any(os.path.lexists(os.path.join(d, f"budget-{name}{ext}")) for ext in (".json", ".lock"))


def budget_usage(name: str, *, directory: str | None = None) -> BudgetUsage:
    """What a budget holds, for ``kvctl list`` (joins nothing; dead engines' shares are dropped)."""
    files = _Files(name, directory)
    try:
        return _usage(name, files)
    finally:
        files.close()


@contextlib.contextmanager
def held_still(name: str, *, directory: str | None = None) -> Iterator[BudgetUsage]:
    """What a budget holds, with its lock kept until the block ends: no engine is granted or
    gives back bytes meanwhile, so memory measured inside the block (each engine maps only bytes
    granted, and gives bytes back only once unmapped) cannot exceed the shares read at its start,
    however long the measuring takes. For a consistent sample of several processes' memory;
    engines wait for the lock, so keep the block short (``LOCK_WAIT``)."""
    files = _Files(name, directory)
    try:
        with files.locked(reclaim=False) as state:
            yield _usage_of(name, state)
    finally:
        files.close()


def set_budget_size(name: str, nbytes: int | None, *, directory: str | None = None) -> BudgetUsage:
    """Set a budget's size (made if new), for ``kvctl budget NAME SIZE``; returns its usage.

    NOTE: a budget without a size bounds nothing until one is set (``KVCACHED_BUDGET_BYTES`` or
    this function). Lowering the size below what is in use takes nothing away: engines map no
    more until enough is given back (by their limits)."""
    if nbytes is not None and nbytes < 0:
        raise ConfigError(f"budget {name}: size must be >= 0 bytes, got {nbytes}")
    files = _Files(name, directory)
    try:
        with files.locked(reclaim=True) as state:
            files.write(msgspec.structs.replace(state, size=nbytes))
        return _usage(name, files)
    finally:
        files.close()
