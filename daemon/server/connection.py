"""One session's handle-plane connection: who is at the other end (from the kernel), and what waits to be sent to it."""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
import select
import socket
import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Generic

from hbmd.proto import Message, encode_datagram

from ..backends import A, C
from ..state import Session
from .ratelimit import RateLimitedLog

if TYPE_CHECKING:  # the deliveries module describes what a connection queues; the outbox sends it
    from .deliveries import Delivery

log = logging.getLogger("hbmd.server.handles")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)
"""Linux 6.5 and later: a pidfd of the process that connected, as the kernel recorded it at the connect."""


@dataclasses.dataclass
class HandleConnection(Generic[A, C]):
    """A client's ``SOCK_SEQPACKET`` connection: its peer's credentials, its session once it said hello, its outbox."""

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
    replies_with_fds: bool = False
    """The client reads replies that bring chunks on this socket, with their FDs (its hello asked, protocol 1.7)."""
    outbox: collections.deque[Delivery[A, C]] = dataclasses.field(default_factory=collections.deque)
    fds_in_flight: int = 0
    """FDs sent since the peer was last seen to have read everything."""
    exited_at: float | None = None
    """When the loop saw the peer's process exit with datagrams still to read (``HandlePlane``), else None."""

    @property
    def opened_session(self) -> Session:
        """The session its hello opened, for what comes only after the hello: requests, datagrams, the daemon's asks."""
        assert self.session is not None, f"pid {self.pid} has not said hello"
        return self.session

    def send_quietly(self, msg: Message) -> bool:
        """Send one datagram without FDs; a peer that is gone or not reading just misses it (False)."""
        try:
            self.sock.send(encode_datagram(msg))
        except OSError as exc:
            log.debug("sending %s to pid %d failed: %s", msg.KIND, self.pid, exc)
            return False
        return True

    def has_exited(self) -> bool:
        """Whether the session's process has exited (or its socket shown EOF), noticed or not by the loop yet."""
        if self.pidfd >= 0 and readable_now(self.pidfd):
            return True
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True


MAX_ACCEPTS_PER_TURN = 64
"""Connections a plane accepts in one turn of the loop; more wait for the next, so a burst of connects cannot hold
it."""


def accepting(listener: socket.socket, warnings: RateLimitedLog, plane: str,
              out_of_fds: Callable[[OSError], None]) -> Iterator[socket.socket]:
    """The connections waiting on ``listener`` (non-blocking), at most :data:`MAX_ACCEPTS_PER_TURN`; where the
    process is out of descriptors, ``out_of_fds`` decides what becomes of them (left waiting, the listener would wake
    the loop at once, forever), and another failure is logged."""
    for _ in range(MAX_ACCEPTS_PER_TURN):
        try:
            sock, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                out_of_fds(exc)
            else:
                warnings.warning(f"{plane}-accept", "accepting a %s connection failed: %s", plane, exc)
            return
        yield sock


def accepted(sock: socket.socket, warnings: RateLimitedLog, plane: str) -> tuple[int, int, int, set[int]] | None:
    """An accepted connection of ``plane`` made non-blocking, and its peer's credentials (:func:`peer_credentials`);
    None, the connection closed and the failure logged, where the kernel cannot say who it is."""
    sock.setblocking(False)
    try:
        return peer_credentials(sock)
    except OSError as exc:
        warnings.warning(f"{plane}-peercred", "reading a %s peer's credentials failed: %s", plane, exc)
        sock.close()
        return None


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


def peer_pidfd(sock: socket.socket, pid: int) -> int:
    """A pidfd of the process that connected ``sock`` (``pid`` by ``SO_PEERCRED``), or -1 where the kernel gives none;
    ``ProcessLookupError`` when it has already exited.

    The kernel's own (``SO_PEERPIDFD``) names the process that connected, whatever pid namespace it is in and
    however soon its pid is used again; where the kernel has no such option, ``pidfd_open`` on the pid, a moment
    after the connect, and not for a peer whose pid reads 0.
    """
    try:
        return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise ProcessLookupError(errno.ESRCH, "the peer has exited") from exc
        log.debug("no SO_PEERPIDFD (%s): a pidfd from the peer's pid", exc)
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


class Descriptors:
    """Descriptors watched by one epoll: the handle plane's (the listener, each connection's socket and pidfd), and
    apart the sockets of the sessions that place granules.

    The loop's poll watches the epoll's own descriptor, not each of them, so
    that a turn of the loop costs no time in proportion to the sessions
    connected (``bench/host_bench.py --cases status_by_sessions`` measures
    it): the epoll answers with the ready descriptors only. Level-triggered,
    as ``poll``: what a turn leaves unread is ready again at the next.

    A descriptor is unregistered before it is closed: the epoll would go on
    reporting a closed number whose file another copy still holds.
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._events: dict[int, int] = {}

    def fileno(self) -> int:
        return self._epoll.fileno()

    def register(self, fd: int, events: int) -> None:
        """Watch ``fd`` for ``events`` (``select.EPOLLIN``, ``EPOLLOUT``; errors and hang-ups always), or change what
        it is watched for."""
        known = self._events.get(fd)
        if known == events:
            return
        if known is None:
            self._epoll.register(fd, events)
        else:
            self._epoll.modify(fd, events)
        self._events[fd] = events

    def unregister(self, fd: int) -> None:
        """Stop watching ``fd``; one not watched is ignored."""
        if self._events.pop(fd, None) is not None:
            self._epoll.unregister(fd)

    def ready(self) -> list[tuple[int, int]]:
        """The watched descriptors ready now, and their events."""
        return self._epoll.poll(0)

    def close(self) -> None:
        self._epoll.close()
