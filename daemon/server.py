"""The daemon's sockets: the ZeroMQ control plane and the Unix handle plane.

One thread, one poll loop, so every request runs to completion before the
next starts and admission needs no locks. The server decodes, checks the
session token, calls the :class:`State` and encodes the reply; it never calls
the driver itself.

Handle plane: each session is one ``SOCK_SEQPACKET`` connection. Its first
datagram is the :class:`Hello`; the peer's pid/uid/gid come from
``SO_PEERCRED``; when it closes the session ends and its buffers are freed.
Exported FDs travel on it in batches, queued per session and sent as the
socket drains, so a slow reader never blocks the daemon.

A session ends with its process, not with the last copy of its socket. A
worker that forked a helper (which never speaks to hbmd) shares the socket
with it, so the socket's EOF would wait for the helper too, and the
worker's persistent buffers could not be attached by its replacement. So at
accept the daemon opens a pidfd (``pidfd_open``) for the ``SO_PEERCRED``
pid, the process that connected, and polls it with the sockets: when it
turns readable that process has exited and the session ends, even while the
socket is still open elsewhere. The pidfd is taken at accept, moments
after the connect, so the window in which the pid could pass to another
process is that short. Where there is no pidfd (kernels before 5.3, or a
peer in a pid namespace the daemon cannot see, whose pid reads 0) the
socket's EOF alone ends the session. A request that meets a session whose
process has died but whose exit the loop has not handled yet (an attach
right after a SIGKILL) ends that session first, so it is not refused for a
holder that is gone.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import logging
import os
import select
import signal
import socket
import struct
import termios
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import zmq
from hbmd.proto import (
    MAX_FDS_PER_DATAGRAM,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Attach,
    BufferCreated,
    BufferList,
    Commit,
    CommitSegments,
    Committed,
    CreateBuffer,
    Defragment,
    Delete,
    Detach,
    Detached,
    ErrorReply,
    FdBatch,
    FinishDefragment,
    Free,
    Freed,
    Hello,
    LeasePlace,
    LeaseGrant,
    LeaseReturn,
    LeaseRevoke,
    ListBuffers,
    ListSessions,
    Message,
    Reclaim,
    ReclaimDone,
    ReclaimRequest,
    ReclaimSent,
    Refused,
    Release,
    Released,
    Remap,
    Request,
    Seal,
    Sealed,
    SessionList,
    Status,
    StatusReply,
    Welcome,
    decode_body,
    decode_datagram,
    encode_datagram,
    encode_frames,
    peek_request_id,
    read_envelope,
    requests,
)
from hbmd.proto.errors import (
    Conflict,
    DaemonUnavailable,
    HbmdError,
    InternalError,
    NotFound,
    OutOfBudget,
    PermissionDenied,
    ProtocolError,
    VersionMismatch,
)
from hbmd.proto.instance import VERSION, InstanceInfo, InstancePaths

from .fds import limit as fd_limit
from .fds import open_count as open_fds
from .fds import usable as usable_fds
from .notify import SystemdNotifier
from .rundir import create_file, open_instance_directory, open_lock
from .state import Buffer, Chunk, Session, State

if TYPE_CHECKING:  # both are optional collaborators; prometheus_client loads only when metrics are asked for
    from .metrics import Metrics
    from .persist import Persistence

log = logging.getLogger("hbmd.server")

HELLO_TIMEOUT_S = 5.0
MAX_DATAGRAM = 64 << 10
MAX_FDS_IN = 16
"""FDs accepted (and closed at once) on an inbound datagram; clients send none."""
MAX_FDS_IN_FLIGHT = 4096
"""FDs one session may have sent to it and not yet read (a 32nd of RLIMIT_NOFILE where less, one batch at least)."""
MAX_FDS_IN_FLIGHT_PER_UID = 16384
"""The same for all sessions of one uid together (an 8th of RLIMIT_NOFILE where less, one batch at least).

The kernel charges FDs queued on sockets to the sender's user, up to its RLIMIT_NOFILE, and beyond it
refuses every send alike (ETOOMANYREFS). They stay charged until the peer reads them or closes its socket:
ending a session that does not read would not give them back, only lose count of them. So such a session
is held, not ended: nothing more is sent to it until it reads, and its uid's other sessions keep the rest
of the uid's share; other uids are not touched."""
MAX_QUEUED_BATCHES = 1024
"""FD batches (of up to 250) waiting in one session's outbox: past it, requests for more FDs are refused."""
DRAIN_CHECK_S = 0.02
"""How often a session waiting for its socket to drain is looked at again."""
WARNING_INTERVAL_S = 10.0
MAX_TENANTS_LISTED = 1000
"""Tenants in one status reply: it must stay far below the frame limit however many names clients declare."""
MAX_DATAGRAMS_PER_DRAIN = 1024
"""Datagrams read from one session at a time (placements of leased granules; an honest client sends one per commit)."""
MAX_PENDING_HELLOS_PER_UID = 64
"""Connections of one uid that have not sent their hello yet (each holds an FD); a newer one closes the oldest."""


class RateLimitedLog:
    """Warnings of one kind at most once per interval, with a count of those held back."""

    def __init__(self, logger: logging.Logger, interval_s: float = WARNING_INTERVAL_S) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, kind: str, message: str, *args: object) -> None:
        now = time.monotonic()
        last, held_back = self._last.get(kind, (-self._interval_s, 0))
        if now - last < self._interval_s:
            self._last[kind] = (last, held_back + 1)
            return
        self._last[kind] = (now, 0)
        suffix = f" ({held_back} more like it in the last {self._interval_s:.0f} s)" if held_back else ""
        self._log.warning(message + suffix, *args)


def unread_bytes(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` that its peer has not read yet (``SIOCOUTQ``): 0 once it read everything."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


class AlreadyRunning(RuntimeError):
    """Another daemon holds the instance's lock."""


class HandlerTableError(RuntimeError):
    """The server's handlers and the protocol's requests do not match one to one: the daemon must not start."""


Handler = TypeVar("Handler", bound=Callable[..., Message])
T = TypeVar("T")


def handles(kind: type[Request]) -> Callable[[Handler], Handler]:
    """Mark a :class:`Server` method as the handler of request ``kind``: ``(conn, request_id, msg) -> kind.Reply``."""

    def mark(method: Handler) -> Handler:
        method.handles = kind  # type: ignore[attr-defined]
        return method

    return mark


def handler_table(cls: type, request_kinds: list[type[Request]]) -> dict[type[Request], str]:
    """The method name handling each request kind of ``cls``, checked against ``request_kinds``.

    Raises :class:`HandlerTableError` when a request has no handler, a handler
    handles something that is not a request, or two handle the same one.
    """
    table: dict[type[Request], str] = {}
    for name in dir(cls):
        kind = getattr(getattr(cls, name), "handles", None)
        if kind is None:
            continue
        if not (isinstance(kind, type) and issubclass(kind, Request)) or kind not in request_kinds:
            raise HandlerTableError(f"{cls.__name__}.{name} handles {kind!r}, which is not a request of the protocol")
        if kind in table:
            raise HandlerTableError(f"{kind.KIND} is handled twice: by {table[kind]} and {name}")
        table[kind] = name
    missing = [kind.KIND for kind in request_kinds if kind not in table]
    if missing:
        raise HandlerTableError(f"{cls.__name__} has no handler for {', '.join(missing)}")
    return table


@dataclasses.dataclass
class FdDelivery:
    """One queued batch of chunk FDs for a session's handle socket: a request's, or (``buffer`` None) a lease."""

    request_id: int
    buffer: Buffer | None
    chunks: list[Chunk]
    batch: int
    batches: int

    def header(self, granule: int) -> FdBatch | LeaseGrant:
        chunk_ids = [c.chunk_id for c in self.chunks]
        if self.buffer is None:
            return LeaseGrant(chunk_ids, granule)
        return FdBatch(self.request_id, chunk_ids, self.batch, self.batches)


@dataclasses.dataclass
class HandleConnection:
    sock: socket.socket
    pid: int
    uid: int
    gid: int
    groups: set[int]
    accepted_at: float
    pidfd: int = -1
    """A pidfd of the peer process, readable once it has exited; -1 where the kernel gives none."""
    session: Session | None = None
    protocol_minor: int = 0
    """The minor version the client speaks (from its hello)."""
    outbox: collections.deque[FdDelivery] = dataclasses.field(default_factory=collections.deque)
    fds_in_flight: int = 0
    """FDs sent since the peer was last seen to have read everything."""


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int, set[int]]:
    """``(pid, uid, gid, groups)`` of the peer, from the kernel (``SO_PEERCRED``, ``SO_PEERGROUPS``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    groups = {gid}
    try:
        extra = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 4 * 256)
        groups.update(struct.unpack(f"{len(extra) // 4}I", extra))
    except OSError:
        pass  # older kernels: the primary group alone decides
    return pid, uid, gid, groups


def open_pidfd(pid: int) -> int:
    """A pidfd for ``pid``, or -1 where pidfds are unavailable; ``ProcessLookupError`` when it has already exited."""
    if pid <= 0 or not hasattr(os, "pidfd_open"):
        return -1
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        raise
    except OSError as exc:
        log.debug("no pidfd for pid %d (%s): its session ends at its socket's EOF", pid, exc)
        return -1


def readable_now(fd: int) -> bool:
    """Whether ``fd`` is readable at this instant (a pidfd: its process has exited)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class Server:
    """Serves one :class:`State` on one instance directory until :meth:`stop`."""

    def __init__(
        self,
        state: State[Any, Any],
        paths: InstancePaths,
        *,
        lock: threading.Lock,
        notifier: SystemdNotifier | None = None,
        group: int | None = None,
        metrics: Metrics | None = None,
        persistence: Persistence | None = None,
        check_invariants: bool = False,
    ) -> None:
        """Raises :class:`HandlerTableError` when a request of the protocol has no handler here.

        ``lock`` is held while the loop touches the state, so a metrics scrape
        on another thread sees it whole. ``check_invariants``: check the
        state's books after every batch of events and log any imbalance (tests).
        """
        self._handlers = {kind: getattr(self, name) for kind, name in handler_table(type(self), requests()).items()}
        self.state = state
        self.paths = paths
        self.group = group
        self.lock = lock
        self.metrics = metrics
        self.persistence = persistence
        self.check_invariants = check_invariants
        self._notifier = notifier if notifier is not None else SystemdNotifier(None)
        self._stopping = False
        self._lock_fd = -1
        self._dir_fd = -1
        self._reserve_fd = -1
        """Kept open to be closed when the descriptors run out: one to accept a waiting peer with, and refuse it."""
        self._context = zmq.Context.instance()
        self._router: zmq.Socket | None = None
        self._listener: socket.socket | None = None
        self._wake_r = self._wake_w = -1
        self._poller = zmq.Poller()
        self._connections: dict[int, HandleConnection] = {}
        self._by_session: dict[int, HandleConnection] = {}
        self._by_pidfd: dict[int, HandleConnection] = {}
        self._session_fd_share = max(MAX_FDS_PER_DATAGRAM, min(MAX_FDS_IN_FLIGHT, fd_limit() // 32))
        self._uid_fd_share = max(MAX_FDS_PER_DATAGRAM, min(MAX_FDS_IN_FLIGHT_PER_UID, fd_limit() // 8))
        self._draining: set[int] = set()
        """Handle sockets (by fd) with FDs queued until their peer reads what it has."""
        self._placing = select.poll()
        """Handle sockets of sessions that place leased granules: read before any request is answered."""
        self._warnings = RateLimitedLog(log)

    # lifecycle

    def bind(self) -> None:
        """Take the instance lock and bind both sockets.

        Raises ``RunDirectoryError`` where someone else could change the
        instance directory, :class:`AlreadyRunning` where another daemon serves it.
        """
        self.paths.check_lengths()
        self._dir_fd = open_instance_directory(self.paths.directory, self.group)
        self._lock_fd = open_lock(self._dir_fd, self.paths.lock.name)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise AlreadyRunning(f"another hbmd is already serving {self.paths.directory}") from None
        for stale in (self.paths.control, self.paths.handles, self.paths.info, self._info_tmp):
            try:
                os.unlink(stale.name, dir_fd=self._dir_fd)
            except FileNotFoundError:
                pass

        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES + 4096)
        # A control connection that never completes the ZeroMQ greeting is dropped as a hello-less one is.
        self._router.setsockopt(zmq.HANDSHAKE_IVL, int(HELLO_TIMEOUT_S * 1000))
        self._router.bind(self.paths.endpoint)
        os.chmod(self.paths.control, 0o660)
        self._set_group(self.paths.control)

        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind(os.fspath(self.paths.handles))
        os.chmod(self.paths.handles, 0o660)
        self._set_group(self.paths.handles)
        self._listener.listen(socket.SOMAXCONN)  # a burst of connections must not turn honest clients away
        self._listener.setblocking(False)

        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._reserve_fd = self._open_reserve()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._listener.fileno(), zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def _set_group(self, path: os.PathLike) -> None:
        """Hand ``path`` to the ``--group``, whose members may then connect (mode 0660).

        Only for the sockets, just bound in the daemon's own directory: nobody
        else could have put a link in their place.
        """
        if self.group is not None:
            os.chown(path, -1, self.group)

    @property
    def _info_tmp(self) -> Path:
        return self.paths.info.with_suffix(".tmp")

    def publish(self) -> None:
        """Write ``instance.json``: clients and tools find the instance by it, so it comes once all is up."""
        backend = self.state.backend
        info = InstanceInfo(
            instance=backend.instance,
            backend=backend.name,
            device_index=backend.device_index,
            device_uuid=backend.device_uuid,
            pid=os.getpid(),
            protocol=list(PROTOCOL_VERSION),
            daemon_version=VERSION,
            control=self.paths.endpoint,
            handles=os.fspath(self.paths.handles),
        )
        fd = create_file(self._dir_fd, self._info_tmp.name, 0o644, self.group)
        with os.fdopen(fd, "w") as tmp:
            tmp.write(info.to_json())
        os.replace(self._info_tmp.name, self.paths.info.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop; the wake pipe interrupts the poll."""
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def stop(self) -> None:
        self._stopping = True

    def run(self) -> None:
        idle_work = True
        while not self._stopping:
            timeout = 0 if idle_work else DRAIN_CHECK_S * 1000 if self._draining else 1000
            events = self._poller.poll(timeout=timeout)
            with self.lock:
                for fd_or_socket, _ in events:
                    try:
                        self._on_event(fd_or_socket)
                    except Exception:
                        # A bug met by one peer's input must not stop the daemon for every other.
                        log.exception("handling an event on %r failed", fd_or_socket)
                self._retry_draining()
                self._expire_pending()
                self._serve_leases()
                if self.check_invariants and events:
                    self._check_books()
                if self.persistence is not None:
                    self.persistence.sync()
                idle_work = self._idle() if not events else True
            self._notifier.watchdog()

    def _check_books(self) -> None:
        try:
            self.state.check_invariants()
        except AssertionError as exc:
            log.error("the books do not balance: %s", exc)

    def _idle(self) -> bool:
        """One step of the backend's background work (the warm pool); False when done or failing."""
        try:
            return self.state.backend.idle()
        except (HbmdError, OSError) as exc:
            log.debug("background work paused: %s", exc)
            return False

    def _on_event(self, fd_or_socket: object) -> None:
        if fd_or_socket is self._router:
            self._drain_control()
        elif fd_or_socket == self._wake_r:
            self._drain_wake()
        elif self._listener is not None and fd_or_socket == self._listener.fileno():
            self._accept()
        else:
            conn = self._connections.get(fd_or_socket)
            if conn is not None:
                self._on_handle_event(conn)
                return
            conn = self._by_pidfd.get(fd_or_socket)
            # Checked again: the event may be stale, its descriptor number reused this very loop.
            if conn is not None and readable_now(conn.pidfd):
                self._close_connection(conn, "process exited")

    def close(self) -> None:
        """End every session, drop the sockets, files and lock."""
        for conn in list(self._connections.values()):
            self._close_connection(conn, "daemon stopping")
        if self._router is not None:
            self._router.close(linger=0)
        if self._listener is not None:
            self._listener.close()
        if self._lock_fd >= 0:
            # Only the daemon holding the lock may remove what it made: another one may be serving.
            for path in (self.paths.control, self.paths.handles, self.paths.info):
                try:
                    os.unlink(path.name, dir_fd=self._dir_fd)
                except FileNotFoundError:
                    pass
        for fd in (self._wake_r, self._wake_w, self._lock_fd, self._dir_fd, self._reserve_fd):
            if fd >= 0:
                os.close(fd)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    # handle plane

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE):
                    self._refuse_without_fds(exc)
                else:
                    self._warnings.warning("accept", "accepting a handle connection failed: %s", exc)
                return
            if open_fds() > usable_fds():
                # Keep the headroom libzmq needs (it aborts on EMFILE): a session would cost two more.
                self._warnings.warning("fds", "refusing handle connections: %s", self._out_of_fds_message())
                self._refuse(sock, self._out_of_fds_message())
                continue
            sock.setblocking(False)
            try:
                pid, uid, gid, groups = peer_credentials(sock)
            except OSError as exc:
                self._warnings.warning("peercred", "reading peer credentials failed: %s", exc)
                sock.close()
                continue
            pending = [c for c in self._connections.values() if c.session is None and c.uid == uid]
            if len(pending) >= MAX_PENDING_HELLOS_PER_UID:
                # The oldest goes, not the newcomer: an honest client says hello at once, a flood's do not.
                oldest = min(pending, key=lambda c: c.accepted_at)
                self._warnings.warning(
                    "pending", "uid %d has %d connections without a hello; closing the oldest (pid %d)",
                    uid, len(pending), oldest.pid,
                )
                self._send_quietly(oldest, Refused(
                    DaemonUnavailable.code.wire,
                    f"closed: uid {uid} has {len(pending)} connections that sent no hello yet",
                ))
                self._close_connection(oldest, "too many connections without a hello")
            try:
                pidfd = open_pidfd(pid)
            except ProcessLookupError:
                sock.close()  # the peer is gone already
                continue
            conn = HandleConnection(sock, pid, uid, gid, groups, time.monotonic(), pidfd)
            self._connections[sock.fileno()] = conn
            self._poller.register(sock.fileno(), zmq.POLLIN)
            if pidfd >= 0:
                self._by_pidfd[pidfd] = conn
                self._poller.register(pidfd, zmq.POLLIN)

    @staticmethod
    def _refuse(sock: socket.socket, message: str) -> None:
        """Turn a peer away at once with a retryable refusal (it is busy, not forbidden)."""
        try:
            sock.send(encode_datagram(Refused(DaemonUnavailable.code.wire, message)))
        except OSError:
            pass  # it left already
        sock.close()

    def _refuse_without_fds(self, exc: OSError) -> None:
        """Out of descriptors: accept and refuse each waiting peer through the reserve FD, so the loop does not spin.

        A listener with peers waiting stays readable; left there, they would wake the poll at once, forever.
        """
        message = self._out_of_fds_message()
        self._warnings.warning("fds", "refusing handle connections: %s (%s)", message, exc.strerror)
        if self._reserve_fd < 0:
            return
        os.close(self._reserve_fd)
        self._reserve_fd = -1
        try:
            while True:
                sock, _ = self._listener.accept()
                self._refuse(sock, message)
        except OSError:
            pass  # none left waiting, or still no descriptor: the next event tries again
        finally:
            self._reserve_fd = self._open_reserve()

    @staticmethod
    def _out_of_fds_message() -> str:
        return f"the daemon is out of file descriptors (RLIMIT_NOFILE {fd_limit()}); retry once others disconnect"

    @staticmethod
    def _open_reserve() -> int:
        try:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1

    def _expire_pending(self) -> None:
        now = time.monotonic()
        self.state.ask_back_idle_leases(now)
        for conn in list(self._connections.values()):
            if conn.session is None and now - conn.accepted_at > HELLO_TIMEOUT_S:
                self._close_connection(conn, "no hello in time")
            elif conn.session is not None and conn.session.reclaim is not None:
                reclaim = conn.session.reclaim
                if not reclaim.reported and reclaim.outcome(now, self.state.reclaim_patience_s) == "ignored":
                    reclaim.reported = True
                    log.warning(
                        "session %d (pid %d) has not answered reclaim request %d for %d bytes; it keeps running",
                        conn.session.session_id, conn.pid, reclaim.reclaim_id, reclaim.requested_bytes,
                    )

    def _receive(self, conn: HandleConnection) -> bytes | None:
        """One inbound datagram (b"" for one dropped), or None when the peer is gone; ``BlockingIOError`` when none waits.

        Inbound FDs are closed.
        """
        try:
            data, fds, flags, _ = socket.recv_fds(conn.sock, MAX_DATAGRAM, MAX_FDS_IN, socket.MSG_DONTWAIT)
        except InterruptedError:
            raise BlockingIOError from None
        except BlockingIOError:
            raise
        except OSError:
            return None
        for fd in fds:
            os.close(fd)
        if fds:
            self._warnings.warning("fds-in", "pid %d sent %d unsolicited file descriptors; closed them", conn.pid, len(fds))
        if not data and not fds:
            return None
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            self._warnings.warning("oversized", "pid %d sent an oversized datagram; dropped", conn.pid)
            return b""
        return data

    def _on_handle_event(self, conn: HandleConnection) -> None:
        if conn.outbox:
            self._flush(conn)
        if conn.session is not None:
            if not self._drain_datagrams(conn):
                self._close_connection(conn, "connection closed")
            return
        try:
            data = self._receive(conn)
        except BlockingIOError:
            return
        if data is None:
            self._close_connection(conn, "connection closed")
        elif data:
            self._handshake(conn, data)

    def _take_placements(self) -> None:
        """Apply every leased granule's placement sent so far, by any session: a request sees all commits that returned.

        One ``poll`` over the placing sessions' sockets; only those with
        datagrams waiting are read.
        """
        for fd, _ in self._placing.poll(0):
            conn = self._connections.get(fd)
            if conn is not None and conn.session is not None:
                self._drain_datagrams(conn)

    def _drain_datagrams(self, conn: HandleConnection) -> bool:
        """Apply every datagram the session's client has sent (its leased granules' placements); False at its EOF.

        Run before any request is answered and before the session ends, so
        the daemon's record of its buffers includes every placement its
        client sent before. An honest client has one or two in flight; a
        peer that keeps sending is read :data:`MAX_DATAGRAMS_PER_DRAIN` at a
        time, so it cannot hold the loop.
        """
        for _ in range(MAX_DATAGRAMS_PER_DRAIN):
            try:
                data = self._receive(conn)
            except BlockingIOError:
                return True
            if data is None:
                return False
            if data:
                self._apply_datagram(conn, data)
        self._warnings.warning(
            f"flood-{conn.uid}", "session %d (pid %d) sends datagrams faster than they are read", conn.session.session_id,
            conn.pid,
        )
        return True

    def _apply_datagram(self, conn: HandleConnection, data: bytes) -> None:
        session = conn.session
        try:
            msg = decode_datagram(data)
            if isinstance(msg, LeasePlace):
                self.state.place(session, msg.buffer_id, msg.sizes, msg.chunk_ids, msg.offsets)
            elif isinstance(msg, LeaseReturn):
                self.state.return_lease(session, msg.chunk_ids)
            else:
                log.debug("session %d sent an unexpected %s datagram; ignored", session.session_id, msg.KIND)
        except HbmdError as exc:
            # A client placing granules it was not leased, or where the growth needs none: nothing changed.
            self._warnings.warning(
                f"datagram-{conn.uid}", "session %d (pid %d) sent a datagram that was refused: %s",
                session.session_id, conn.pid, exc.message,
            )

    def _handshake(self, conn: HandleConnection, data: bytes) -> None:
        try:
            self._open_session(conn, data)
        except Exception:
            log.exception("handshake with pid %d failed", conn.pid)
            self._send_quietly(conn, Refused(InternalError.code.wire, "internal error during the handshake"))
            self._close_connection(conn, "handshake failed")

    def _open_session(self, conn: HandleConnection, data: bytes) -> None:
        try:
            hello = decode_datagram(data)
            if not isinstance(hello, Hello):
                raise ProtocolError(f"expected a hello, got {hello.KIND}")
            if len(hello.version) != 2 or min(hello.version) < 0:
                raise VersionMismatch(f"hello version must be [major, minor], got {hello.version[:4]}")
            if hello.version[0] != PROTOCOL_VERSION[0]:
                raise VersionMismatch(
                    f"client speaks protocol {'.'.join(map(str, hello.version))}, "
                    f"this daemon speaks {PROTOCOL_VERSION[0]}.x"
                )
            access = self.state.config.access
            if not access.admits(conn.uid, conn.groups):
                raise PermissionDenied(f"uid {conn.uid} is not allowed to use hbmd instance {self.state.backend.instance}")
            session = self.state.open_session(
                conn.pid,
                conn.uid,
                conn.gid,
                hello.client_name,
                hello.tenant,
                admin=conn.uid in access.admin_uids,
                observer=hello.observer,
                lease=hello.lease and hello.version[1] >= 3,
            )
        except HbmdError as exc:
            self._send_quietly(conn, Refused(exc.code.wire, exc.message))
            self._close_connection(conn, f"refused: {exc.message}")
            return
        conn.session = session
        conn.protocol_minor = hello.version[1]
        self._by_session[session.session_id] = conn
        if session.wants_lease:
            self._placing.register(conn.sock.fileno(), select.POLLIN)
        backend = self.state.backend
        self._send_quietly(
            conn,
            Welcome(
                token=session.token,
                session_id=session.session_id,
                instance=backend.instance,
                backend=backend.name,
                granularity=backend.granularity,
                version=list(PROTOCOL_VERSION),
                daemon_version=VERSION,
                device_uuid=backend.device_uuid,
                device_index=backend.device_index,
                lease_bytes=self.state.lease_bytes_for(session),
            ),
        )
        # Observers (hbmctl, probes) connect every few seconds: at INFO they would bury the workers.
        log.log(
            logging.DEBUG if session.observer else logging.INFO,
            "session %d opened: pid %d uid %d%s",
            session.session_id,
            conn.pid,
            conn.uid,
            f" ({hello.client_name})" if hello.client_name else "",
        )

    def _send_quietly(self, conn: HandleConnection, msg: Message) -> None:
        try:
            conn.sock.send(encode_datagram(msg))
        except OSError as exc:
            log.debug("sending %s to pid %d failed: %s", msg.KIND, conn.pid, exc)

    def _close_connection(self, conn: HandleConnection, why: str) -> None:
        fd = conn.sock.fileno()
        if conn.session is not None and conn.session.wants_lease:
            # Placements the client sent before it died are in the socket still: its buffers must include them.
            self._drain_datagrams(conn)
            try:
                self._placing.unregister(fd)
            except KeyError:
                pass
        self._connections.pop(fd, None)
        try:
            self._poller.unregister(fd)
        except KeyError:
            pass
        conn.outbox.clear()
        self._draining.discard(fd)
        conn.sock.close()
        if conn.pidfd >= 0:
            self._by_pidfd.pop(conn.pidfd, None)
            self._poller.unregister(conn.pidfd)
            os.close(conn.pidfd)
            conn.pidfd = -1
        if conn.session is not None:
            self._by_session.pop(conn.session.session_id, None)
            freed = self.state.close_session(conn.session)
            log.log(logging.DEBUG if conn.session.observer else logging.INFO,
                    "session %d ended (%s): freed %d bytes", conn.session.session_id, why, freed)

    def _may_send(self, conn: HandleConnection, count: int) -> bool:
        """Whether ``count`` more FDs keep the session and its uid within their shares of FDs in flight."""
        for other in self._connections.values():
            if other.uid == conn.uid and other.fds_in_flight and unread_bytes(other.sock) == 0:
                other.fds_in_flight = 0
        uid_in_flight = sum(c.fds_in_flight for c in self._connections.values() if c.uid == conn.uid)
        if conn.fds_in_flight + count <= self._session_fd_share and uid_in_flight + count <= self._uid_fd_share:
            return True
        self._warnings.warning(
            f"held-{conn.uid}", "holding FDs for session %d (pid %d, uid %d): %d of its FDs and %d of its uid's "
            "are unread", conn.session.session_id if conn.session else 0, conn.pid, conn.uid, conn.fds_in_flight,
            uid_in_flight,
        )
        return False

    def _retry_draining(self) -> None:
        """Send on to sessions that were held until their peers read what they have."""
        for fd in list(self._draining):
            conn = self._connections.get(fd)
            if conn is None:
                self._draining.discard(fd)
            else:
                self._flush(conn)

    def _flush(self, conn: HandleConnection) -> None:
        """Send queued FD batches while the peer keeps up and the socket has room; close each FD once sent."""
        waiting = False
        while conn.outbox:
            delivery = conn.outbox[0]
            if delivery.buffer is None:
                # Leased granules the client gave back before they were sent (it cannot have known them) stay here.
                delivery.chunks = [c for c in delivery.chunks if c.live]
                if not delivery.chunks:
                    conn.outbox.popleft()
                    continue
            if not self._may_send(conn, len(delivery.chunks)):
                waiting = True
                break
            header = delivery.header(self.state.backend.granularity)
            fds: list[int] = []
            try:
                if not all(c.live for c in delivery.chunks):
                    raise InternalError("chunks were released before they were delivered")
                for chunk in delivery.chunks:
                    fds.append(self.state.export(delivery.buffer, chunk) if delivery.buffer is not None else self.state.export_leased(chunk))
            except (HbmdError, OSError) as exc:
                self._warnings.warning("export", "export for request %d failed: %s", delivery.request_id, exc)
                for fd in fds:
                    os.close(fd)
                fds = []
                if isinstance(header, LeaseGrant):
                    # Never sent, so never placed: back they go.
                    self.state.return_lease(conn.session, header.chunk_ids)
                    conn.outbox.popleft()
                    continue
                header = dataclasses.replace(header, error=str(exc))
            try:
                socket.send_fds(conn.sock, [encode_datagram(header)], fds)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno == errno.ETOOMANYREFS:
                    # Too many FDs in flight for this user, on all sessions together: wait for readers.
                    waiting = True
                    self._warnings.warning(
                        "etoomanyrefs", "sending FDs to pid %d waits: too many FDs in flight (%s)", conn.pid, exc
                    )
                elif exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                    self._warnings.warning("send", "sending FDs to pid %d failed: %s", conn.pid, exc)
                break
            finally:
                for fd in fds:
                    os.close(fd)
            conn.outbox.popleft()
            conn.fds_in_flight += len(fds)
        fd = conn.sock.fileno()
        if waiting:
            self._draining.add(fd)
        else:
            self._draining.discard(fd)
        # POLLOUT only for a full socket: one waiting for its peer to read would wake the loop at once, forever.
        self._poller.register(fd, zmq.POLLIN | (zmq.POLLOUT if conn.outbox and not waiting else 0))

    # control plane

    def _drain_control(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                self._router.send_multipart([identity, *self._dispatch(body)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.debug("reply dropped: %s", exc)

    def _dispatch(self, frames: list[bytes]) -> list[bytes]:
        started = time.perf_counter()
        request_id = peek_request_id(frames)
        operation = "invalid"
        try:
            kind, request_id, token, raw = read_envelope(frames)
            handler = self._handlers.get(kind)
            if handler is None:
                raise ProtocolError(f"{kind.KIND} is not a request")
            operation = kind.KIND
            # The token before the body: an unknown peer costs no decoding.
            session = self.state.session_for(token)
            self._take_placements()
            reply = handler(self._by_session[session.session_id], request_id, decode_body(kind, raw))
        except OutOfBudget as exc:
            # A session holding a lease gives it back and retries: the first refusal is expected, not news.
            log.log(logging.INFO if session.leased_bytes else logging.WARNING,
                    "refused %s of session %d (pid %d, uid %d, tenant %r): %s%s", operation, session.session_id,
                    session.pid, session.uid, session.tenant.name, exc.message,
                    " (it holds a lease to give back)" if session.leased_bytes else "")
            reply = ErrorReply.of(exc)
        except HbmdError as exc:
            reply = ErrorReply.of(exc)
        except Exception:
            log.exception("request %d failed", request_id)
            reply = ErrorReply.of(InternalError(f"internal error handling request {request_id}; see the daemon log"))
        self._send_reclaims()
        self._send_revokes()
        if self.metrics is not None:
            self.metrics.record(operation, reply.code if isinstance(reply, ErrorReply) else "ok", started)
        return encode_frames(reply, request_id)

    @handles(Status)
    def _status(self, conn: HandleConnection, request_id: int, msg: Status) -> StatusReply:
        state, backend = self.state, self.state.backend
        me = conn.session
        # Limited tenants first, then the largest: what a capped list must not lose.
        tenants = sorted(
            state.tenant_infos(None if me.admin else me.uid),
            key=lambda t: (t.max_bytes < 0 and not t.guaranteed_bytes, -t.used_bytes, t.name),
        )
        return StatusReply(
            instance=backend.instance,
            backend=backend.name,
            device_index=backend.device_index,
            device_uuid=backend.device_uuid,
            pid=os.getpid(),
            daemon_version=VERSION,
            granularity=backend.granularity,
            total_bytes=backend.total_bytes,
            budget_bytes=state.budget_bytes,
            committed_bytes=state.committed_bytes,
            reserved_bytes=state.reserved_bytes,
            num_sessions=len(state.workers),
            num_buffers=len(state.buffers),
            num_chunks=state.num_chunks,
            uptime_s=time.monotonic() - state.started_at,
            device_free_bytes=backend.free_bytes(),
            tenants=sorted(tenants[:MAX_TENANTS_LISTED], key=lambda t: t.name),
            tenants_left_out=max(0, len(tenants) - MAX_TENANTS_LISTED),
            admissible_bytes=state.admissible_for(conn.session),
            held_back_bytes=backend.held_back_bytes(),
            leased_bytes=state.leased_bytes,
        )

    @handles(ListSessions)
    def _list_sessions(self, conn: HandleConnection, request_id: int, msg: ListSessions) -> SessionList:
        me = conn.session
        return SessionList([self.state.session_info(s) for s in self.state.workers if me.admin or s.uid == me.uid])

    @handles(ListBuffers)
    def _list_buffers(self, conn: HandleConnection, request_id: int, msg: ListBuffers) -> BufferList:
        me = conn.session
        if msg.session_id == -1:
            buffers = self.state.buffers.values()
        else:
            buffers = self._visible_session(me, msg.session_id).buffers.values()
        return BufferList([b.info() for b in buffers if me.admin or b.owner_uid == me.uid])

    def _visible_session(self, me: Session, session_id: int) -> Session:
        """Session ``session_id`` if ``me`` may see it: its own user's, or any for an admin."""
        session = self.state.sessions.get(session_id)
        if session is None or not (me.admin or session.uid == me.uid):
            raise NotFound(f"no session {session_id}", session_id=session_id)
        return session

    @handles(Reclaim)
    def _reclaim(self, conn: HandleConnection, request_id: int, msg: Reclaim) -> ReclaimSent:
        target = self._visible_session(conn.session, msg.session_id)
        reclaim = self.state.request_reclaim(target, msg.bytes, f"asked by session {conn.session.session_id} (uid {conn.uid})")
        log.info("asked session %d (pid %d) to release %d bytes", target.session_id, target.pid, msg.bytes)
        return ReclaimSent(reclaim.reclaim_id, target.session_id, target.pid)

    @handles(ReclaimDone)
    def _reclaim_done(self, conn: HandleConnection, request_id: int, msg: ReclaimDone) -> Ack:
        self.state.reclaim_answered(conn.session, msg.reclaim_id, msg.released_bytes)
        log.info("session %d answered reclaim %d: released %d bytes", conn.session.session_id, msg.reclaim_id, msg.released_bytes)
        return Ack()

    def _send_revokes(self) -> None:
        """Ask sessions for the leased granules the state wants back."""
        while self.state.revokes_due:
            session, chunk_ids = self.state.revokes_due.pop(0)
            conn = self._by_session.get(session.session_id)
            if conn is not None:
                self._send_quietly(conn, LeaseRevoke(chunk_ids))

    def _serve_leases(self) -> None:
        """Ask back what the state wants back, and top up the leases that commits and placements ran down, after the
        replies have gone out."""
        self._send_revokes()
        for session_id in self.state.take_lease_due():
            conn = self._by_session.get(session_id)
            if conn is None or len(conn.outbox) >= MAX_QUEUED_BATCHES:
                continue
            chunks = self.state.top_up_lease(conn.session)
            if chunks:
                conn.outbox.append(FdDelivery(0, None, chunks, 0, 1))
                self._flush(conn)

    def _send_reclaims(self) -> None:
        """Deliver the reclaim requests the state made, on each session's handle socket."""
        while self.state.reclaims_due:
            session, reclaim = self.state.reclaims_due.pop(0)
            conn = self._by_session.get(session.session_id)
            if conn is not None:
                self._send_quietly(conn, ReclaimRequest(reclaim.reclaim_id, reclaim.requested_bytes, reclaim.reason))

    @handles(CreateBuffer)
    def _create_buffer(self, conn: HandleConnection, request_id: int, msg: CreateBuffer) -> BufferCreated:
        buffer = self.state.create_buffer(
            conn.session, msg.capacity, msg.num_segments, msg.name, msg.persistent, msg.shareable,
            msg.segment_capacities,
        )
        return BufferCreated(buffer.info())

    @handles(Commit)
    def _commit(self, conn: HandleConnection, request_id: int, msg: Commit) -> Committed:
        self._check_reading(conn)
        chunks = self.state.commit(conn.session, msg.buffer_id, msg.bytes_per_segment)
        return self._deliver(conn, request_id, self.state.buffers[msg.buffer_id], chunks)

    @handles(Remap)
    def _remap(self, conn: HandleConnection, request_id: int, msg: Remap) -> Committed:
        self._check_reading(conn)
        buffer = self.state.buffer_of(conn.session, msg.buffer_id)
        return self._deliver(conn, request_id, buffer, buffer.chunks)

    @handles(CommitSegments)
    def _commit_segments(self, conn: HandleConnection, request_id: int, msg: CommitSegments) -> Committed:
        self._check_reading(conn)
        chunks = self.state.commit(conn.session, msg.buffer_id, msg.sizes)
        return self._deliver(conn, request_id, self.state.buffers[msg.buffer_id], chunks)

    def _has_exited(self, conn: HandleConnection) -> bool:
        """Whether the session's process has exited (or its socket shown EOF), noticed or not by the loop yet."""
        if conn.pidfd >= 0 and readable_now(conn.pidfd):
            return True
        try:
            return conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def _unless_holder_exited(self, operation: Callable[[], T]) -> T:
        """Run ``operation``; if a session holding the buffer it needs has exited unnoticed, end that session, run it again."""
        try:
            return operation()
        except Conflict as exc:
            session_id = exc.details.get("session_id")
            holder = self._by_session.get(session_id) if isinstance(session_id, int) else None
            if holder is None or not self._has_exited(holder):
                raise
            self._close_connection(holder, "process exited")
        return operation()

    @handles(Attach)
    def _attach(self, conn: HandleConnection, request_id: int, msg: Attach) -> Committed:
        self._check_reading(conn)
        if msg.readonly:
            buffer = self.state.attach_reader(conn.session, msg.name, uneven_ok=conn.protocol_minor >= 1)
            log.info("session %d reads sealed buffer %r (%d readers)", conn.session.session_id, msg.name, len(buffer.readers))
            return self._deliver(conn, request_id, buffer, buffer.chunks)
        buffer = self._unless_holder_exited(
            lambda: self.state.attach(conn.session, msg.name, uneven_ok=conn.protocol_minor >= 1)
        )
        log.info("session %d attached persistent buffer %r (%d bytes)", conn.session.session_id, msg.name, buffer.physical_bytes)
        return self._deliver(conn, request_id, buffer, buffer.chunks)

    @handles(Defragment)
    def _defragment(self, conn: HandleConnection, request_id: int, msg: Defragment) -> Committed:
        self._check_reading(conn)
        chunks = self.state.defragment(conn.session, msg.buffer_id, msg.preserve)
        return self._deliver(conn, request_id, self.state.buffers[msg.buffer_id], chunks)

    def _check_reading(self, conn: HandleConnection) -> None:
        """Refuse a session more FDs while :data:`MAX_QUEUED_BATCHES` batches of them wait for it to read."""
        if len(conn.outbox) >= MAX_QUEUED_BATCHES:
            self._warnings.warning(
                f"queued-{conn.uid}", "refusing session %d (pid %d) more FDs: %d batches wait for it to read its "
                "handle socket", conn.session.session_id, conn.pid, len(conn.outbox),
            )
            raise Conflict(
                f"{len(conn.outbox)} batches of FDs wait unread on this session's handle socket; read them first"
            )

    def _deliver(self, conn: HandleConnection, request_id: int, buffer: Buffer, chunks: list[Chunk]) -> Committed:
        """Queue the chunks' FDs on the session's handle socket and describe them in the reply."""
        batches = [chunks[i : i + MAX_FDS_PER_DATAGRAM] for i in range(0, len(chunks), MAX_FDS_PER_DATAGRAM)]
        for index, batch in enumerate(batches):
            conn.outbox.append(FdDelivery(request_id, buffer, batch, index, len(batches)))
        if batches:
            self._flush(conn)
        return Committed(buffer.info(), [self.state.chunk_info(c) for c in chunks], len(batches))

    @handles(FinishDefragment)
    def _finish_defragment(self, conn: HandleConnection, request_id: int, msg: FinishDefragment) -> Released:
        freed = self.state.finish_defragment(conn.session, msg.buffer_id, msg.keep_new)
        return Released(self.state.buffers[msg.buffer_id].info(), freed)

    @handles(Release)
    def _release(self, conn: HandleConnection, request_id: int, msg: Release) -> Released:
        freed = self.state.release(conn.session, msg.buffer_id)
        return Released(self.state.buffers[msg.buffer_id].info(), freed)

    @handles(Free)
    def _free(self, conn: HandleConnection, request_id: int, msg: Free) -> Freed:
        return Freed(msg.buffer_id, self._unless_holder_exited(lambda: self.state.free(conn.session, msg.buffer_id)))

    @handles(Seal)
    def _seal(self, conn: HandleConnection, request_id: int, msg: Seal) -> Sealed:
        buffer = self.state.seal(conn.session, msg.buffer_id)
        log.info("session %d sealed persistent buffer %r (%d bytes)", conn.session.session_id, buffer.name, buffer.physical_bytes)
        return Sealed(buffer.info())

    @handles(Detach)
    def _detach(self, conn: HandleConnection, request_id: int, msg: Detach) -> Detached:
        if msg.readonly:
            return Detached(self.state.detach_reader(conn.session, msg.buffer_id).info(), 0)
        freed = self.state.detach(conn.session, msg.buffer_id)
        buffer = self.state.buffers[msg.buffer_id]
        log.info(
            "session %d detached persistent buffer %r (%d bytes)", conn.session.session_id, buffer.name, buffer.physical_bytes
        )
        return Detached(buffer.info(), freed)

    @handles(Delete)
    def _delete(self, conn: HandleConnection, request_id: int, msg: Delete) -> Freed:
        buffer_id, freed = self._unless_holder_exited(lambda: self.state.delete(conn.session, msg.name, msg.owner_uid))
        owner = conn.uid if msg.owner_uid == -1 else msg.owner_uid
        log.info(
            "session %d (uid %d) deleted persistent buffer %r of uid %d", conn.session.session_id, conn.uid, msg.name, owner
        )
        return Freed(buffer_id, freed)
