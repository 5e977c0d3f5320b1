"""The in-process baselines: what an engine does without hbmd, step for step the work hbmd splits in two.

:class:`CudaInProcessBuffer` is an engine's own extensible KV buffer: one
reserved VA range, and per commit one exportable (POSIX-FD) ``cuMemCreate``
chunk, mapped, given access and zeroed, through the same ``hbmd.driver``
calls the daemon and the client make. :class:`HostInProcessBuffer` is the
same on the host: one memfd per buffer, ``fallocate`` per commit, mapped
``MAP_SHARED|MAP_FIXED`` into a reserved range and zeroed.

A :class:`CudaInProcessBuffer` with a ``handover`` socket is the floor of a
commit that outlives its process: each chunk's FD is also exported and sent
to another process before the commit returns, as a commit on credit must
(and nothing else: no protocol, no check on the other side).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from typing import Any, Iterator

from hbmd import driver
from hbmd.client.host import HostMapper
from hbmd.proto import ChunkInfo
from hbmd.proto.units import round_up


class CudaInProcessBuffer:
    """A reserved range grown by one exportable chunk per :meth:`commit`, in this process's current context."""

    def __init__(self, capacity: int, ordinal: int, granule: int, stream: Any,
                 handover: socket.socket | None = None) -> None:
        """``handover``: a Unix socket to a process that takes each chunk's FD (:func:`fd_sink`)."""
        self.ordinal = ordinal
        self.granule = granule
        self.stream = stream
        self.capacity = round_up(capacity, granule)
        self.base = driver.reserve(self.capacity, granule)
        self.committed = 0
        self.chunks: list[tuple[int, int, Any]] = []
        self.handover = handover
        self.handed: list[int] = []
        """The FDs sent, closed at :meth:`release` (hbmd's client too closes them after its commit returns)."""

    def commit(self, num_bytes: int, zero: bool = True) -> None:
        """Back ``[committed, num_bytes)`` with one chunk; with ``zero`` wait until it reads as zero."""
        end = round_up(num_bytes, self.granule)
        size = end - self.committed
        if size <= 0:
            return
        address = self.base + self.committed
        handle = driver.create(self.ordinal, size, rdma=False)
        driver.map(address, size, handle)
        driver.set_access(address, size, [self.ordinal])
        self.chunks.append((self.committed, size, handle))
        self.committed = end
        if zero:
            driver.memset_async(address, size, self.stream)
        if self.handover is not None:
            self.handed.append(driver.export_fd(handle))
            socket.send_fds(self.handover, [b"chunk"], self.handed[-1:])
        if zero:
            driver.context_synchronize()

    def release(self) -> None:
        """Unmap and release every chunk; the range stays reserved."""
        driver.context_synchronize()
        for fd in self.handed:
            os.close(fd)
        self.handed = []
        for offset, size, handle in self.chunks:
            driver.unmap(self.base + offset, size)
            driver.release(handle)
        self.chunks = []
        self.committed = 0

    def free(self) -> None:
        self.release()
        driver.unreserve(self.base, self.capacity)

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)


class HostInProcessBuffer:
    """A memfd-backed reserved range grown by one ``fallocate``d, mapped range per :meth:`commit`."""

    def __init__(self, capacity: int, granule: int) -> None:
        self.granule = granule
        self.capacity = round_up(capacity, granule)
        self.mapper = HostMapper(granule)
        self.fd = os.memfd_create("bench-in-process", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.capacity)
        self.base = self.mapper.reserve(self.capacity)
        self.committed = 0

    def commit(self, num_bytes: int, zero: bool = True) -> None:
        end = round_up(num_bytes, self.granule)
        size = end - self.committed
        if size <= 0:
            return
        os.posix_fallocate(self.fd, self.committed, size)
        self.mapper.map(self.base + self.committed, ChunkInfo(0, self.committed, size, self.committed), self.fd)
        if zero:
            self.mapper.zero(self.base + self.committed, size)
        self.committed = end

    def release(self) -> None:
        """Unmap (back to an inaccessible reservation) and drop the memfd's pages (truncating frees them all)."""
        if self.committed:
            self.mapper.unmap(self.base, self.committed)
            os.ftruncate(self.fd, 0)
            os.ftruncate(self.fd, self.capacity)
        self.committed = 0

    def free(self) -> None:
        self.release()
        self.mapper.unreserve(self.base, self.capacity)
        os.close(self.fd)


FD_SINK = """
import os, socket, sys
from hbmd.proto.fdpass import receive_with_fds
sock = socket.socket(fileno=int(sys.argv[1]))
while True:
    data, fds, _ = receive_with_fds(sock, 64, 16)
    for fd in fds:
        os.close(fd)
    if not data:
        break
"""


@contextlib.contextmanager
def fd_sink() -> Iterator[socket.socket]:
    """A Unix ``SOCK_SEQPACKET`` socket (as hbmd's handle plane) to a process that takes the FDs sent on it and closes
    them: the other side of a :class:`CudaInProcessBuffer` handover."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        with theirs:
            sink = subprocess.Popen([sys.executable, "-c", FD_SINK, str(theirs.fileno())], pass_fds=[theirs.fileno()])
        try:
            yield ours
        finally:
            ours.shutdown(socket.SHUT_RDWR)
            sink.wait(10)
