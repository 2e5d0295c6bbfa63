"""One budget shared by engines (kvcached.budget): processes, SIGKILL, concurrency, the allocator.

Each check trips on the bug it is for: with the dead-share reclaim taken out of
``_Files.locked`` (``live = state.shares``), ``test_a_sigkilled_engines_share_is_reclaimed``,
``test_a_reused_pid_is_not_taken_for_the_engine`` and
``test_engines_starting_and_stopping_concurrently`` fail; with the start time left out of
``_alive`` (pid alone), ``test_a_reused_pid_is_not_taken_for_the_engine`` does; with zombies taken
for live processes (``_start_time`` without its state check),
``test_a_sigkilled_engine_left_a_zombie_is_reclaimed`` does.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvcached.backends.host import HostBackend
from kvcached.budget import Budget, BudgetError, budget_usage, set_budget_size
from kvcached.kv_cache_manager import KVCacheManager, KVGeometry
from kvcached.ledger.events import BuildBoundary
from kvcached.page_allocator import RETRY_SHORT_LEASE

MiB = 1 << 20

# A process that joins the budget, takes what it is told on stdin and says what it got.
CHILD = textwrap.dedent(
    """
    import sys
    from kvcached.budget import Budget
    b = Budget.open(sys.argv[1], None, directory=sys.argv[2])
    print("ready", flush=True)
    for line in sys.stdin:
        op, n = line.split()
        if op == "take":
            print(b.try_acquire(int(n)), flush=True)
        elif op == "give":
            b.release(int(n))
            print("ok", flush=True)
        elif op == "close":
            b.close()
            print("ok", flush=True)
    """
)


class Child:
    def __init__(self, name: str, directory: str) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-c", CHILD, name, directory],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.ask(None) == "ready"

    def ask(self, line: str | None) -> str:
        assert self.p.stdin is not None and self.p.stdout is not None
        if line is not None:
            self.p.stdin.write(line + "\n")
            self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def kill(self) -> None:
        self.p.send_signal(signal.SIGKILL)
        self.p.wait()

    def end(self) -> None:
        if self.p.poll() is None:
            assert self.p.stdin is not None
            self.p.stdin.close()
            self.p.wait(timeout=30)


def test_two_processes_share_a_budget(bdir) -> None:
    me = Budget.open("gpu0", 10 * MiB, directory=bdir)
    other = Child("gpu0", bdir)
    try:
        assert other.ask(f"take {6 * MiB}") == "True"
        assert not me.try_acquire(6 * MiB)  # 6 of 10 taken
        assert me.try_acquire(4 * MiB)
        assert me.headroom() == 0
        assert other.ask(f"give {4 * MiB}") == "ok"
        assert me.try_acquire(4 * MiB)  # what one gave back, the other maps
        u = budget_usage("gpu0", directory=bdir)
        assert (u.size, u.used) == (10 * MiB, 10 * MiB)
        assert {(e.pid, e.bytes, e.alive) for e in u.engines} == {
            (os.getpid(), 8 * MiB, True),
            (other.p.pid, 2 * MiB, True),
        }
        assert other.ask("close 0") == "ok"  # leaving gives the share back
        assert budget_usage("gpu0", directory=bdir).used == 8 * MiB
    finally:
        other.end()
        me.close()
    assert budget_usage("gpu0", directory=bdir).engines == ()


def test_a_sigkilled_engines_share_is_reclaimed(bdir) -> None:
    me = Budget.open("gpu0", 10 * MiB, directory=bdir)
    other = Child("gpu0", bdir)
    try:
        assert other.ask(f"take {9 * MiB}") == "True"
        other.kill()
        u = budget_usage("gpu0", directory=bdir)
        assert [(e.pid, e.alive) for e in u.engines if e.pid == other.p.pid] == [(other.p.pid, False)]
        assert u.used == 0  # a dead engine's bytes count for nothing
        assert me.try_acquire(10 * MiB)  # and the next change drops its share
        assert [e.pid for e in budget_usage("gpu0", directory=bdir).engines] == [os.getpid()]
    finally:
        other.end()
        me.close()


def test_a_sigkilled_engine_left_a_zombie_is_reclaimed(bdir) -> None:
    """A killed engine nobody reaps (its parent gone, a container's pid 1 that is no init) keeps
    its /proc entry, start time and all, as a zombie: it is dead, and its share goes."""
    me = Budget.open("gpu0", 10 * MiB, directory=bdir)
    other = Child("gpu0", bdir)
    try:
        assert other.ask(f"take {9 * MiB}") == "True"
        other.p.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # not waited for: a zombie until end() reaps it
            with open(f"/proc/{other.p.pid}/stat", "rb") as f:
                if f.read().rpartition(b")")[2].split()[0] == b"Z":
                    break
            time.sleep(0.01)
        u = budget_usage("gpu0", directory=bdir)
        assert [(e.pid, e.alive) for e in u.engines if e.pid == other.p.pid] == [(other.p.pid, False)]
        assert me.try_acquire(10 * MiB)
    finally:
        other.end()
        me.close()


def test_a_reused_pid_is_not_taken_for_the_engine(bdir) -> None:
    """A share whose pid is alive but belongs to another process (another start time) is dead."""
    me = Budget.open("gpu0", 10 * MiB, directory=bdir)
    try:
        path = os.path.join(bdir, "budget-gpu0.json")
        with open(path) as f:
            state = json.load(f)
        ghost = {"pid": os.getppid(), "start": 1, "tag": 1, "bytes": 10 * MiB}  # a live pid, not that process
        state["shares"].append(ghost)
        with open(path, "w") as f:
            json.dump(state, f)
        assert me.try_acquire(MiB)
        assert all(e.pid != os.getppid() for e in budget_usage("gpu0", directory=bdir).engines)
    finally:
        me.close()


SWARM = textwrap.dedent(
    """
    import os, random, sys, time
    from kvcached.budget import Budget
    name, d, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(seed)
    for _ in range(20):
        b = Budget.open(name, None, directory=d)
        for _ in range(rng.randint(1, 5)):
            n = rng.randint(1, 4) << 20
            if b.try_acquire(n):
                u = b.usage()
                assert u.used <= u.size, (u.used, u.size)
                b.release(rng.choice((n, n // 2)))
        if seed % 2 == 0 and rng.random() < 0.3:
            b.try_acquire(1 << 20)
            os.kill(os.getpid(), 9)  # die holding a share
        b.close()
    """
)


def test_engines_starting_and_stopping_concurrently(bdir) -> None:
    set_budget_size("gpu0", 8 * MiB, directory=bdir)
    procs = [subprocess.Popen([sys.executable, "-c", SWARM, "gpu0", bdir, str(i)]) for i in range(6)]
    over = []
    while any(p.poll() is None for p in procs):
        u = budget_usage("gpu0", directory=bdir)
        if u.used > 8 * MiB:
            over.append(u.used)
        time.sleep(0.005)
    codes = sorted(p.returncode for p in procs)
    assert all(c in (0, -signal.SIGKILL) for c in codes), codes
    assert over == []  # never more in use than the size
    me = Budget.open("gpu0", None, directory=bdir)
    try:
        assert me.try_acquire(8 * MiB)  # everything the dead held came back
    finally:
        me.close()
    u = budget_usage("gpu0", directory=bdir)
    assert (u.size, u.used, u.engines) == (8 * MiB, 0, ())


def test_size_unset_bounds_nothing_and_kvctl_can_set_it(bdir) -> None:
    b = Budget.open("gpu1", None, directory=bdir)
    try:
        assert b.headroom() is None and b.try_acquire(1 << 40)
        u = set_budget_size("gpu1", 2 * MiB, directory=bdir)
        assert (u.size, u.headroom) == (2 * MiB, 0)  # lowered below use: nothing taken away
        assert not b.try_acquire(1)
        b.release(1 << 40)
        assert b.try_acquire(2 * MiB)
    finally:
        b.close()


def test_bad_names_and_directories_are_refused(tmp_path, bdir) -> None:
    with pytest.raises(Exception, match="budget name"):
        Budget.open("../x", None, directory=bdir)
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    with pytest.raises(BudgetError, match="mode 0700"):
        Budget.open("gpu0", None, directory=str(loose))
    link = tmp_path / "link"
    link.symlink_to(bdir)
    with pytest.raises(BudgetError, match="mode 0700"):
        Budget.open("gpu0", None, directory=str(link))
    with open(os.path.join(bdir, "budget-junk.json"), "w") as f:
        f.write("not json")
    with pytest.raises(BudgetError, match="not a kvcached budget"):
        Budget.open("junk", None, directory=bdir)


PAGE = 64 * 1024


def manager(budget: Budget, **kw: int) -> KVCacheManager:
    geo = KVGeometry(num_blocks=32, block_bytes=PAGE // 4, page_bytes=PAGE)  # 8 pages of 4 blocks
    return KVCacheManager.standalone(geo, HostBackend(page_bytes=PAGE), budget=budget, **kw)  # type: ignore[arg-type]


def release_grace(m: KVCacheManager, build: int) -> None:
    m.recorder.emit(BuildBoundary(build))
    m.drain_releasable()


def test_two_managers_map_only_within_their_budget(bdir) -> None:
    a_b = Budget.open("gpu0", 6 * PAGE, directory=bdir)
    b_b = Budget.open("gpu0", None, directory=bdir)
    a, b = manager(a_b), manager(b_b)
    try:
        blocks = a.alloc(4 * 5)  # 5 pages, under the lease of the count before: all 6 pages
        assert a_b.held == 6 * PAGE
        a.drain_releasable()  # the scheduler call's end: the unspent page goes back
        assert a_b.held == 5 * PAGE
        assert b.available_size() == 4  # one page left in the budget: fewer free blocks, no error
        got = b.alloc(b.available_size())
        assert len(got) == 4 and b.available_size() == 0
        st = b.state()
        assert "budget gpu0 full" in st.reason and st.mapped_bytes == PAGE
        a.free(blocks[8:])  # three pages empty; they go when the ledger lets them
        release_grace(a, 0)
        assert a.state().mapped == 2 and a_b.held == 2 * PAGE
        time.sleep(RETRY_SHORT_LEASE)  # b's short count is reused that long
        assert b.available_size() == 4 * 3  # what a gave back, b can map
        b.alloc(12)
        assert budget_usage("gpu0", directory=bdir).used == 6 * PAGE
    finally:
        a.backend.close()
        b.backend.close()
        a_b.close()
        b_b.close()


def test_the_reserve_stops_at_the_budget(bdir) -> None:
    bud = Budget.open("gpu0", 3 * PAGE, directory=bdir)
    m = manager(bud, min_reserved=4, max_reserved=4)
    try:
        m.alloc(1)  # page 0, then a reserve of 4 wanted: the budget grants 2
        st = m.state()
        assert (st.in_use, st.reserved) == (1, 2) and bud.held == 3 * PAGE
    finally:
        m.backend.close()
        bud.close()


class CountingBudget:
    """A real budget whose releases are counted (each is a locked rewrite of the budget's file)."""

    def __init__(self, budget: Budget) -> None:
        self.budget, self.name = budget, budget.name
        self.releases: list[int] = []

    def acquire_up_to(self, nbytes: int, unit: int) -> int:
        return self.budget.acquire_up_to(nbytes, unit)

    def release(self, nbytes: int) -> None:
        self.releases.append(nbytes)
        self.budget.release(nbytes)

    release_unmapped = release

    def headroom(self) -> int | None:
        return self.budget.headroom()

    def room(self) -> int | None:
        return self.budget.room()


def test_pages_that_go_together_are_given_back_in_one_budget_change(bdir) -> None:
    """A shrink gives its pages back in one locked rewrite of the budget's file, not one per page."""
    bud = Budget.open("gpu0", 8 * PAGE, directory=bdir)
    counting = CountingBudget(bud)
    m = manager(counting)  # type: ignore[arg-type]
    try:
        blocks = m.alloc(32)  # all 8 pages
        m.free(blocks)
        release_grace(m, 0)
        assert m.state().mapped == 0
        assert counting.releases == [8 * PAGE] and bud.held == 0
        assert budget_usage("gpu0", directory=bdir).used == 0
    finally:
        m.backend.close()
        bud.close()


# --- what is at a budget's paths (regular files only, never a link, bounded waits) ---------------


def _plant(path: str, what: str, target: str) -> None:
    if what == "symlink":
        os.symlink(target, path)
    elif what == "directory":
        os.mkdir(path, 0o700)
    else:
        os.mkfifo(path, 0o600)


@pytest.fixture
def alarm():
    """A planted FIFO used to hang the process on open: fail in 5 s rather than hang the suite."""

    def timeout(*_: object) -> None:
        raise AssertionError("blocked on a budget file")

    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(5)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("which", [".json", ".lock"])
@pytest.mark.parametrize("what", ["symlink", "directory", "fifo"])
def test_a_budget_file_that_is_not_a_regular_file_is_refused_in_one_line(
    which: str, what: str, bdir: str, tmp_path, alarm
) -> None:
    target = tmp_path / "victim"
    target.write_text("someone else's")
    path = os.path.join(bdir, f"budget-gpu0{which}")
    _plant(path, what, str(target))
    words = {"symlink": "a symbolic link", "directory": "a directory", "fifo": "a FIFO"}[what]
    # A KvcachedError: an engine core logs it as its one "[kvcached] refused:" line (served.py).
    with pytest.raises(BudgetError, match=f"^{re.escape(path)} is {words}, not a budget's regular file; remove it$"):
        Budget.open("gpu0", 4 * MiB, directory=bdir)
    with pytest.raises(BudgetError, match="not a budget's regular file"):
        budget_usage("gpu0", directory=bdir)
    with pytest.raises(BudgetError, match="not a budget's regular file"):
        set_budget_size("gpu0", 4 * MiB, directory=bdir)
    assert target.read_text() == "someone else's"  # nothing written through the link
    # what was planted stays, and nothing else is left (no half-written state, no temporary file)
    left = set(os.listdir(bdir))
    assert os.path.basename(path) in left and left <= {os.path.basename(path), "budget-gpu0.lock"}, left


def test_kvctl_refuses_a_fifo_in_one_line_without_hanging(tmp_path) -> None:
    """As a user meets it: kvctl budget (setting a size, or reading one) prints one line, exit 1."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    d = runtime / "kvcached"
    d.mkdir(mode=0o700)
    os.mkfifo(d / "budget-gpu0.json", 0o600)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    for argv in (["budget", "gpu0", "4M"], ["budget", "gpu0"]):
        r = subprocess.run(
            [sys.executable, "-m", "kvctl.cli", *argv], capture_output=True, text=True, timeout=30, env=env
        )
        assert r.returncode == 1, (argv, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"{d / 'budget-gpu0.json'} is a FIFO, not a budget's regular file; remove it" in r.stderr


def test_a_held_lock_is_waited_for_a_bounded_time(bdir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    import kvcached.budget_files as budget_module

    b = Budget.open("gpu0", 4 * MiB, directory=bdir)
    other = os.open(os.path.join(bdir, "budget-gpu0.lock"), os.O_RDWR)  # another open file: flock conflicts
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        monkeypatch.setattr(budget_module, "LOCK_WAIT", 0.2)
        t0 = time.monotonic()
        with pytest.raises(BudgetError, match=r"budget-gpu0.lock has been locked by another process for over 0 s"):
            b.try_acquire(MiB)
        assert time.monotonic() - t0 < 5
        fcntl.flock(other, fcntl.LOCK_UN)
        assert b.try_acquire(MiB)  # and the budget works again once it is let go
    finally:
        os.close(other)
        b.close()
