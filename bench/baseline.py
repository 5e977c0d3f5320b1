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

:class:`CudaGrantedBuffer` is the floor of a commit through any daemon: each
chunk is one another process made and exported ahead (:func:`granter`), asked
for with a ZeroMQ request and answered by its FD on a Unix socket, then
imported, mapped, given access and zeroed. What ZeroMQ, the kernel and the
driver alone cost for a round trip that hands over a chunk, with no protocol,
no accounting and no checks on either side.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, Self

import zmq
from hbmd import driver
from hbmd.client.env import spin_from_env
from hbmd.client.host import HostMapper
from hbmd.client.transport import poll_spinning
from hbmd.proto import ChunkInfo
from hbmd.proto.fdpass import receive_with_fds
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
sock, imports = socket.socket(fileno=int(sys.argv[1])), sys.argv[2] == "import"
if imports:
    from hbmd import driver
    driver.init()
while True:
    data, fds, _ = receive_with_fds(sock, 64, 16)
    for fd in fds:
        if imports:
            driver.release(driver.import_fd(fd))
        os.close(fd)
    if not data:
        break
"""


@contextlib.contextmanager
def fd_sink(imports: bool = False) -> Iterator[socket.socket]:
    """A Unix ``SOCK_SEQPACKET`` socket (as hbmd's handle plane) to a process that takes the FDs sent on it and closes
    them: the other side of a :class:`CudaInProcessBuffer` handover. ``imports``: it imports each chunk first (and
    lets the import go), as an owner that does not trust the sender must to check what it was sent (hbmd's daemon
    with a chunk made on credit), or as the process mapping a chunk another made (a leased granule)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours:
        with theirs:
            sink = subprocess.Popen([sys.executable, "-c", FD_SINK, str(theirs.fileno()), "import" if imports else "-"],
                                    pass_fds=[theirs.fileno()])
        try:
            yield ours
        finally:
            ours.shutdown(socket.SHUT_RDWR)
            sink.wait(10)


GRANTER = """
import os, socket, sys, zmq
from hbmd import driver
ordinal, warm, endpoint, fd = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
sock = socket.socket(fileno=fd)
router = zmq.Context.instance().socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
router.bind(endpoint)
driver.init()
handles, ready = [], []

def make():
    handles.append(driver.create(ordinal, driver.granularity(ordinal), rdma=False))
    ready.append(driver.export_fd(handles[-1]))

for _ in range(warm):
    make()
print("ready", flush=True)
while True:
    router.recv_multipart()
    if not ready:
        make()
    fd = ready.pop(0)
    socket.send_fds(sock, [b"granule"], [fd])
    os.close(fd)
    if len(ready) < warm:
        make()
"""


@contextlib.contextmanager
def granter(ordinal: int, warm: int) -> Iterator[Granter]:
    """A process that keeps ``warm`` granules made and exported ahead (as hbmd's warm pool) and answers each ZeroMQ
    request with one's FD on a Unix ``SOCK_SEQPACKET`` socket, making the next after it answers (as the pool refills;
    with none ahead, before). It holds every granule it made until it ends, with the block."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with tempfile.TemporaryDirectory(prefix="hbmdb-granter-", dir="/tmp") as directory, ours:
        endpoint = f"ipc://{directory}/granter.sock"
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-c", GRANTER, str(ordinal), str(warm), endpoint, str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, text=True,
            )
        try:
            if process.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the granter exited with {process.wait(10)} before it was ready")
            with Granter(endpoint, ours) as granted:
                yield granted
        finally:
            process.kill()
            process.wait(10)


class Granter:
    """The asking side of :func:`granter`: one request per granule, its FD read the way hbmd's client reads a reply
    that rides with FDs (polled for as long as hbmd's client polls, ``HBMD_SPIN_US``, then waited for)."""

    def __init__(self, endpoint: str, sock: socket.socket) -> None:
        self.sock = sock
        self.dealer = zmq.Context.instance().socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(endpoint)
        self.poller = zmq.Poller()
        self.poller.register(sock.fileno(), zmq.POLLIN)
        self.spin = spin_from_env()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.dealer.close(linger=0)

    def take(self) -> int:
        """The FD of one granule."""
        self.dealer.send(b"granule")
        sent = time.monotonic()
        if not poll_spinning(self.poller, sent + 5, sent + self.spin):
            raise TimeoutError("the granter sent no FD within 5 s")
        _, fds, _ = receive_with_fds(self.sock, 64, 1)
        return fds[0]


class CudaGrantedBuffer:
    """A reserved range grown one granule per :meth:`commit`, each granted by another process (:class:`Granter`)."""

    def __init__(self, capacity: int, ordinal: int, granule: int, stream: Any, granted: Granter) -> None:
        self.ordinal = ordinal
        self.granule = granule
        self.stream = stream
        self.granted = granted
        self.capacity = round_up(capacity, granule)
        self.base = driver.reserve(self.capacity, granule)
        self.committed = 0
        self.chunks: list[tuple[int, Any, int]] = []
        """(offset, imported handle, FD) per granule; the FDs are closed at :meth:`release`, off the clock."""

    def commit(self, num_bytes: int) -> None:
        """Back ``[committed, num_bytes)`` (one granule more) with a granted chunk, and wait until it reads as zero."""
        end = round_up(num_bytes, self.granule)
        if end - self.committed != self.granule:
            raise ValueError("a granted buffer grows one granule at a time")
        fd = self.granted.take()
        handle = driver.import_fd(fd)
        address = self.base + self.committed
        driver.map(address, self.granule, handle)
        driver.set_access(address, self.granule, [self.ordinal])
        self.chunks.append((self.committed, handle, fd))
        self.committed = end
        driver.memset_async(address, self.granule, self.stream)
        driver.context_synchronize()

    def release(self) -> None:
        driver.context_synchronize()
        for offset, handle, fd in self.chunks:
            driver.unmap(self.base + offset, self.granule)
            driver.release(handle)
            os.close(fd)
        self.chunks = []
        self.committed = 0

    def free(self) -> None:
        self.release()
        driver.unreserve(self.base, self.capacity)


@contextlib.contextmanager
def granted_buffers(ordinal: int, granule: int, stream: Any, warm: int) -> Iterator[Any]:
    """Makes :class:`CudaGrantedBuffer` of a given capacity, all granted by one :func:`granter`, alive with the
    block."""
    with granter(ordinal, warm) as granted:
        yield lambda capacity: CudaGrantedBuffer(capacity, ordinal, granule, stream, granted)
