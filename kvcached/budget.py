"""One memory budget shared by the engines of one machine, without a daemon.

kvcached exists so that several models share one GPU's memory: an idle engine gives its KV
pages back and a busy one maps them. Engines that name the same budget (``KVCACHED_BUDGET``)
map pages only within it. An engine's allocator takes a page's bytes (every layer, region and
replica) before mapping it, with ``Budget.acquire_up_to``, and ``Budget.release`` gives them
back. There is no daemon to crash or to start first: the budget is a small JSON file in a
per-user directory, changed only under a lock (``kvcached.budget_files``). An engine that
starts on a full budget waits for room (``Budget.join``); one short of it while it serves asks the
others to give back (``Budget.ask``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from collections.abc import Callable, Iterator

import msgspec

from .budget_files import (
    NAME,
    BudgetError,
    BudgetFile,
    Share,
    _alive,
    _check_name,
    _Files,
    _start_time,
    budget_dir,
)
from .errors import ConfigError
from .settings import format_size

__all__ = [
    "ASK_TTL",
    "NAME",
    "Budget",
    "BudgetError",
    "BudgetFile",
    "BudgetUsage",
    "EngineUsage",
    "Share",
    "budget_dir",
    "budget_exists",
    "budget_usage",
    "held_still",
    "set_budget_size",
]

# Seconds an ask (``Budget.ask``) holds unless renewed: an engine short of the budget renews it at
# each scheduler call that finds it still short, and one that stopped calling (idle, or killed)
# stops asking within this.
ASK_TTL = 3.0
_tags = itertools.count(1)


class EngineUsage(msgspec.Struct, frozen=True, kw_only=True):
    pid: int
    bytes: int
    alive: bool


class BudgetUsage(msgspec.Struct, frozen=True, kw_only=True):
    """What ``usage()`` reports: the size (None: unbounded), the bytes in use, per engine, and
    the bytes joining engines wait for (``claimed``) and those serving engines are short of
    (``short``)."""

    name: str
    size: int | None
    used: int
    engines: tuple[EngineUsage, ...]
    claimed: int = 0
    short: int = 0

    @property
    def headroom(self) -> int | None:
        return None if self.size is None else max(0, self.size - self.used)


class Budget:
    """This engine's handle on a named budget: acquire bytes before mapping, release on unmap."""

    def __init__(self, name: str, files: _Files) -> None:
        self.name = name
        self._files = files
        self.pid = os.getpid()
        self.start = _start_time(self.pid) or 0
        self.tag = next(_tags)
        self.held = 0  # bytes this engine holds in the budget
        # The ask last written (``ask``), and when it is due to be renewed (Unix seconds).
        self._asking = 0
        self._ask_renew = 0.0
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

    def _with_mine(self, state: BudgetFile, **fields: int | float) -> BudgetFile:
        shares = tuple(msgspec.structs.replace(s, **fields) if self._mine(s) else s for s in state.shares)
        return msgspec.structs.replace(state, shares=shares)

    def _with_claim(self, state: BudgetFile, claim: int) -> BudgetFile:
        return self._with_mine(state, claim=claim)

    def _set_claim(self, claim: int) -> None:
        self._change(lambda s: self._with_claim(s, claim) if self._claim_in(s) != claim else None)

    def ask(self, nbytes: int) -> None:
        """Ask the other engines to give back toward ``nbytes`` (0: stop asking), for
        ``ASK_TTL`` seconds unless asked again; written only when it changes or is due.

        NOTE: an engine's allocator asks at the end of a scheduler call whose count wanted
        pages the budget could not grant, once it has no empty page left
        (``PageAllocator.drain_releasable``). The others read it on their ledger service's tick
        (``yield_cap``) and give back as toward a joiner's claim: empty reserve pages, then
        prefix-cached pages no request uses, down to their floor. Unlike a claim, an ask keeps
        no bytes for the asker: the others' freed bytes go to whichever engine counts first."""
        now = time.time()
        if nbytes == self._asking and (not nbytes or now < self._ask_renew):
            return
        until = now + ASK_TTL if nbytes else 0.0
        self._change(lambda s: self._with_mine(s, ask=nbytes, ask_until=until))
        self._asking, self._ask_renew = nbytes, now + ASK_TTL / 3

    def asked(self) -> int:
        """Bytes other engines wait for or are short of, beyond what is free: what engines over
        their floor are asked to give back (each engine reads the same figure; 0 when nobody
        asks). An engine that waits or is short itself is asked nothing: two busy engines keep
        what they hold rather than trade pages back and forth."""
        state = self._files.read_locked()
        now = time.time()
        if state.size is None or any(s.wants(now) for s in state.shares if self._mine(s)):
            return 0
        wanted = state.wanted_by_others(self._mine, now)
        if not wanted:
            return 0
        return max(0, wanted - max(0, state.size - state.used))

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
    now = time.time()
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
        short=sum(s.ask for s in state.shares if s.ask_until > now and _alive(s)),
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
