"""The control socket: the daemon's own Unix listener on the control endpoint, speaking ZMTP to the clients' DEALERs.

A ROUTER let a peer that speaks ZMTP by hand make the daemon hold without
bound (``zmtp.py`` says how). A ``ZMQ_STREAM`` socket, libzmq handing over
raw bytes, would bound what it reads ahead, but cannot let go of a
connection whose peer hung up while that read-ahead was full: libzmq ends a
connection only on a read error, and once asked to close it reads it no more
(``bench/stream_close_probe.py``: a descriptor kept for good, libzmq 4.3.5). So the
daemon accepts, reads and writes the connections itself, one epoll for all
(its descriptor is what the loop polls): it reads a connection only while it
has a turn, and what it leaves unread waits in the kernel, the sender with it.
A turn reads one connection of each uid in turn, each until one request is
whole, :data:`READ_BYTES_PER_TURN` or the turn's time at most, and parses
no further than that request or ``MAX_COMMANDS_PER_FEED`` heartbeats: what
completes no request (PINGs, parts) or thousands of them at once (empty
messages) costs a turn no more than a request does (issue #61).

Per connection it parses ZMTP (:class:`~.zmtp.ZmtpPeer`) within a message's
bounds; for all the connections of a uid it keeps at most
:data:`MAX_PARTIAL_BYTES_PER_UID` of unfinished messages,
:data:`MAX_UNSENT_BYTES_PER_UID` of replies not yet taken by the kernel
(:data:`MAX_UNSENT_BYTES_PER_CONNECTION` per connection), and
:data:`MAX_CONNECTIONS_PER_UID` connections. A connection that breaks ZMTP
or takes its uid past the first bound is closed, logged once per uid per
interval; one that has not finished its greeting and READY within
``HELLO_TIMEOUT_S`` too; during the handshake, ZMTP's ERROR tells the peer
why first. A reply past the unsent bounds is dropped whole.
The loop sees what the ROUTER gave it: a connection's identity, the frames
of a request and the peer the kernel names (``SO_PEERCRED``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import select
import socket
import time
from collections.abc import Iterator

from ..shares import Shares
from .connection import Descriptors, accepted, accepting
from .control import Peer
from .hellos import HELLO_TIMEOUT_S
from .ratelimit import RateLimitedLog
from .zmtp import GREETING, MAX_MESSAGE_BYTES, ZmtpPeer, ZmtpViolation, encode_message, error_command

log = logging.getLogger("hbmd.server")

RECEIVE_BYTES = 16 << 10
"""Bytes one read of a connection takes; what the parser leaves of them (``ZmtpPeer.stopped_short``) it holds until
the next turn."""
READ_BYTES_PER_TURN = 256 << 10
"""Bytes one turn reads from one connection at most, whether or not they complete a request: the largest request
the daemon decodes (1 MiB) takes four turns, and a peer streaming what completes none (heartbeats, the parts of a
message) leaves the rest in the kernel. A turn read a connection until it completed a request, so a stream of PINGs
held the loop for as long as it lasted (issue #61, ``tests/test_control_streams.py``)."""
MAX_PARTIAL_BYTES_PER_UID = 64 << 20
"""Bytes of unfinished messages the daemon keeps for all the control connections of one uid; a connection taking its
uid past it, or past its fair share of :data:`MAX_PARTIAL_BYTES` (:class:`~..shares.Shares`), is closed. An honest
client's request is under 1 MiB, whole within four turns."""
MAX_PARTIAL_BYTES = 96 << 20
"""The same for all uids together, shared fairly; a uid may always hold :data:`MIN_PARTIAL_BYTES_PER_UID`."""
MIN_PARTIAL_BYTES_PER_UID = MAX_MESSAGE_BYTES + RECEIVE_BYTES
"""One message, and a read."""
MAX_UNSENT_BYTES_PER_CONNECTION = 8 << 20
"""Bytes of replies the kernel has not taken yet that the daemon keeps for one connection (its peer reads none);
past them a reply is dropped, whole. A client has one request in flight, and the largest reply is a listing page
(about 2 MiB)."""
MAX_UNSENT_BYTES_PER_UID = 64 << 20
"""The same for all the connections of one uid."""
MAX_UNSENT_BYTES = 96 << 20
"""The same for all uids together, shared fairly; a uid may always have :data:`MIN_UNSENT_BYTES_PER_UID` unsent."""
MIN_UNSENT_BYTES_PER_UID = 4 << 20
"""Two listing pages, the largest replies."""
MAX_CONNECTIONS_PER_UID = 1024
"""Control connections of one uid; a newer one is closed at once. A uid has 128 sessions at most, one each."""
MAX_CONNECTIONS = 4096
"""Control connections of all uids together, shared fairly; a uid may always have :data:`MIN_CONNECTIONS_PER_UID`."""
MIN_CONNECTIONS_PER_UID = 128
"""A connection for each session a uid may have by default (``--max-sessions-per-uid``)."""
SWEEP_EVERY_S = 1.0
"""How often unfinished handshakes are ended and a listener paused for want of descriptors is resumed."""

Completed = Iterator[tuple[Peer, bytes, list[bytes]]]
"""Requests read: ``(peer, identity of its connection, frames)`` each."""


@dataclasses.dataclass(eq=False)
class _Connection:
    sock: socket.socket
    identity: bytes
    peer: Peer
    opened: float
    zmtp: ZmtpPeer = dataclasses.field(default_factory=ZmtpPeer)
    unsent: collections.deque[memoryview] = dataclasses.field(default_factory=collections.deque)
    """Replies, or what is left of them, that the kernel has not taken yet, the oldest first."""
    unsent_bytes: int = 0


class ControlSocket:
    """The control endpoint's listener and its connections, each with its ZMTP parser and its replies unsent."""

    def __init__(self) -> None:
        self._listener: socket.socket | None = None
        self._descriptors = Descriptors()
        self._by_fd: dict[int, _Connection] = {}
        self._by_identity: dict[bytes, _Connection] = {}
        self._serials = itertools.count(1)
        self._connections = Shares(MAX_CONNECTIONS_PER_UID, MAX_CONNECTIONS, MIN_CONNECTIONS_PER_UID)
        """Connections of each uid."""
        self._partial_bytes = Shares(MAX_PARTIAL_BYTES_PER_UID, MAX_PARTIAL_BYTES, MIN_PARTIAL_BYTES_PER_UID)
        """Bytes the unfinished messages of each uid's connections hold (:attr:`ZmtpPeer.held`)."""
        self._unsent_bytes = Shares(MAX_UNSENT_BYTES_PER_UID, MAX_UNSENT_BYTES, MIN_UNSENT_BYTES_PER_UID)
        self._turns: collections.OrderedDict[int, dict[int, int]] = collections.OrderedDict()
        """Connections to read and the events they had, by uid in the order of their turns, and by descriptor within
        a uid: those the poll found ready, and those holding bytes their parser left. A read takes one connection
        of each uid in turn; those it did not reach before its time was out go first at the next."""
        self._swept_at = time.monotonic()
        self._paused = False
        """The listener is out of the epoll, for want of descriptors, until the next sweep."""
        self._warnings = RateLimitedLog(log)

    def fileno(self) -> int:
        """The epoll the loop polls: readable while a connection or the listener is ready."""
        return self._descriptors.fileno()

    def listen(self, listener: socket.socket) -> None:
        """Accept connections on ``listener``, the control socket, listening and non-blocking. It stays its owner's
        (:class:`~hbmd.daemon.server.listening.ListeningSockets`), which hands it to a successor: a connect made while
        nobody accepts waits in its backlog."""
        self._listener = listener
        self._descriptors.register(listener.fileno(), select.EPOLLIN)

    def close(self) -> None:
        """Close every connection and the epoll, and stop accepting (the listener stays open: its owner's)."""
        for connection in list(self._by_fd.values()):
            self._close(connection)
        self._turns.clear()
        if self._listener is not None:
            self._descriptors.unregister(self._listener.fileno())
            self._listener = None
        self._descriptors.close()

    def __len__(self) -> int:
        """How many connections are open."""
        return len(self._by_fd)

    def partial_bytes(self, uid: int) -> int:
        """Bytes the unfinished messages of ``uid``'s connections hold."""
        return self._partial_bytes.held(uid)

    def unsent_bytes(self, uid: int) -> int:
        """Bytes of replies to ``uid``'s connections the kernel has not taken yet."""
        return self._unsent_bytes.held(uid)

    @property
    def pending(self) -> bool:
        """Connections wait to be read that the poll need not find ready again: the last read did not reach them,
        or left bytes they sent unparsed. The next turn reads them, without waiting."""
        return bool(self._turns)

    def read(self, until: float) -> Completed:
        """Accept who waits, then take the connections to read in their uids' turns until ``until``
        (``time.perf_counter``; one at least): send what waits for each, and read it until it completes one
        request, for :data:`READ_BYTES_PER_TURN` at most. The requests completed, each yielded before the next
        connection is read: the time their caller spends on them counts against ``until`` too."""
        for fd, events in self._descriptors.ready():
            if self._listener is not None and fd == self._listener.fileno():
                self._accept(self._listener)
            elif (connection := self._by_fd.get(fd)) is not None:
                self._to_read(connection, events)
        stopped_short: list[_Connection] = []
        first = True
        try:
            while self._turns and (first or time.perf_counter() < until):
                first = False
                uid, ready = self._turns.popitem(last=False)
                fd, events = next(iter(ready.items()))
                del ready[fd]
                if ready:
                    self._turns[uid] = ready
                connection = self._by_fd[fd]
                if events & select.EPOLLOUT:
                    self._flush(connection)
                if events & ~select.EPOLLOUT and connection.sock.fileno() >= 0:
                    request = self._receive(connection, until)
                    if connection.zmtp.stopped_short:
                        stopped_short.append(connection)
                    if request is not None:
                        yield connection.peer, connection.identity, request
        finally:
            # Once a turn: what their parsers left waits for the next turn, behind the connections waiting now.
            for connection in stopped_short:
                if connection.sock.fileno() >= 0:
                    self._to_read(connection, select.EPOLLIN)

    def send(self, identity: bytes, frames: list[bytes]) -> None:
        """Send ``frames`` as one message on the connection ``identity``, never waiting: dropped, as a ROUTER drops
        it, where the connection is gone or holds too much unsent."""
        connection = self._by_identity.get(identity)
        if connection is not None:
            self._send(connection, encode_message(frames))

    def look_after(self, now: float) -> None:
        """Every :data:`SWEEP_EVERY_S`: close handshakes older than ``HELLO_TIMEOUT_S``; listen again where
        accepting was paused for want of descriptors."""
        if now - self._swept_at < SWEEP_EVERY_S:
            return
        self._swept_at = now
        for connection in list(self._by_fd.values()):
            if not connection.zmtp.ready and now - connection.opened >= HELLO_TIMEOUT_S:
                self._cut(connection, logging.INFO, f"no ZMTP greeting and READY within {HELLO_TIMEOUT_S:g} s")
        if self._paused and self._listener is not None:
            self._paused = False
            self._descriptors.register(self._listener.fileno(), select.EPOLLIN)

    def _accept(self, listener: socket.socket) -> None:
        for sock in accepting(listener, self._warnings, "control", self._rest):
            self._admit(sock)

    def _rest(self, exc: OSError) -> None:
        """Out of descriptors: the listener rests until the next sweep (ready again at once, it would spin the loop)."""
        assert self._listener is not None
        self._warnings.warning("control-fds", "not accepting control connections for %g s: %s", SWEEP_EVERY_S,
                               os.strerror(exc.errno or 0))
        self._paused = True
        self._descriptors.unregister(self._listener.fileno())

    def _admit(self, sock: socket.socket) -> None:
        credentials = accepted(sock, self._warnings, "control")
        if credentials is None:
            return
        pid, uid, _, _ = credentials
        identity = next(self._serials).to_bytes(8, "big")
        peer = Peer(uid, pid) if pid > 0 else Peer(uid, pid, identity)
        if not self._connections.fits(uid, 1):
            self._warnings.warning(f"control-connections-{uid}", "closed a control connection of %s (uid %d): its "
                                   "uid has %d open, the most one uid may now of %d in all (%d open)", peer, uid,
                                   self._connections.held(uid), MAX_CONNECTIONS, self._connections.in_all)
            sock.close()
            return
        connection = _Connection(sock, identity, peer, time.monotonic())
        self._by_fd[sock.fileno()] = connection
        self._by_identity[identity] = connection
        self._connections.add(uid, 1)
        self._descriptors.register(sock.fileno(), select.EPOLLIN)
        self._send(connection, GREETING)

    def _to_read(self, connection: _Connection, events: int) -> None:
        """Read ``connection`` for ``events`` in its uid's next turns (where it waits already, in its place)."""
        uid = connection.peer.uid
        ready = self._turns.get(uid)
        if ready is None:
            ready = self._turns[uid] = {}
        fd = connection.sock.fileno()
        ready[fd] = ready.get(fd, 0) | events

    def _receive(self, connection: _Connection, until: float) -> list[bytes] | None:
        """Parse what ``connection`` holds and read it until a request is whole (its frames), the parser stops short,
        :data:`READ_BYTES_PER_TURN` are read, ``until`` is past (one read at least), it has nothing more or it is
        closed (None)."""
        uid = connection.peer.uid
        data = b""
        received = 0
        while True:
            held = connection.zmtp.held
            violation = ""
            messages: list[list[bytes]] = []
            try:
                messages, reply = connection.zmtp.feed(data, room=1)
            except ZmtpViolation as exc:
                violation = str(exc)
            grown = connection.zmtp.held - held
            self._partial_bytes.add(uid, grown)
            if not violation and grown > 0 and self._partial_bytes.over(uid):
                violation = (f"its uid's unfinished control requests past {self._partial_bytes.share(uid) >> 20} MiB, "
                             f"its share now ({MAX_PARTIAL_BYTES >> 20} MiB in all)")
            if violation:
                self._cut(connection, logging.WARNING, violation)
                return None
            if reply:
                self._send(connection, reply)
            if messages:
                return messages[0]
            if (connection.zmtp.stopped_short or received >= READ_BYTES_PER_TURN
                    or (received and time.perf_counter() >= until) or connection.sock.fileno() < 0):
                return None
            try:
                data = connection.sock.recv(RECEIVE_BYTES)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                data = b""
            if not data:
                self._close(connection)
                return None
            received += len(data)

    def _send(self, connection: _Connection, data: bytes) -> None:
        """Send ``data`` after what waits unsent, keeping what the kernel does not take; drop it whole where that
        would pass :data:`MAX_UNSENT_BYTES_PER_CONNECTION` or its uid's share (:data:`MAX_UNSENT_BYTES_PER_UID`,
        :data:`MAX_UNSENT_BYTES`)."""
        uid = connection.peer.uid
        if connection.unsent and (connection.unsent_bytes + len(data) > MAX_UNSENT_BYTES_PER_CONNECTION
                                  or not self._unsent_bytes.fits(uid, len(data))):
            self._warnings.warning(f"unsent-{uid}", "%s (uid %d) reads none of what the control socket sends it: "
                                   "a reply dropped", connection.peer, uid)
            return
        if not connection.unsent:
            try:
                sent = connection.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(connection)
                return
            if sent == len(data):
                return
            self._descriptors.register(connection.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)
            data = data[sent:]
        connection.unsent.append(memoryview(data))
        connection.unsent_bytes += len(data)
        self._unsent_bytes.add(uid, len(data))

    def _flush(self, connection: _Connection) -> None:
        """Send what waits unsent, as far as the kernel takes it."""
        uid = connection.peer.uid
        while connection.unsent:
            head = connection.unsent[0]
            try:
                sent = connection.sock.send(head)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(connection)
                return
            connection.unsent_bytes -= sent
            self._unsent_bytes.add(uid, -sent)
            if sent < len(head):
                connection.unsent[0] = head[sent:]
                return
            connection.unsent.popleft()
        self._descriptors.register(connection.sock.fileno(), select.EPOLLIN)

    def _cut(self, connection: _Connection, level: int, why: str) -> None:
        """Close ``connection`` for ``why``, logged at ``level`` once per uid per interval; during the handshake, say
        ``why`` to the peer first in ZMTP's ERROR (a misconfigured client otherwise sees only a disconnect, and
        reconnects)."""
        peer = connection.peer
        self._warnings.log(level, f"zmtp-{peer.uid}", "closed a control connection of %s (uid %d): %s", peer,
                           peer.uid, why)
        if not connection.zmtp.ready and not connection.unsent:
            with contextlib.suppress(OSError):
                connection.sock.send(error_command(why))
        self._close(connection)

    def _close(self, connection: _Connection) -> None:
        """Close ``connection`` and let go of all it held."""
        uid = connection.peer.uid
        fd = connection.sock.fileno()
        if fd < 0:
            return
        self._descriptors.unregister(fd)
        ready = self._turns.get(uid)
        if ready is not None and ready.pop(fd, None) is not None and not ready:
            del self._turns[uid]
        connection.sock.close()
        del self._by_fd[fd]
        del self._by_identity[connection.identity]
        self._connections.add(uid, -1)
        self._partial_bytes.add(uid, -connection.zmtp.held)
        self._unsent_bytes.add(uid, -connection.unsent_bytes)
        connection.zmtp = ZmtpPeer()
        connection.unsent.clear()
