"""The client's two connections to a daemon instance.

:class:`HandleChannel` is the session: a Unix ``SOCK_SEQPACKET`` connection
that carries the handshake and, afterwards, the chunk FDs (``SCM_RIGHTS``).
:class:`ControlChannel` is a ZeroMQ DEALER with a request id per call, a
poll with a timeout, stale replies dropped and the socket rebuilt after a
timeout, so a call on a dead or silent daemon fails in bounded time with a
message naming the socket. It also watches the session's handle socket: a
daemon that stopped or restarted has closed it, and the call fails at once
with :class:`SessionLost` instead of waiting out its timeout.
"""

from __future__ import annotations

import collections
import os
import queue
import select
import socket
import threading
import time
from typing import TypeVar

import zmq
from hbmd.proto import (
    MAX_FDS_PER_DATAGRAM,
    Committed,
    CreditGrant,
    CreditRevoke,
    ErrorReply,
    FdBatch,
    Hello,
    LeaseGrant,
    LeaseRevoke,
    Message,
    PromoteRequest,
    ReclaimRequest,
    Refused,
    Request,
    Welcome,
    decode_datagram,
    decode_frames,
    encode_datagram,
    encode_frames,
)
from hbmd.proto.errors import (
    DaemonUnavailable,
    ProtocolError,
    SessionLost,
    error_from_wire,
)
from hbmd.proto.fdpass import receive_with_fds
from hbmd.proto.instance import InstancePaths, access_denied

MAX_DATAGRAM = 64 << 10
CONNECT_RETRY_S = 0.005
SPIN_S = 0.001
"""How long a call polls for its reply before its thread sleeps (``HBMD_SPIN_US``): most replies come within it (a
status, a commit through the daemon), and one read that way costs no sleep and wake-up, which the host backend's
round trips showed to cost tens to hundreds of µs (README, "Waiting for a reply"). The thread yields the CPU between
polls, so a busy machine's other work runs first; 0 waits asleep from the start."""

R = TypeVar("R", bound=Message)


class HandleChannel:
    """The session's handle-plane connection.

    Two readers may share it: the caller waiting for a request's FD batches,
    and the client's listener thread. Reads happen under one lock, never
    waits (sends need the lock too); whichever reader takes a datagram meant
    for the other leaves it in ``_backlog`` (FD batches, signalled on
    ``_filed``), ``reclaims`` and ``demotes`` (reclaim requests), ``grants`` (leased
    granules, with their FDs), ``revokes`` (leased granules asked back) or
    ``credits`` (credit granted and asked back, in the order they came).
    """

    def __init__(self, paths: InstancePaths, timeout: float) -> None:
        self.path = os.fspath(paths.handles)
        self.timeout = timeout
        self._lock = threading.Lock()
        self._backlog: list[tuple[FdBatch, list[int]]] = []
        self.reclaims: collections.deque[ReclaimRequest] = collections.deque()
        self.demotes: collections.deque[ReclaimRequest | PromoteRequest] = collections.deque()
        """Requests to demote buffers under pressure (``ReclaimRequest.demote``) and to promote them back once there
        is room: the client serves them itself."""
        self.grants: collections.deque[tuple[LeaseGrant, list[int]]] = collections.deque()
        self.revokes: collections.deque[LeaseRevoke] = collections.deque()
        self.credits: collections.deque[CreditGrant | CreditRevoke] = collections.deque()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        try:
            self._connect(time.monotonic() + timeout)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            self.sock.close()
            raise DaemonUnavailable(
                f"no hbmd is serving {self.path}: {exc.strerror} ({paths.origin})", path=self.path
            ) from None
        except PermissionError:
            self.sock.close()
            raise DaemonUnavailable(f"cannot connect to {self.path}: {access_denied(self.path)}", path=self.path) from None
        except OSError as exc:
            self.sock.close()
            raise DaemonUnavailable(f"cannot connect to {self.path}: {exc}", path=self.path) from None
        self._filed = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        """Written when an FD batch goes to ``_backlog``: wakes a caller waiting for the batch the listener took."""
        self._hang_up = select.poll()
        """Watches the socket for the daemon's hang-up; made once, as :meth:`lost` runs before every call."""
        self._hang_up.register(self.sock, select.POLLRDHUP)

    def _connect(self, deadline: float) -> None:
        """Connect, waiting while the daemon's backlog is full (a Unix socket says EAGAIN then, it does not wait)."""
        while True:
            try:
                self.sock.connect(self.path)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(CONNECT_RETRY_S)

    def handshake(self, hello: Hello) -> Welcome:
        try:
            self.sock.send(encode_datagram(hello))
        except OSError:
            pass  # a daemon that turned this peer away at once has closed already; its refusal waits to be read
        try:
            try:
                data = self._recv(timeout=self.timeout)[0]
            except ConnectionResetError:
                # Closed without reading the hello: the kernel reports the reset first, the refusal queued after it.
                data = self._recv(timeout=self.timeout)[0]
            reply = decode_datagram(data)
        except (OSError, ProtocolError, SessionLost) as exc:
            raise DaemonUnavailable(f"handshake with hbmd at {self.path} failed: {exc}", path=self.path) from None
        if isinstance(reply, Refused):
            raise error_from_wire(reply.code, reply.message, {"path": self.path})
        if not isinstance(reply, Welcome):
            raise ProtocolError(f"expected a welcome from {self.path}, got {reply.KIND}")
        return reply

    def _recv(self, timeout: float) -> tuple[bytes, list[int]]:
        self.sock.settimeout(timeout)
        try:
            data, fds, _ = receive_with_fds(self.sock, MAX_DATAGRAM, MAX_FDS_PER_DATAGRAM)
        except socket.timeout:
            raise DaemonUnavailable(f"hbmd at {self.path} sent nothing within {timeout:.1f}s", path=self.path) from None
        if not data and not fds:
            raise SessionLost(f"hbmd at {self.path} closed the session", path=self.path)
        return data, fds

    def _sort(self, data: bytes, fds: list[int]) -> FdBatch | None:
        """File one datagram: reclaim requests, lease grants and revokes to their queues; returns an FD batch, or
        None (FDs closed unless filed with a grant)."""
        try:
            msg = decode_datagram(data)
        except ProtocolError:
            msg = None
        if isinstance(msg, LeaseGrant) and len(fds) == len(msg.chunk_ids):
            self.grants.append((msg, fds))
            return None
        if isinstance(msg, FdBatch):
            if len(fds) != (0 if msg.error else len(msg.chunk_ids)):
                _close_all(fds)
                raise ProtocolError(f"batch of {len(msg.chunk_ids)} chunks came with {len(fds)} FDs")
            return msg
        _close_all(fds)
        if isinstance(msg, ReclaimRequest):
            (self.demotes if msg.demote else self.reclaims).append(msg)
        elif isinstance(msg, LeaseRevoke):
            self.revokes.append(msg)
        elif isinstance(msg, (CreditGrant, CreditRevoke)):
            self.credits.append(msg)
        elif isinstance(msg, PromoteRequest):
            self.demotes.append(msg)
        return None

    def receive_fds(self, request_id: int, deadline: float) -> tuple[FdBatch, list[int]]:
        """The next FD batch of ``request_id``; batches of earlier requests are dropped and their FDs closed.

        The lock is held to read and file what waits, not while waiting for
        it, so the listener's sends go on meanwhile. Raises
        :class:`DaemonUnavailable` past ``deadline``, :class:`SessionLost`
        once the daemon has closed the session.
        """
        while True:
            with self._lock:
                batch = self._take_batch(request_id)
                if batch is not None:
                    return batch
                read = self._read_and_file()
            if read:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DaemonUnavailable(f"hbmd at {self.path} sent no chunk FDs within {self.timeout:.1f}s", path=self.path)
            # Readable socket: a datagram to read; readable _filed: the listener read and filed a batch first.
            select.select([self.sock, self._filed], [], [], remaining)

    def _take_batch(self, request_id: int) -> tuple[FdBatch, list[int]] | None:
        """The first filed batch of ``request_id``, the lock held; those of earlier requests are dropped."""
        try:
            os.eventfd_read(self._filed)
        except BlockingIOError:
            pass  # nothing filed since the last look
        for stale in [entry for entry in self._backlog if entry[0].request_id < request_id]:
            self._backlog.remove(stale)
            _close_all(stale[1])
        for i, (waiting, _) in enumerate(self._backlog):
            if waiting.request_id == request_id:
                return self._backlog.pop(i)
        return None

    @property
    def filed(self) -> int:
        """The eventfd written when the listener files an FD batch: for a caller that waits on other sockets too."""
        return self._filed

    def reply_to(self, request_id: int) -> Committed | None:
        """The reply to ``request_id`` that rode with its first FD batch (:attr:`FdBatch.reply`), once that batch is
        here; None until then. Reads and files what waits, without waiting; the batch stays filed for its delivery.
        Raises :class:`SessionLost` once the daemon has closed the session."""
        with self._lock:
            try:
                os.eventfd_read(self._filed)
            except BlockingIOError:
                pass  # nothing filed by the listener since the last look
            while self._read_and_file():
                pass
            for batch, _ in self._backlog:
                if batch.request_id == request_id and batch.reply is not None:
                    return batch.reply
        return None

    def poll(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for datagrams and file them; False once the daemon has gone."""
        try:
            readable, _, _ = select.select([self.sock], [], [], timeout)
        except (OSError, ValueError):
            return False
        if not readable:
            return True
        with self._lock:
            return self._file_next() is not False  # None: the other reader took it

    def drain(self) -> None:
        """File every datagram waiting now, without blocking."""
        with self._lock:
            while self._file_next():
                pass

    def _file_next(self) -> bool | None:
        """Read and file one datagram, the lock held: True; None when none waits; False once the daemon has gone."""
        try:
            return self._read_and_file() or None
        except (DaemonUnavailable, OSError):
            return False

    def _read_and_file(self) -> bool:
        """Read one datagram and file it, the lock held; False when none waits. Raises once the daemon has gone."""
        try:
            # Non-blocking mode, not MSG_DONTWAIT: with a timeout set, Python waits for the socket to turn readable
            # before it reads, and if the other reader took the datagram, this would sit on the lock (which sends
            # need too) until the next one arrived or the timeout passed.
            data, fds = self._recv(timeout=0.0)
        except BlockingIOError:
            return False
        batch = self._sort(data, fds)
        if batch is not None:
            self._backlog.append((batch, fds))
            os.eventfd_write(self._filed, 1)
        return True

    def send(self, msg: Message, fds: list[int] | None = None) -> None:
        """Send a datagram to the daemon, with ``fds`` (``SCM_RIGHTS``) if given; once this returns it is queued on the
        daemon's side of the socket, FDs and all (they outlive this process there)."""
        with self._lock:
            self.sock.settimeout(self.timeout)
            try:
                if fds:
                    socket.send_fds(self.sock, [encode_datagram(msg)], fds)
                else:
                    self.sock.send(encode_datagram(msg))
            except socket.timeout:
                raise DaemonUnavailable(f"hbmd at {self.path} read nothing within {self.timeout:.1f}s", path=self.path) from None
            except OSError as exc:
                raise SessionLost(f"hbmd at {self.path} closed the session ({exc.strerror})", path=self.path) from None

    def lost(self) -> bool:
        """Whether the daemon has closed this connection: it stopped or restarted, or ended the session.

        Seen even while datagrams are still queued on it.
        """
        if self.sock.fileno() < 0:
            return True
        return any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR) for _, events in self._hang_up.poll(0))

    def shut(self) -> None:
        """End the connection for both sides (the daemon ends the session); a reader waiting on it wakes."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Close the socket and the FDs that came on it and were never taken."""
        self.sock.close()
        if self._filed >= 0:
            os.close(self._filed)
            self._filed = -1
        for _, fds in (*self._backlog, *self.grants):
            _close_all(fds)
        self._backlog.clear()
        self.grants.clear()


class FdCloser:
    """Closes received chunk FDs on a background thread.

    Closing the last reference to an exported CUDA allocation's FD is slow
    (hundreds of microseconds); once the chunk is mapped nothing waits for
    it, so it comes off the commit's critical path.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="hbmd-fd-closer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (fd := self._queue.get()) is not None:
            os.close(fd)

    def close_later(self, fd: int) -> None:
        self._queue.put(fd)

    def stop(self) -> None:
        """Close what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join()


def poll_spinning(poller: zmq.Poller, deadline: float, spin_until: float) -> dict:
    """What ``poller`` finds ready by ``deadline`` (``time.monotonic``): polled without sleeping until ``spin_until``,
    the CPU yielded between polls, then waited for."""
    while True:
        now = time.monotonic()
        if now >= spin_until:
            remaining = deadline - now
            return dict(poller.poll(int(remaining * 1000) + 1)) if remaining > 0 else {}
        ready = poller.poll(0)
        if ready:
            return dict(ready)
        os.sched_yield()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


class ControlChannel:
    """Request/reply over a ZeroMQ DEALER; one call in flight at a time.

    ``session``: the handle channel of the session the token belongs to;
    once the daemon has closed it, calls raise :class:`SessionLost` at once.
    ``replies_with_fds``: the session's daemon sends a :class:`Committed`
    reply with the request's first FD batch, on the handle socket (its hello
    asked, protocol 1.7): a call for one waits on that socket too.
    ``spin``: seconds a call polls for its reply before it sleeps (:data:`SPIN_S`).
    """

    def __init__(
        self,
        paths: InstancePaths,
        token: str,
        timeout: float,
        session: HandleChannel | None = None,
        replies_with_fds: bool = False,
        spin: float = SPIN_S,
    ) -> None:
        self.endpoint = paths.endpoint
        self.spin = spin
        self.token = token
        self.timeout = timeout
        self.session = session
        self.replies_with_fds = replies_with_fds and session is not None
        self.requests_sent = 0
        """Requests sent so far; the last one's id (ids count from 1)."""
        self._context = zmq.Context.instance()
        self._socket = self._open()
        self._poller = self._watch()
        self._poller_with_fds = self._watch(with_fds=True)

    def _open(self) -> zmq.Socket:
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def _watch(self, with_fds: bool = False) -> zmq.Poller:
        """What a call waits on: its reply, or the daemon hanging up on the session; ``with_fds``: also the handle
        socket's datagrams and the listener's filing of one (a reply riding with FDs). Made once per socket and
        session, not per call."""
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        if self.session is not None:
            # POLLERR is how zmq reports a raw descriptor's hang-up: the daemon closed the session.
            poller.register(self.session.sock.fileno(), zmq.POLLERR | (zmq.POLLIN if with_fds else 0))
            if with_fds:
                poller.register(self.session.filed, zmq.POLLIN)
        return poller

    def _rewatch(self) -> None:
        self._poller = self._watch()
        self._poller_with_fds = self._watch(with_fds=True)

    def call(self, msg: Request[R], timeout: float | None = None) -> R:
        """Send ``msg`` and return its reply (of the type the request names); raise the daemon's error, or
        :class:`DaemonUnavailable` when no reply comes within ``timeout``."""
        return self.call_with_id(msg, timeout)[0]

    def next_request_id(self) -> int:
        """The id of a new request."""
        self.requests_sent += 1
        return self.requests_sent

    def call_with_id(self, msg: Request[R], timeout: float | None = None, request_id: int = 0) -> tuple[R, int]:
        """:meth:`call`, and the request id it went under: the id the FD batches that answer it carry.

        ``request_id``: send it under this id (:meth:`next_request_id`'s), so that, sent again after the session was
        resumed, the daemon knows it for the same request; 0: a new id.
        """
        timeout = self.timeout if timeout is None else timeout
        if self.session is not None and self.session.lost():
            raise self._lost()
        request_id = request_id or self.next_request_id()
        self._socket.send_multipart(encode_frames(msg, request_id, self.token))
        sent = time.monotonic()
        deadline, spin_until = sent + timeout, sent + min(self.spin, timeout)
        with_fds = self.replies_with_fds and msg.Reply is Committed
        poller = self._poller_with_fds if with_fds else self._poller
        while True:
            ready = poll_spinning(poller, deadline, spin_until)
            if with_fds and ready and self._socket not in ready:
                # A datagram, or the listener filed one: the reply, if it rode with the FDs (or the daemon's EOF).
                reply = self._reply_with_fds(request_id)
                if reply is not None:
                    return reply, request_id  # type: ignore[return-value]  # msg.Reply is Committed, which is R
                continue
            if self._socket not in ready:
                # A late reply would answer the wrong call: start over on a new socket.
                self._socket.close(linger=0)
                self._socket = self._open()
                self._rewatch()
                if ready:
                    raise self._lost()
                raise DaemonUnavailable(
                    f"hbmd at {self.endpoint} did not answer {msg.KIND} within {timeout:.1f}s",
                    path=self.endpoint,
                )
            envelope = decode_frames(self._socket.recv_multipart())
            if envelope.request_id != request_id:
                continue
            reply = envelope.body
            if isinstance(reply, ErrorReply):
                raise reply.exception()
            if not isinstance(reply, msg.Reply):
                raise ProtocolError(f"expected {msg.Reply.KIND} in reply to {msg.KIND}, got {reply.KIND}")
            return reply, request_id  # type: ignore[return-value]  # checked against msg.Reply, which is R

    def _reply_with_fds(self, request_id: int) -> Committed | None:
        try:
            return self.session.reply_to(request_id)
        except (SessionLost, OSError):  # EOF, or a reset: the daemon has closed the session
            self._socket.close(linger=0)
            self._socket = self._open()
            self._rewatch()
            raise self._lost() from None

    def _lost(self) -> SessionLost:
        return SessionLost(
            f"the session with hbmd at {self.endpoint} is lost: the daemon stopped or restarted; connect again",
            path=self.endpoint,
        )

    def resume(self, token: str, session: HandleChannel, replies_with_fds: bool) -> None:
        """Go on with the session resumed on a restarted daemon: its new token and handle channel, a new socket, and
        whether that daemon sends replies with FDs."""
        self._socket.close(linger=0)
        self._socket = self._open()
        self.token = token
        self.session = session
        self.replies_with_fds = replies_with_fds
        self._rewatch()

    def close(self) -> None:
        self._socket.close(linger=0)
