"""The chunks that answer a request, as their FDs arrive on the handle socket.

A request answered by :class:`Committed` (commit, attach, defragment, remap)
has its new chunks' FDs follow on the handle socket in ``fd_batches``
datagrams of at most :data:`MAX_FDS_PER_DATAGRAM`. A :class:`Delivery` hands
them to its reader one at a time, a batch at a time as they arrive, so a
buffer of thousands of chunks never has thousands of FDs open in this
process, and it closes every one whatever the reader does with it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator

from hbmd.proto import ChunkInfo, Committed
from hbmd.proto.errors import DriverError, ProtocolError

from .inbox import Inbox
from .transport import FdCloser

log = logging.getLogger("hbmd.client")


class Delivery:
    """The daemon's reply to a request that brings chunks, and the chunks as their FDs arrive.

    ``reply`` is there at once. Iterating gives ``(ChunkInfo, fd)`` pairs;
    each FD belongs to the delivery and stays open until the next pair is
    asked for or the delivery closes (``os.dup`` it to keep it longer).
    Closing receives the batches not read yet and closes every FD that came:
    use it in a ``with`` block, and a failure in the block is raised once all
    batches are in. A batch the daemon could not export raises
    :class:`DriverError`, also once all batches are in.

    It holds the session's lock, taken by the caller for the request, until
    it closes: no other request of the session comes between the reply and
    its batches.
    """

    def __init__(
        self,
        reply: Committed,
        request_id: int,
        inbox: Inbox,
        closer: FdCloser,
        timeout: float,
        session_lock: threading.RLock,
    ) -> None:
        self.reply = reply
        self._request_id = request_id
        self._inbox = inbox
        self._closer = closer
        self._deadline = time.monotonic() + timeout
        self._session_lock = session_lock
        self._chunks = {c.chunk_id: c for c in reply.chunks}
        self._batches_left = reply.fd_batches
        self._arrived: collections.deque[tuple[int, int]] = collections.deque()
        self._handed: int | None = None
        """The FD given out last: the reader's until it asks for the next."""
        self.closed = False

    def __iter__(self) -> Iterator[tuple[ChunkInfo, int]]:
        return self

    def __next__(self) -> tuple[ChunkInfo, int]:
        self._close_handed()
        while not self._arrived:
            if not self._batches_left:
                raise StopIteration
            self._receive_batch()
        chunk_id, self._handed = self._arrived.popleft()
        if chunk_id not in self._chunks:
            raise ProtocolError(f"the daemon sent chunk {chunk_id}, not one of its reply's")
        return self._chunks[chunk_id], self._handed

    def _receive_batch(self) -> None:
        batch, fds = self._inbox.receive_fds(self._request_id, self._deadline)
        self._batches_left -= 1
        self._arrived.extend(zip(batch.chunk_ids, fds))
        if batch.error:
            self.close()
            raise DriverError(f"daemon could not export chunks: {batch.error}")

    def _close_handed(self) -> None:
        if self._handed is not None:
            self._closer.close_later(self._handed)
            self._handed = None

    def close(self) -> None:
        """Close every FD that came and receive (and close) the batches still due; then let the session go on."""
        if self.closed:
            return
        self.closed = True
        try:
            self._close_handed()
            while self._arrived:
                self._closer.close_later(self._arrived.popleft()[1])
            while self._batches_left:
                _, fds = self._inbox.receive_fds(self._request_id, self._deadline)
                self._batches_left -= 1
                for fd in fds:
                    self._closer.close_later(fd)
        finally:
            self._session_lock.release()

    def __enter__(self) -> Delivery:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.close()
            return
        try:
            self.close()
        except Exception as exc:
            # The failure in the block came first and says what went wrong; the rest of the batches is lost with it.
            log.debug("receiving the rest of a failed delivery failed too: %s", exc)
