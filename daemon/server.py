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
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import fcntl
import logging
import os
import signal
import socket
import struct
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
    Committed,
    CreateBuffer,
    Defragment,
    Delete,
    ErrorReply,
    FdBatch,
    FinishDefragment,
    Free,
    Freed,
    Hello,
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
    Request,
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
    HbmdError,
    InternalError,
    NotFound,
    PermissionDenied,
    ProtocolError,
    VersionMismatch,
)
from hbmd.proto.instance import VERSION, InstanceInfo, InstancePaths

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


class AlreadyRunning(RuntimeError):
    """Another daemon holds the instance's lock."""


class HandlerTableError(RuntimeError):
    """The server's handlers and the protocol's requests do not match one to one: the daemon must not start."""


Handler = TypeVar("Handler", bound=Callable[..., Message])


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
    """One queued batch of chunk FDs for a session's handle socket."""

    request_id: int
    buffer: Buffer
    chunks: list[Chunk]
    batch: int
    batches: int


@dataclasses.dataclass
class HandleConnection:
    sock: socket.socket
    pid: int
    uid: int
    gid: int
    groups: set[int]
    accepted_at: float
    session: Session | None = None
    outbox: collections.deque[FdDelivery] = dataclasses.field(default_factory=collections.deque)


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
        self._context = zmq.Context.instance()
        self._router: zmq.Socket | None = None
        self._listener: socket.socket | None = None
        self._wake_r = self._wake_w = -1
        self._poller = zmq.Poller()
        self._connections: dict[int, HandleConnection] = {}
        self._by_session: dict[int, HandleConnection] = {}

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
        self._router.bind(self.paths.endpoint)
        os.chmod(self.paths.control, 0o660)
        self._set_group(self.paths.control)

        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self._listener.bind(os.fspath(self.paths.handles))
        os.chmod(self.paths.handles, 0o660)
        self._set_group(self.paths.handles)
        self._listener.listen(128)
        self._listener.setblocking(False)

        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
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
            events = self._poller.poll(timeout=0 if idle_work else 1000)
            with self.lock:
                for fd_or_socket, _ in events:
                    try:
                        self._on_event(fd_or_socket)
                    except Exception:
                        # A bug met by one peer's input must not stop the daemon for every other.
                        log.exception("handling an event on %r failed", fd_or_socket)
                self._expire_pending()
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
        for fd in (self._wake_r, self._wake_w, self._lock_fd, self._dir_fd):
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
                # EMFILE and friends: refuse this peer, keep serving the others.
                log.warning("accepting a handle connection failed: %s", exc)
                return
            sock.setblocking(False)
            try:
                pid, uid, gid, groups = peer_credentials(sock)
            except OSError as exc:
                log.warning("reading peer credentials failed: %s", exc)
                sock.close()
                continue
            conn = HandleConnection(sock, pid, uid, gid, groups, time.monotonic())
            self._connections[sock.fileno()] = conn
            self._poller.register(sock.fileno(), zmq.POLLIN)

    def _expire_pending(self) -> None:
        now = time.monotonic()
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
        """One inbound datagram, or None when the peer is gone. Inbound FDs are closed."""
        try:
            data, fds, flags, _ = socket.recv_fds(conn.sock, MAX_DATAGRAM, MAX_FDS_IN)
        except (BlockingIOError, InterruptedError):
            return b""
        except OSError:
            return None
        for fd in fds:
            os.close(fd)
        if fds:
            log.warning("pid %d sent %d unsolicited file descriptors; closed them", conn.pid, len(fds))
        if not data and not fds:
            return None
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            log.warning("pid %d sent an oversized datagram; dropped", conn.pid)
            return b""
        return data

    def _on_handle_event(self, conn: HandleConnection) -> None:
        if conn.outbox:
            self._flush(conn)
        data = self._receive(conn)
        if data is None:
            self._close_connection(conn, "connection closed")
            return
        if not data:
            return
        if conn.session is None:
            self._handshake(conn, data)
        else:
            log.debug("session %d sent an unexpected datagram; ignored", conn.session.session_id)

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
            )
        except HbmdError as exc:
            self._send_quietly(conn, Refused(exc.code.wire, exc.message))
            self._close_connection(conn, f"refused: {exc.message}")
            return
        conn.session = session
        self._by_session[session.session_id] = conn
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
            ),
        )
        log.info(
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
        self._connections.pop(fd, None)
        try:
            self._poller.unregister(fd)
        except KeyError:
            pass
        conn.outbox.clear()
        conn.sock.close()
        if conn.session is not None:
            self._by_session.pop(conn.session.session_id, None)
            freed = self.state.close_session(conn.session)
            log.info("session %d ended (%s): freed %d bytes", conn.session.session_id, why, freed)

    def _flush(self, conn: HandleConnection) -> None:
        """Send queued FD batches until the socket is full; close each FD once sent."""
        while conn.outbox:
            delivery = conn.outbox[0]
            header = FdBatch(delivery.request_id, [c.chunk_id for c in delivery.chunks], delivery.batch, delivery.batches)
            fds: list[int] = []
            try:
                if not all(c.live for c in delivery.chunks):
                    raise InternalError("chunks were released before they were delivered")
                for chunk in delivery.chunks:
                    fds.append(self.state.export(delivery.buffer, chunk))
            except (HbmdError, OSError) as exc:
                log.warning("export for request %d failed: %s", delivery.request_id, exc)
                header = dataclasses.replace(header, error=str(exc))
                for fd in fds:
                    os.close(fd)
                fds = []
            try:
                socket.send_fds(conn.sock, [encode_datagram(header)], fds)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                    log.warning("sending FDs to pid %d failed: %s", conn.pid, exc)
                break
            finally:
                for fd in fds:
                    os.close(fd)
            conn.outbox.popleft()
        flags = zmq.POLLIN | (zmq.POLLOUT if conn.outbox else 0)
        self._poller.register(conn.sock.fileno(), flags)

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
            reply = handler(self._by_session[session.session_id], request_id, decode_body(kind, raw))
        except HbmdError as exc:
            reply = ErrorReply.of(exc)
        except Exception:
            log.exception("request %d failed", request_id)
            reply = ErrorReply.of(InternalError(f"internal error handling request {request_id}; see the daemon log"))
        self._send_reclaims()
        if self.metrics is not None:
            self.metrics.record(operation, reply.code if isinstance(reply, ErrorReply) else "ok", started)
        return encode_frames(reply, request_id)

    @handles(Status)
    def _status(self, conn: HandleConnection, request_id: int, msg: Status) -> StatusReply:
        state, backend = self.state, self.state.backend
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
            tenants=state.tenant_infos(),
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
            conn.session, msg.capacity, msg.num_segments, msg.name, msg.persistent, msg.shareable
        )
        return BufferCreated(buffer.info())

    @handles(Commit)
    def _commit(self, conn: HandleConnection, request_id: int, msg: Commit) -> Committed:
        chunks = self.state.commit(conn.session, msg.buffer_id, msg.bytes_per_segment)
        return self._deliver(conn, request_id, self.state.buffers[msg.buffer_id], chunks)

    @handles(Attach)
    def _attach(self, conn: HandleConnection, request_id: int, msg: Attach) -> Committed:
        buffer = self.state.attach(conn.session, msg.name)
        log.info("session %d attached persistent buffer %r (%d bytes)", conn.session.session_id, msg.name, buffer.physical_bytes)
        return self._deliver(conn, request_id, buffer, buffer.chunks)

    @handles(Defragment)
    def _defragment(self, conn: HandleConnection, request_id: int, msg: Defragment) -> Committed:
        chunks = self.state.defragment(conn.session, msg.buffer_id, msg.preserve)
        return self._deliver(conn, request_id, self.state.buffers[msg.buffer_id], chunks)

    def _deliver(self, conn: HandleConnection, request_id: int, buffer: Buffer, chunks: list[Chunk]) -> Committed:
        """Queue the chunks' FDs on the session's handle socket and describe them in the reply."""
        batches = [chunks[i : i + MAX_FDS_PER_DATAGRAM] for i in range(0, len(chunks), MAX_FDS_PER_DATAGRAM)]
        for index, batch in enumerate(batches):
            conn.outbox.append(FdDelivery(request_id, buffer, batch, index, len(batches)))
        if batches:
            self._flush(conn)
        return Committed(buffer.info(), [self.state.chunk_info(buffer, c) for c in chunks], len(batches))

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
        return Freed(msg.buffer_id, self.state.free(conn.session, msg.buffer_id))

    @handles(Delete)
    def _delete(self, conn: HandleConnection, request_id: int, msg: Delete) -> Freed:
        buffer_id, freed = self.state.delete(conn.session, msg.name)
        log.info("session %d deleted persistent buffer %r", conn.session.session_id, msg.name)
        return Freed(buffer_id, freed)
