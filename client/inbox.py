"""What the daemon sends on a session's handle socket, handed to the reader it is meant for.

Two readers share the socket: a caller waiting for its request's FD batches
(and, protocol 1.7, the reply riding with the first), and the client's
listener thread, which serves leases, credit and the daemon's requests to
give memory back. Either may read a datagram meant for the other. The
:class:`Inbox` is where it is left: FD batches in a backlog (with an eventfd
written, so that a caller asleep on the socket wakes for the batch the
listener took), everything else in a queue per kind. Reads happen under one
lock and never wait under it: a reader that finds nothing waits outside, so
the other reader, and sends (which take the lock too: the socket's blocking
mode is shared), go on meanwhile.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import threading
import time
import weakref

from hbmd.proto import (
    MAX_FDS_PER_DATAGRAM,
    Committed,
    CreditGrant,
    CreditRevoke,
    FdBatch,
    LeaseGrant,
    LeaseRevoke,
    PromoteRequest,
    ReclaimRequest,
    decode_datagram,
)
from hbmd.proto.errors import DaemonUnavailable, ProtocolError, SessionLost
from hbmd.proto.fdpass import receive_with_fds

MAX_DATAGRAM = 64 << 10


def receive(sock: socket.socket, path: str, timeout: float) -> tuple[bytes, list[int]]:
    """One datagram and its FDs from the daemon at ``path``, waiting up to ``timeout`` (0: ``BlockingIOError`` where
    none waits); :class:`SessionLost` once the daemon has closed the connection."""
    sock.settimeout(timeout)
    try:
        data, fds, _ = receive_with_fds(sock, MAX_DATAGRAM, MAX_FDS_PER_DATAGRAM)
    except TimeoutError:
        raise DaemonUnavailable(f"hbmd at {path} sent nothing within {timeout:.1f}s", path=path) from None
    if not data and not fds:
        raise SessionLost(f"hbmd at {path} closed the session", path=path)
    return data, fds


class Inbox:
    """The datagrams read from one handle socket, filed for their readers.

    ``lock`` guards the socket: hold it to send on it (:meth:`HandleChannel.send`).
    The queues are the listener's to serve: ``reclaims`` (requests to give
    memory back), ``demotes`` (to demote buffers under pressure, and to
    promote them back once there is room), ``grants`` (leased granules, with
    their FDs), ``revokes`` (leased granules asked back) and ``credits``
    (credit granted and asked back, in the order they came).
    """

    def __init__(self, sock: socket.socket, path: str) -> None:
        self.sock = sock
        self.path = path
        self.lock = threading.Lock()
        self._backlog: list[tuple[FdBatch, list[int]]] = []
        self.reclaims: collections.deque[ReclaimRequest] = collections.deque()
        self.demotes: collections.deque[ReclaimRequest | PromoteRequest] = collections.deque()
        self.grants: collections.deque[tuple[LeaseGrant, list[int]]] = collections.deque()
        self.revokes: collections.deque[LeaseRevoke] = collections.deque()
        self.credits: collections.deque[CreditGrant | CreditRevoke] = collections.deque()
        self.filed = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        """Written when an FD batch goes to the backlog: a caller that waits on other sockets too (the control socket)
        watches it."""
        self._close_filed = weakref.finalize(self, os.close, self.filed)
        """Closes it once, at :meth:`close` or when a client dropped unclosed lets go of this inbox."""

    # the caller's side

    def receive_fds(self, request_id: int, deadline: float) -> tuple[FdBatch, list[int]]:
        """The next FD batch of ``request_id``; batches of earlier requests are dropped and their FDs closed.

        Raises :class:`DaemonUnavailable` past ``deadline``
        (``time.monotonic``), :class:`SessionLost` once the daemon has closed
        the session.
        """
        while True:
            with self.lock:
                batch = self._take_batch(request_id)
                if batch is not None:
                    return batch
                read = self._read_and_file()
            if read:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DaemonUnavailable(f"hbmd at {self.path} sent no chunk FDs for request {request_id} in time",
                                        path=self.path)
            # Readable socket: a datagram to read; readable eventfd: the listener read and filed a batch first.
            select.select([self.sock.fileno(), self.filed], [], [], remaining)

    def reply_to(self, request_id: int) -> Committed | None:
        """The reply to ``request_id`` that rode with its first FD batch (:attr:`FdBatch.reply`), once that batch is
        here; None until then. Reads and files what waits, without waiting; the batch stays filed for its delivery.
        Raises :class:`SessionLost` once the daemon has closed the session."""
        with self.lock:
            self._clear_filed()
            while self._read_and_file():
                pass
            for batch, _ in self._backlog:
                if batch.request_id == request_id and batch.reply is not None:
                    return batch.reply
        return None

    def _take_batch(self, request_id: int) -> tuple[FdBatch, list[int]] | None:
        """The first filed batch of ``request_id``, the lock held; those of earlier requests are dropped."""
        self._clear_filed()
        for stale in [entry for entry in self._backlog if entry[0].request_id < request_id]:
            self._backlog.remove(stale)
            _close_all(stale[1])
        for i, (waiting, _) in enumerate(self._backlog):
            if waiting.request_id == request_id:
                return self._backlog.pop(i)
        return None

    def _clear_filed(self) -> None:
        try:
            os.eventfd_read(self.filed)
        except BlockingIOError:
            pass  # nothing filed by the other reader since the last look

    # the listener's side

    def poll(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a datagram and file it; False once the daemon has gone."""
        try:
            readable, _, _ = select.select([self.sock], [], [], timeout)
        except (OSError, ValueError):
            return False
        if not readable:
            return True
        with self.lock:
            return self._file_next() is not False  # None: the other reader took it

    def drain(self) -> None:
        """File every datagram waiting now, without waiting."""
        with self.lock:
            while self._file_next():
                pass

    def _file_next(self) -> bool | None:
        """Read and file one datagram, the lock held: True; None when none waits; False once the daemon has gone."""
        try:
            return self._read_and_file() or None
        except (DaemonUnavailable, OSError):
            return False

    # both

    def _read_and_file(self) -> bool:
        """Read one datagram and file it, the lock held; False when none waits. Raises once the daemon has gone."""
        try:
            # Non-blocking mode, not MSG_DONTWAIT: with a timeout set, Python waits for the socket to turn readable
            # before it reads, and if the other reader took the datagram, this would sit on the lock (which sends
            # need too) until the next one arrived or the timeout passed.
            data, fds = receive(self.sock, self.path, timeout=0.0)
        except BlockingIOError:
            return False
        batch = self._sort(data, fds)
        if batch is not None:
            self._backlog.append((batch, fds))
            os.eventfd_write(self.filed, 1)
        return True

    def _sort(self, data: bytes, fds: list[int]) -> FdBatch | None:
        """File one datagram in its queue; returns an FD batch, or None (its FDs closed unless filed with a grant)."""
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

    def close(self) -> None:
        """Close the eventfd and the FDs that came and were never taken (the socket is its channel's)."""
        self._close_filed()
        self.filed = -1
        for _, fds in (*self._backlog, *self.grants):
            _close_all(fds)
        self._backlog.clear()
        self.grants.clear()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
