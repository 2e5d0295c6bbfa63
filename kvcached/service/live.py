"""The live view: a Unix socket where ``kvctl`` asks the ledger service which pages are pinned and why.

The protocol is deliberately small so that any client can speak it: every message, in both
directions, is a 4-byte big-endian length followed by that many bytes of msgpack (``LiveServer``
says what is in them). Answers come from the service's ledger replica on the service's loop,
never from the scheduler's ledger, and nothing a client sends can stop the server.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final, NoReturn

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.memory import MemoryObjectSendStream

from kvcached.errors import ConfigError, KvcachedError, ServiceError
from kvcached.ledger.events import Event
from kvcached.ledger.findings import plural
from kvcached.service.messages import (
    LEN,
    MAX_REPLY,
    MAX_REQUEST,
    EngineInfo,
    ErrorReply,
    EventsReply,
    LedgerCounts,
    LimitReply,
    LiveSource,
    MemoryStatus,
    PinRow,
    PinsReply,
    Reply,
    Request,
    StatusReply,
    WhyReply,
    frame,
)
from kvcached.settings import MAX_SIZE  # a limit beyond it is a typo

if TYPE_CHECKING:
    from kvcached.ledger.ledger import Ledger

log = logging.getLogger("kvcached.service.live")

SOCKET_ENV: Final = "KVCACHED_LEDGER_SOCKET"


class LiveViewError(ServiceError):
    """The live view cannot be reached or answered with an error (one line, for kvctl)."""


class RefusedError(LiveViewError):
    """The service answered, refusing the request (a limit below the floor, an unknown page):
    the engine is fine, the request is not."""


# --- the pins table ---------------------------------------------------------------------------


def pin_rows(lg: Ledger) -> list[PinRow]:
    """Every pin of the ledger, by page, in the order and with the values of ``Ledger.why``.

    Reads the ledger's pin tables once instead of calling ``why`` per page: ``why`` builds two
    structs and sorts per page, about 10 us, which is 100 ms for 10,000 pinned pages.
    tests/test_live.py checks the two against each other.
    """
    # (page, kind order, job or request id, row): the keys are unique, so rows are never compared.
    keyed: list[tuple[int, int, int, PinRow]] = []
    add = keyed.append
    t = lg.tables  # the ledger's state (kvcached/ledger/tables.py), read-only here
    jobs, names, build = t.jobs, t.names, t.build
    for job, (kind, req, pages, workers, reported, since, _, _) in jobs.items():
        name = names.get(req)
        request = f"r{req}" if name is None else name  # as LedgerTables.request_name
        for page in pages:
            row = PinRow(page, "job", since, job, "load" if kind else "store", request, workers - reported)
            add((page, 0, job, row))
    for page in t.grace:
        add((page, 1, 0, PinRow(page, "grace", build, until_build=build)))
    for page, holds in t.holds.items():
        for req, since in holds.items():
            add((page, 2, req, PinRow(page, "window", since, request=t.request_name(req))))
    keyed.sort()
    return [k[3] for k in keyed]


# --- the server -------------------------------------------------------------------------------


def prepare_socket_path(path: str) -> None:
    """Make ``path``'s directory (0700) or check that only we can open it; clear a stale socket.

    NOTE: the socket lives in a directory only its owner can open (0700, checked, never loosened
    for the caller), and is itself 0600: the directory is what keeps others out, since it exists
    before the socket does."""
    if len(os.fsencode(path)) > 107:
        raise ConfigError(f"{path}: a Unix socket path is limited to 107 bytes; choose a shorter one")
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(
            f"{folder}: the ledger socket needs a directory that only this user can open "
            f"(owned by uid {os.getuid()}, mode 0700; it has uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o})"
        )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path}: exists and is not a socket; remove it or choose another path")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # a socket nobody listens on: left by a killed engine
            return
    raise ConfigError(f"{path}: another ledger service is listening there")


class _Tail:
    __slots__ = ("scope", "send")

    def __init__(self, send: MemoryObjectSendStream[bytes], scope: anyio.CancelScope) -> None:
        self.send, self.scope = send, scope


class _Conn:
    """One connection's place: its cancel scope (to let it go) and since when it waits for a
    request (None while a request is answered or a tail streams: then it is not idle)."""

    __slots__ = ("scope", "waiting_since")

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()
        self.waiting_since: float | None = None


class LiveServer:
    """Serves the live view of ``service`` on ``path`` (run with ``await tg.start(server.serve)``).

    At most ``max_clients`` connections are held, of which at most ``max_tails`` tail streams,
    so that requests always have room. When every place is taken, the server does not refuse
    the newcomer: it stops accepting (the newcomer waits in the kernel's listen queue, in turn)
    and lets go of the connection that has waited longest for a request, once that one has
    waited ``evict_after`` seconds, so a few idle or slow clients cannot lock out the operator
    and a kvctl that is answered late is still answered. A connection must deliver its first
    request within ``request_timeout`` and each later one within ``idle_timeout``. An error
    reply (a tail too many, a malformed request) follows the request read whole, so the peer
    reads the reply and then the end of the connection, not a reset; only a request declared
    larger than ``MAX_REQUEST`` is left unread.

    NOTE: a request is a map ``{"op": "pins" | "status" | "why" | "tail", "page": int, "limit":
    int}`` (at most ``MAX_REQUEST`` bytes); a reply is a map whose ``type`` field names it
    (``pins``, ``status``, ``why``, ``events``, ``error``).
    """

    def __init__(
        self,
        service: LiveSource,
        path: str,
        *,
        max_clients: int = 64,
        max_tails: int | None = None,
        client_queue: int = 256,
        send_timeout: float = 5.0,
        idle_timeout: float = 60.0,
        request_timeout: float = 5.0,
        evict_after: float = 1.0,
    ) -> None:
        if max_clients < 2:
            raise ConfigError(f"the live view needs room for at least 2 clients, not {max_clients}")
        self.service, self.path = service, path
        self.max_clients, self.client_queue = max_clients, client_queue
        self.max_tails = max_clients // 2 if max_tails is None else min(max_tails, max_clients - 1)
        self.send_timeout, self.idle_timeout = send_timeout, idle_timeout
        self.request_timeout, self.evict_after = request_timeout, evict_after
        self.dropped_clients = 0  # tail clients that stopped reading
        self.evicted_clients = 0  # idle connections let go to make room
        self._conns: list[_Conn] = []  # in the order accepted: the oldest first
        self._freed: anyio.Event | None = None
        self._tails: list[_Tail] = []
        self._decoder = msgspec.msgpack.Decoder(Request)
        self._pins_cache: tuple[tuple[int, int], list[PinRow]] | None = None

    @property
    def clients(self) -> int:
        return len(self._conns)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        prepare_socket_path(self.path)
        _prune_beside(self.path)
        # anyio's default backlog, which the kernel caps at net.core.somaxconn (4096 on current
        # kernels): while every place is taken, that queue is where newcomers wait their turn.
        listener = await anyio.create_unix_listener(self.path, mode=0o600)
        self.service.listeners.append(self._broadcast)
        try:
            task_status.started()
            async with listener, anyio.create_task_group() as tg:
                while True:
                    await self._make_room()
                    try:
                        stream = await listener.accept()
                    except OSError as exc:  # out of file descriptors, a peer gone before accept
                        log.warning("kvcached: ledger live view: accept failed: %s", exc)
                        await anyio.sleep(0.1)
                        continue
                    conn = _Conn()
                    self._conns.append(conn)
                    tg.start_soon(self._handle, stream, conn)
        finally:
            self.service.listeners.remove(self._broadcast)
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    async def _make_room(self) -> None:
        """Return once a connection may be taken: a free place, or the longest idle one let go."""
        while len(self._conns) >= self.max_clients:
            now = anyio.current_time()
            idle = [c for c in self._conns if c.waiting_since is not None]
            oldest = min(idle, key=lambda c: c.waiting_since or 0.0) if idle else None
            waited = 0.0 if oldest is None or oldest.waiting_since is None else now - oldest.waiting_since
            if oldest is not None and waited >= self.evict_after:
                self._conns.remove(oldest)
                oldest.scope.cancel()
                self.evicted_clients += 1
                continue
            # Until a place frees, or the oldest idle one has waited long enough (no idle one:
            # every place answers or streams; requests finish within send_timeout).
            self._freed = anyio.Event()
            with anyio.move_on_after(self.evict_after - waited):
                await self._freed.wait()

    def _broadcast(self, first: int, payload: bytes) -> None:
        """NOTE: a client that stops reading is dropped once its bounded queue is full, so it
        cannot slow the service or the other clients."""
        if not self._tails:
            return
        message = frame(EventsReply(first, msgspec.Raw(payload)))
        for tail in list(self._tails):
            try:
                tail.send.send_nowait(message)
            except anyio.WouldBlock:
                # Its queue is full: it stopped reading. Dropping it keeps everyone else on time.
                self._tails.remove(tail)
                self.dropped_clients += 1
                tail.scope.cancel()
                log.info("kvcached: ledger live view: dropped a tail client that stopped reading")
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._tails.remove(tail)

    async def _handle(self, stream: anyio.abc.SocketStream, conn: _Conn) -> None:
        try:
            async with stream:
                with conn.scope:
                    await self._converse(stream, conn)
        except Exception as exc:  # a bug here must cost one connection, never the server
            if not _client_gone(exc):
                log.exception("kvcached: ledger live view: a request failed")
        finally:
            if conn in self._conns:
                self._conns.remove(conn)
            if self._freed is not None:
                self._freed.set()

    async def _converse(self, stream: anyio.abc.SocketStream, conn: _Conn) -> None:
        """NOTE: a malformed or oversized request gets an ``error`` reply and the connection is
        closed, and nothing a client sends can stop the server."""
        buffered = BufferedByteReceiveStream(stream)
        timeout = self.request_timeout  # the first request comes at once (kvctl sends on connect)
        while True:
            body: bytes | None = None
            conn.waiting_since = anyio.current_time()
            with anyio.move_on_after(timeout):
                try:
                    (size,) = LEN.unpack(await buffered.receive_exactly(LEN.size))
                    if size > MAX_REQUEST:
                        # Not read: whatever follows the length cannot be trusted to be a request.
                        conn.waiting_since = None
                        await self._send(stream, ErrorReply(f"request of {size} bytes exceeds {MAX_REQUEST}"))
                        return
                    body = await buffered.receive_exactly(size)
                except anyio.IncompleteRead:
                    return
            conn.waiting_since = None
            if body is None:
                return  # no request in time: a connection is a place, not free
            timeout = self.idle_timeout
            try:
                request = self._decoder.decode(body)
            except msgspec.DecodeError as exc:
                await self._send(stream, ErrorReply(f"malformed request: {exc}"))
                return
            if request.op == "tail":
                if len(self._tails) >= self.max_tails:
                    await self._send(stream, ErrorReply(f"too many tail streams (at most {self.max_tails}); try later"))
                    return
                await self._tail(stream, buffered)
                return
            reply = await self.respond(request)
            if not await self._send(stream, reply) or isinstance(reply, ErrorReply):
                return

    async def _send(self, stream: anyio.abc.SocketStream, reply: Reply) -> bool:
        with anyio.move_on_after(self.send_timeout):
            await stream.send(frame(reply))
            return True
        return False  # a client that does not read its answer is not waited for

    async def _tail(self, stream: anyio.abc.SocketStream, buffered: BufferedByteReceiveStream) -> None:
        """NOTE: ``tail`` turns the connection into a stream of ``events`` replies, one per journal
        batch, whose ``events`` field is the batch's msgpack array of events exactly as the
        journal holds it (encoded once, for every client and the journal)."""
        send, receive = anyio.create_memory_object_stream[bytes](self.client_queue)
        async with anyio.create_task_group() as tg:
            tail = _Tail(send, tg.cancel_scope)
            self._tails.append(tail)
            try:
                tg.start_soon(self._until_closed, buffered, tg.cancel_scope)
                async with receive:
                    async for message in receive:
                        await stream.send(message)
            finally:
                if tail in self._tails:
                    self._tails.remove(tail)
                send.close()
                tg.cancel_scope.cancel()

    @staticmethod
    async def _until_closed(buffered: BufferedByteReceiveStream, scope: anyio.CancelScope) -> None:
        # A tail client has nothing more to say: any byte, EOF or error ends its stream.
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await buffered.receive()
        scope.cancel()

    async def respond(self, request: Request) -> Reply:
        """``answer``, with what the engine itself must say (its memory, a new limit) asked in a
        worker thread: the engine answers between two scheduler steps, and the loop goes on."""
        control = self.service.control
        if request.op == "limit" and control is not None:
            size = request.size
            if size is not None and size > MAX_SIZE:
                return ErrorReply(f"limit: {size} bytes is beyond any machine's memory")
            try:
                limit = None if size is None or size < 0 else size
                memory = await anyio.to_thread.run_sync(control.set_limit, limit, request.force)
            except KvcachedError as exc:
                return ErrorReply(f"limit: {exc}")
            return LimitReply(memory)
        if request.op == "status" and control is not None:
            try:
                memory = await anyio.to_thread.run_sync(control.memory)
            except KvcachedError as exc:
                return ErrorReply(f"status: {exc}")
            return self.answer(request, memory=memory, engine=control.info())
        return self.answer(request)

    def answer(
        self, request: Request, *, memory: MemoryStatus | None = None, engine: EngineInfo | None = None
    ) -> Reply:
        svc = self.service
        lg = svc.replica
        if request.op == "dump":
            dump = svc.dump("kvctl dump")
            if dump is None:
                return ErrorReply("dump: the flight recorder is off (KVCACHED_FLIGHT_RECORDER_EVENTS=0)")
            return dump
        if request.op == "limit":
            return ErrorReply("limit: this service belongs to no engine whose memory it could limit")
        if request.op == "status":
            counts = None
            if lg is not None:
                counts = LedgerCounts(
                    policy=lg.policy.value,
                    index=lg.index,
                    build=lg.build,
                    num_pages=lg.num_pages,
                    mapped_pages=lg.mapped_pages,
                    pinned_pages=lg.pinned_pages,
                    releasable_pages=len(lg.releasable),
                    outstanding_jobs=lg.outstanding_jobs(),
                    violations=len(lg.violations),
                    lossy=lg.lossy,
                    dropped_events=lg.dropped_events,
                    maps=lg.maps,
                    unmaps=lg.unmaps,
                    jobs_failed=lg.jobs_failed,
                )
            by_invariant: dict[str, int] = {}
            by_kind: dict[str, int] = {}
            if lg is not None:
                for v in lg.violations:
                    by_invariant[v.invariant] = by_invariant.get(v.invariant, 0) + 1
                seen: set[tuple[int, str]] = set()
                for row in self._pin_rows(lg):
                    if (row.page, row.kind) not in seen:
                        seen.add((row.page, row.kind))
                        by_kind[row.kind] = by_kind.get(row.kind, 0) + 1
            return StatusReply(
                pid=os.getpid(),
                uptime_s=time.time() - svc.started_unix,
                events=svc.index,
                ledger=counts,
                journal=svc.journal_status(),
                handoff=svc.handoff_status(),
                clients=self.clients,
                dropped_clients=self.dropped_clients,
                evicted_clients=self.evicted_clients,
                engine=engine,
                memory=memory,
                flight=svc.flight_status(),
                violations_by_invariant=by_invariant,
                pinned_by_kind=by_kind,
            )
        if lg is None:
            return ErrorReply(f"'{request.op}' needs the service's ledger replica, which is off (replica=False)")
        if request.op == "why":
            if request.page is None or not 0 <= request.page < lg.num_pages:
                return ErrorReply(f"why: page {request.page} is not a page of this ledger (0..{lg.num_pages - 1})")
            return WhyReply(lg.why(request.page))
        rows = self._pin_rows(lg)
        limit = request.limit if request.limit is not None and request.limit >= 0 else len(rows)
        return PinsReply(
            index=lg.index,
            build=lg.build,
            pinned_pages=lg.pinned_pages,
            lossy=lg.lossy,
            truncated=limit < len(rows),
            rows=rows[:limit],
        )

    def _pin_rows(self, lg: Ledger) -> list[PinRow]:
        # An operator (or a metrics scrape) asks again and again while an idle engine holds its
        # pages: same index, same rows.
        key = (id(lg), lg.index)
        if self._pins_cache is None or self._pins_cache[0] != key:
            self._pins_cache = (key, pin_rows(lg))
        return self._pins_cache[1]


def _client_gone(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_client_gone(e) for e in exc.exceptions)
    return isinstance(exc, (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.EndOfStream, OSError))


# --- the client (blocking: kvctl and scripts) -------------------------------------------------


def default_socket_dir() -> str:
    run = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(run, "kvcached") if run else f"/tmp/kvcached-{os.getuid()}"


def default_socket_path() -> str:
    """Where an engine puts its socket unless told: ``$KVCACHED_LEDGER_SOCKET`` or one per pid."""
    return os.environ.get(SOCKET_ENV) or os.path.join(default_socket_dir(), f"ledger-{os.getpid()}.sock")


def sockets_in(folder: str | None = None) -> list[str]:
    """The sockets in ``folder`` (the default directory), sorted; none if it does not exist."""
    where = folder or default_socket_dir()
    try:
        return sorted(os.path.join(where, n) for n in os.listdir(where) if n.endswith(".sock"))
    except OSError:
        return []


def known_sockets(folder: str | None = None) -> list[str]:
    """Every socket an engine of this user may listen on: ``$KVCACHED_LEDGER_SOCKET`` first, then
    those of the default directory (for kvctl list and the metrics collector)."""
    env = os.environ.get(SOCKET_ENV)
    return list(dict.fromkeys(([env] if env else []) + sockets_in(folder)))


def find_socket(path: str | None = None) -> str:
    """``path``, ``$KVCACHED_LEDGER_SOCKET``, or the one socket in the default directory."""
    if path:
        return path
    if os.environ.get(SOCKET_ENV):
        return os.environ[SOCKET_ENV]
    folder = default_socket_dir()
    found = sockets_in(folder)
    if len(found) == 1:
        return found[0]
    if not found:
        raise LiveViewError(f"no ledger service found in {folder}; pass --socket PATH or set {SOCKET_ENV}")
    raise LiveViewError(f"{len(found)} ledger services in {folder} ({', '.join(found)}); pick one with --socket")


# A socket younger than this is not called dead: a service binds its socket a moment before it
# listens, and a connect in between is refused too; an engine starting beside a prune (eight
# data-parallel engine cores start at once, each pruning) must not lose its socket to it.
DEAD_SOCKET_MIN_AGE: Final = 2.0


def is_dead_socket(path: str, *, min_age: float = DEAD_SOCKET_MIN_AGE) -> bool:
    """Whether ``path`` is certainly a socket nobody serves: a socket (``lstat``: a link is never
    followed, a file is never one) of this user, bound at least ``min_age`` seconds ago, whose
    connect is refused (ECONNREFUSED). A full listen queue (EAGAIN), a timeout or a permission
    error say someone may be there, so they are not dead."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.getuid() or time.time() - st.st_mtime < min_age:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def prune_dead_sockets(
    folder: str | None = None, *, prefix: str = "", min_age: float = DEAD_SOCKET_MIN_AGE
) -> list[str]:
    """Removes the dead sockets (``is_dead_socket``) of ``folder`` (the default directory) whose
    names start with ``prefix``; returns those removed. What SIGKILL leaves piles up on a machine
    that restarts servers all day, and every kvctl call and scrape would ask each of them."""
    removed = []
    for path in sockets_in(folder):
        if os.path.basename(path).startswith(prefix) and is_dead_socket(path, min_age=min_age):
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue  # gone meanwhile
            except OSError as exc:
                log.debug("kvcached: cannot remove the dead socket %s: %s", path, exc)
                continue
            removed.append(path)
    return removed


def _prune_beside(path: str) -> None:
    """On start, the dead sockets of other engines in the default directory, where engines put
    theirs (``ledger-<pid>.sock``); a directory the operator chose (``KVCACHED_LEDGER_SOCKET``)
    may hold other programs' sockets, so it is left alone."""
    folder = default_socket_dir()
    if os.path.dirname(os.path.abspath(path)) != os.path.abspath(folder):
        return
    try:
        gone = prune_dead_sockets(folder, prefix="ledger-")
    except OSError as exc:  # no descriptor for a probe, say: tidying up must not stop a start
        log.debug("kvcached: not pruning dead sockets in %s: %s", folder, exc)
        return
    if gone:
        log.info("kvcached: removed %s left by stopped engines in %s", plural(len(gone), "dead socket"), folder)


def _connect(path: str, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:
            # EAGAIN: the service's listen queue is full (it takes connections as places free):
            # a Unix socket with a timeout does not wait for room, so wait here, within the timeout.
            sock.close()
            if time.monotonic() >= deadline:
                raise LiveViewError(f"{path}: the ledger service is busy: no connection in {timeout:g} s") from None
            time.sleep(0.01)
        except OSError as exc:
            sock.close()
            _unreachable(path, exc)


def _unreachable(path: str, exc: OSError) -> NoReturn:
    why = {
        FileNotFoundError: "no such socket (is the engine running with the ledger service?)",
        ConnectionRefusedError: "nothing listens there (a socket left by a stopped engine)",
        PermissionError: "permission denied (the socket belongs to another user)",
    }.get(type(exc), exc.strerror or str(exc))
    raise LiveViewError(f"cannot reach the ledger service at {path}: {why}") from None


def _receive(sock: socket.socket, path: str) -> Reply:
    try:
        head = _recv_exactly(sock, LEN.size)
        (size,) = LEN.unpack(head)
        if size > MAX_REPLY:
            raise LiveViewError(f"{path}: a reply of {size} bytes exceeds {MAX_REPLY}")
        body = _recv_exactly(sock, size)
    except TimeoutError:
        raise LiveViewError(f"{path}: the ledger service did not answer in time") from None
    except OSError as exc:
        raise LiveViewError(f"{path}: the connection failed: {exc.strerror or exc}") from None
    try:
        reply: Reply = msgspec.msgpack.decode(body, type=Reply)
    except msgspec.DecodeError as exc:
        raise LiveViewError(f"{path}: not a ledger service reply: {exc}") from None
    if isinstance(reply, ErrorReply):
        raise RefusedError(f"the ledger service refused the request: {reply.message}")
    return reply


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise OSError(0, "the service closed the connection")
        got += k
    return bytes(buf)


def request(path: str, req: Request, *, timeout: float = 10.0) -> Reply:
    """One request, one reply; every failure is a one-line ``LiveViewError``."""
    with _connect(path, timeout) as sock:
        try:
            sock.sendall(frame(req))
        except OSError as exc:
            raise LiveViewError(f"{path}: the connection failed: {exc.strerror or exc}") from None
        return _receive(sock, path)


def tail(path: str, *, timeout: float = 10.0) -> Iterator[tuple[int, list[Event]]]:
    """``(index of the first event, events)`` per batch, as the service journals them."""
    decode = msgspec.msgpack.Decoder(list[Event]).decode
    with _connect(path, timeout) as sock:
        sock.sendall(frame(Request(op="tail")))
        sock.settimeout(None)  # events come when the engine makes them
        while True:
            reply = _receive(sock, path)
            if not isinstance(reply, EventsReply):
                raise LiveViewError(f"{path}: expected events, got a {type(reply).__name__}")
            yield reply.first, decode(reply.events)
