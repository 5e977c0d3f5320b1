"""The client's two connections to a daemon instance.

:class:`HandleChannel` is the session: a Unix ``SOCK_SEQPACKET`` connection
that carries the handshake and, afterwards, the chunk FDs (``SCM_RIGHTS``),
read into its :class:`~hbmd.client.inbox.Inbox`.
:class:`ControlChannel` is a ZeroMQ DEALER with a request id per call, a
poll with a timeout, stale replies dropped and the socket rebuilt after a
timeout, so a call on a dead or silent daemon fails in bounded time with a
message naming the socket. It also watches the session's handle socket: a
daemon that stopped or restarted has closed it, and the call fails at once
with :class:`SessionLost` instead of waiting out its timeout.
"""

from __future__ import annotations

import os
import queue
import select
import socket
import threading
import time
import weakref
from typing import TypeVar

import zmq
from hbmd.proto import (
    Committed,
    ErrorReply,
    Hello,
    Message,
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
from hbmd.proto.instance import InstancePaths, access_denied

from .inbox import Inbox, receive

CONNECT_RETRY_S = 0.005
SPIN_S = 0.001
"""How long a call polls for its reply before its thread sleeps (``HBMD_SPIN_US``): most replies come within it (a
status, a commit through the daemon), and one read that way costs no sleep and wake-up, which the host backend's
round trips showed to cost tens to hundreds of µs (README, "Waiting for a reply"). The thread yields the CPU between
polls, so a busy machine's other work runs first; 0 waits asleep from the start."""

R = TypeVar("R", bound=Message)


class HandleChannel:
    """The session's handle-plane connection: the handshake, then datagrams both ways.

    What comes from the daemon is read into :attr:`inbox` by whichever of
    its two readers gets there first (see :mod:`hbmd.client.inbox`).
    """

    def __init__(self, paths: InstancePaths, timeout: float) -> None:
        self.path = os.fspath(paths.handles)
        self.timeout = timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.settimeout(timeout)
        try:
            self._connect(time.monotonic() + timeout)
        except FileNotFoundError as exc:
            self.sock.close()
            raise DaemonUnavailable(
                f"no hbmd is serving {self.path}: {exc.strerror} ({paths.origin})", path=self.path, not_running=True
            ) from None
        except ConnectionRefusedError as exc:
            # The socket is there and nothing listens: the daemon that bound it is gone (connects made while one
            # hands over or restarts under systemd wait in the backlog instead). The run directory is the right one.
            self.sock.close()
            raise DaemonUnavailable(
                f"no hbmd is serving {self.path}: {exc.strerror} (its daemon is gone: killed, or it crashed; the next "
                "daemon of the instance replaces it)", path=self.path, not_running=True
            ) from None
        except PermissionError:
            self.sock.close()
            raise DaemonUnavailable(
                f"cannot connect to {self.path}: {access_denied(self.path)}", path=self.path
            ) from None
        except OSError as exc:
            self.sock.close()
            raise DaemonUnavailable(f"cannot connect to {self.path}: {exc}", path=self.path) from None
        self.inbox = Inbox(self.sock, self.path)
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
                data = receive(self.sock, self.path, self.timeout)[0]
            except ConnectionResetError:
                # Closed without reading the hello: the kernel reports the reset first, the refusal queued after it.
                data = receive(self.sock, self.path, self.timeout)[0]
            reply = decode_datagram(data)
        except (OSError, ProtocolError, SessionLost) as exc:
            raise DaemonUnavailable(f"handshake with hbmd at {self.path} failed: {exc}", path=self.path) from None
        if isinstance(reply, Refused):
            raise error_from_wire(reply.code, reply.message, {"path": self.path})
        if not isinstance(reply, Welcome):
            raise ProtocolError(f"expected a welcome from {self.path}, got {reply.KIND}")
        return reply

    def send(self, msg: Message, fds: list[int] | None = None) -> None:
        """Send a datagram to the daemon, with ``fds`` (``SCM_RIGHTS``) if given; once this returns it is queued on the
        daemon's side of the socket, FDs and all (they outlive this process there)."""
        with self.inbox.lock:
            self.sock.settimeout(self.timeout)
            try:
                if fds:
                    socket.send_fds(self.sock, [encode_datagram(msg)], fds)
                else:
                    self.sock.send(encode_datagram(msg))
            except TimeoutError:
                raise DaemonUnavailable(
                    f"hbmd at {self.path} read nothing within {self.timeout:.1f}s", path=self.path
                ) from None
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
        self.inbox.close()


class FdCloser:
    """Closes received chunk FDs on a background thread.

    Closing the last reference to an exported CUDA allocation's FD is slow
    (hundreds of microseconds); once the chunk is mapped nothing waits for
    it, so it comes off the commit's critical path.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        # The thread holds the queue, not this object: a client dropped unclosed lets go of it, and it ends.
        self._thread = threading.Thread(target=_close_queued, args=(self._queue,), name="hbmd-fd-closer", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._queue.put, None)

    def close_later(self, fd: int) -> None:
        self._queue.put(fd)

    def stop(self) -> None:
        """Close what is queued, then end the thread."""
        self._queue.put(None)
        self._thread.join()


def _close_queued(fds: queue.SimpleQueue[int | None]) -> None:
    while (fd := fds.get()) is not None:
        os.close(fd)


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
        self._context: zmq.Context = zmq.Context.instance()
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
                poller.register(self.session.inbox.filed, zmq.POLLIN)
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
                committed = self._reply_with_fds(request_id)
                if committed is not None:
                    return committed, request_id  # type: ignore[return-value]  # msg.Reply is Committed, which is R
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
        assert self.session is not None  # replies_with_fds is only ever set with a session
        try:
            return self.session.inbox.reply_to(request_id)
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
