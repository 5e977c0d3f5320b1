"""FDs on their way to sessions: what is queued, when it may be sent, and how a reader that does not read is held.

Every chunk FD travels on the session's handle socket with ``SCM_RIGHTS``,
queued in its connection's outbox and sent as the socket drains, so a slow
reader never blocks the daemon. Two kinds of delivery wait there: a
request's batch of one buffer's chunks (:class:`~.deliveries.ChunkDelivery`, headed by an
``FdBatch``) and granules leased to the session (:class:`~.deliveries.LeaseDelivery`,
headed by a ``LeaseGrant``). Each FD is exported just before it is sent and
closed at once after.

Flow control: the kernel charges FDs queued on sockets to the sender's user,
up to its RLIMIT_NOFILE, and beyond it refuses every send alike
(ETOOMANYREFS). They stay charged until the peer reads them or closes its
socket: ending a session that does not read would not give them back, only
lose count of them. So such a session is held, not ended: nothing more is
sent to it until it reads (:data:`MAX_FDS_IN_FLIGHT`), its uid's other
sessions keep the rest of the uid's share (:data:`MAX_FDS_IN_FLIGHT_PER_UID`),
other uids are not touched, and past :data:`MAX_QUEUED_BATCHES` its requests
for more FDs are refused.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import select
import socket
import struct
import termios
from collections.abc import Mapping
from typing import Generic

from hbmd.proto import MAX_FDS_PER_DATAGRAM, MAX_SEGMENTS_WITH_FDS, Committed, encode_datagram
from hbmd.proto.errors import Conflict, HbmdError, InternalError

from ..backends import A, C
from ..fds import limit as fd_limit
from ..state import Buffer, Chunk, State
from .connection import Descriptors, HandleConnection
from .deliveries import ChunkDelivery, Delivery, LeaseDelivery
from .ratelimit import RateLimitedLog

log = logging.getLogger("hbmd.server.outbox")

MAX_FDS_IN_FLIGHT = 4096
"""FDs one session may have sent to it and not yet read (a 32nd of RLIMIT_NOFILE where less, one batch at least)."""
MAX_FDS_IN_FLIGHT_PER_UID = 16384
"""The same for all sessions of one uid together (an 8th of RLIMIT_NOFILE where less, one batch at least)."""
MAX_QUEUED_BATCHES = 1024
"""FD batches (of up to 250) waiting in one session's outbox: past it, requests for more FDs are refused."""
DRAIN_CHECK_S = 0.02
"""How often a session waiting for its socket to drain is looked at again."""


def unread_bytes(sock: socket.socket) -> int:
    """Bytes sent on ``sock`` that its peer has not read yet (``SIOCOUTQ``): 0 once it read everything."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


class Outbox(Generic[A, C]):
    """The queued FDs of every session, sent as far as each peer keeps up."""

    def __init__(
        self, state: State[A, C], descriptors: Descriptors, connections: Mapping[int, HandleConnection[A, C]]
    ) -> None:
        """``descriptors``: the handle plane's, where a full socket is watched for room too. ``connections``: the
        handle plane's, by socket fd; a session's FDs in flight count against its uid's."""
        self.state = state
        self._descriptors = descriptors
        self._connections = connections
        self._session_fd_share = max(MAX_FDS_PER_DATAGRAM, min(MAX_FDS_IN_FLIGHT, fd_limit() // 32))
        self._uid_fd_share = max(MAX_FDS_PER_DATAGRAM, min(MAX_FDS_IN_FLIGHT_PER_UID, fd_limit() // 8))
        self._draining: set[int] = set()
        """Handle sockets (by fd) with FDs queued until their peer reads what it has."""
        self._warnings = RateLimitedLog(log)

    @property
    def holding(self) -> bool:
        """Whether some session is held until its peer reads: the loop must look again in :data:`DRAIN_CHECK_S`."""
        return bool(self._draining)

    def check_reading(self, conn: HandleConnection[A, C]) -> None:
        """Refuse a session more FDs (``Conflict``, retryable) while :data:`MAX_QUEUED_BATCHES` batches wait for it."""
        if len(conn.outbox) >= MAX_QUEUED_BATCHES:
            self._warnings.warning(
                f"queued-{conn.uid}", "refusing session %d (pid %d) more FDs: %d batches wait for it to read its "
                "handle socket", conn.opened_session.session_id, conn.pid, len(conn.outbox),
            )
            raise Conflict(
                f"{len(conn.outbox)} batches of FDs wait unread on this session's handle socket; read them first"
            )

    def deliver(
        self, conn: HandleConnection[A, C], request_id: int, buffer: Buffer[A, C], chunks: list[Chunk[C]]
    ) -> int:
        """Queue the FDs of a request's ``chunks`` of ``buffer``; returns the batches. They go at the next
        :meth:`flush`, once the request is journaled (the loop's)."""
        batches = [chunks[i : i + MAX_FDS_PER_DATAGRAM] for i in range(0, len(chunks), MAX_FDS_PER_DATAGRAM)]
        for index, batch in enumerate(batches):
            conn.outbox.append(ChunkDelivery(request_id, buffer, batch, index, len(batches)))
        return len(batches)

    def reply_with_fds(self, conn: HandleConnection[A, C], request_id: int, reply: Committed) -> bool:
        """Put the reply to ``request_id`` in the first batch of its FDs, still queued, where the client asked for
        replies there and the reply is small (:class:`FdBatch`); False where it must go on the control socket."""
        if not conn.replies_with_fds or reply.fd_batches != 1 or reply.buffer.num_segments > MAX_SEGMENTS_WITH_FDS:
            return False
        for delivery in reversed(conn.outbox):
            if isinstance(delivery, ChunkDelivery) and delivery.request_id == request_id and delivery.batch == 0:
                delivery.reply = reply
                return True
        return False

    def top_up_lease(self, conn: HandleConnection[A, C], until: float) -> None:
        """Lease the session the granules its lease lacks (those made by ``until`` at least, see
        :meth:`Leases.top_up`) and queue them, unless its outbox is full already; the caller flushes (once the
        lease is journaled)."""
        if len(conn.outbox) >= MAX_QUEUED_BATCHES:
            return
        chunks = self.state.leases.top_up(conn.opened_session, until)
        if chunks:
            conn.outbox.append(LeaseDelivery(chunks, self.state.backend.granularity))

    def forget(self, conn: HandleConnection[A, C]) -> None:
        """Drop what waits for a connection that is closing."""
        conn.outbox.clear()
        self._draining.discard(conn.sock.fileno())

    def retry_draining(self) -> None:
        """Send on to sessions that were held until their peers read what they have."""
        for fd in list(self._draining):
            conn = self._connections.get(fd)
            if conn is None:
                self._draining.discard(fd)
            else:
                self.flush(conn)

    def flush(self, conn: HandleConnection[A, C]) -> None:
        """Send queued FD batches while the peer keeps up and the socket has room; close each FD once sent."""
        held = False
        while conn.outbox:
            delivery = conn.outbox[0]
            if not delivery.prune():
                conn.outbox.popleft()
                continue
            if not self._may_send(conn, len(delivery.chunks)):
                held = True
                break
            packed = self._pack(conn, delivery)
            if packed is None:
                conn.outbox.popleft()
                continue
            datagram, fds = packed
            try:
                socket.send_fds(conn.sock, [datagram], fds)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                held = self._send_failed(conn, exc)
                break
            finally:
                for fd in fds:
                    os.close(fd)
            conn.outbox.popleft()
            conn.fds_in_flight += len(fds)
        fd = conn.sock.fileno()
        if held:
            self._draining.add(fd)
        else:
            self._draining.discard(fd)
        # POLLOUT only for a full socket: one waiting for its peer to read would wake the loop at once, forever.
        self._descriptors.register(fd, select.EPOLLIN | (select.EPOLLOUT if conn.outbox and not held else 0))

    def _pack(self, conn: HandleConnection[A, C], delivery: Delivery[A, C]) -> tuple[bytes, list[int]] | None:
        """The delivery's datagram and its freshly exported FDs; None when there is nothing to send after all.

        A failed export closes the FDs already made and sends what the
        delivery says instead (a request's batch: its header with the error).
        """
        fds: list[int] = []
        try:
            if not all(c.live for c in delivery.chunks):
                raise InternalError("chunks were released before they were delivered")
            for chunk in delivery.chunks:
                fds.append(delivery.export(self.state, chunk))
        except (HbmdError, OSError) as exc:
            self._warnings.warning("export", "export for %s failed: %s", delivery.purpose, exc)
            for fd in fds:
                os.close(fd)
            instead = delivery.failed(self.state, conn.opened_session, str(exc))
            return None if instead is None else (encode_datagram(instead), [])
        return encode_datagram(delivery.header()), fds

    def _send_failed(self, conn: HandleConnection[A, C], exc: OSError) -> bool:
        """Log a send that failed; True when the session is held until readers catch up."""
        if exc.errno == errno.ETOOMANYREFS:
            # Too many FDs in flight for this user, on all sessions together: wait for readers.
            self._warnings.warning(
                "etoomanyrefs", "sending FDs to pid %d waits: too many FDs in flight (%s)", conn.pid, exc
            )
            return True
        if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
            self._warnings.warning("send", "sending FDs to pid %d failed: %s", conn.pid, exc)
        return False

    def _may_send(self, conn: HandleConnection[A, C], count: int) -> bool:
        """Whether ``count`` more FDs keep the session and its uid within their shares of FDs in flight.

        The counts only overstate what is unread, so where they fit nothing
        else is asked; only where they do not are the uid's sockets asked
        which peers have read everything since (an ``ioctl`` each, on every
        send to 16 sessions of one uid before).
        """
        if self._fits(conn, count):
            return True
        for other in self._connections.values():
            if other.uid == conn.uid and other.fds_in_flight and unread_bytes(other.sock) == 0:
                other.fds_in_flight = 0
        if self._fits(conn, count):
            return True
        uid_in_flight = sum(c.fds_in_flight for c in self._connections.values() if c.uid == conn.uid)
        self._warnings.warning(
            f"held-{conn.uid}", "holding FDs for session %d (pid %d, uid %d): %d of its FDs and %d of its uid's "
            "are unread", conn.session.session_id if conn.session else 0, conn.pid, conn.uid, conn.fds_in_flight,
            uid_in_flight,
        )
        return False

    def _fits(self, conn: HandleConnection[A, C], count: int) -> bool:
        uid_in_flight = sum(c.fds_in_flight for c in self._connections.values() if c.uid == conn.uid)
        return conn.fds_in_flight + count <= self._session_fd_share and uid_in_flight + count <= self._uid_fd_share
