"""Host backend: real memory from memfd files, mapped by clients with ``mmap``.

Each chunk is a memfd of its own, exactly the chunk's size, fully allocated
with ``fallocate`` when it is created (so the pages are really there, and
counted, when the commit returns) and sealed with ``F_SEAL_GROW |
F_SEAL_SHRINK | F_SEAL_SEAL``. A client gets a ``dup`` of it, and so can map
and write the chunk but can neither grow it nor fill holes beyond it: every
byte reachable through an FD the daemon hands out is a byte of the budget.
Releasing a chunk punches its pages out before the daemon closes its memfd,
so they go back at once even where a client kept a copy of the FD (or one
still waits unread on its socket); a client writing through such a copy
faults fresh pages in, charged to itself, never more than the chunk's size.

FD count: the daemon holds one descriptor per live chunk (and exported ones
only until they are sent). ``hbmd`` raises its ``RLIMIT_NOFILE`` to the hard
limit at start; a commit that would take the chunks past what that limit
leaves (see ``daemon/fds.py``) is refused with a retryable error naming the
limit, before a memfd is made.

The granule is 2 MiB rather than the 4 KiB page: it is the GPU granule, so a
buffer's chunk layout, its straddling granules and its sizes are the same on
both backends and the host tier tests what the GPU tier runs; it lets the
kernel back a chunk with transparent huge pages where shmem allows; and it
keeps chunk counts, and so mappings per commit, small.

The host tier (demoted buffers) is a second memfd pool of the same kind of
chunks, charged to the host budget instead of the device's: on this backend
both tiers are RAM, so what it tests is the protocol, the accounting and the
copies, as the CUDA backend runs them with host-NUMA memory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import threading

from hbmd import memfd
from hbmd.proto import TIER_DEVICE, TIER_HOST
from hbmd.proto.errors import InternalError, InvalidRequest, OutOfDeviceMemory

from .. import fds
from ..clock import Clock
from . import ParkableBackend
from .pool import HOST_PIECE, HostPool

GRANULE = 2 << 20
RECOUNT_EVERY = 32
"""Chunks made or released between two counts of the process's descriptors (see ``HostBackend._fds_left``)."""

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int


def punch_out(fd: int, size: int) -> None:
    """Free the pages of ``[0, size)`` of a memfd (``fallocate`` with ``FALLOC_FL_PUNCH_HOLE``); ``OSError`` on
    failure."""
    if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@dataclasses.dataclass(frozen=True)
class HostArena:
    """A host buffer needs no backend state of its own: its chunks are separate memfds."""


@dataclasses.dataclass(frozen=True)
class HostChunk:
    fd: int
    size: int


def out_of_fds(size: int) -> OutOfDeviceMemory:
    return OutOfDeviceMemory(
        f"the daemon has no file descriptor left for a new {size}-byte chunk (RLIMIT_NOFILE {fds.limit()}, "
        "one per chunk): retry once others free memory, or raise the daemon's limit",
        requested=size, limit="RLIMIT_NOFILE",
    )


def sealed_memfd(size: int, name: str = "hbmd-chunk") -> int:
    """A new chunk's memfd (:func:`hbmd.memfd.sealed_memfd`); ``OutOfDeviceMemory`` when memory or descriptors are
    short."""
    try:
        return memfd.sealed_memfd(size, name)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise out_of_fds(size) from None
        raise


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_meminfo_fd = -1


def host_available_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo: what can be allocated without swapping.

    Every ``status`` asks, so the file stays open and is re-read in place
    (the kernel renders it afresh on each read from offset 0).
    """
    global _meminfo_fd
    if _meminfo_fd < 0:
        _meminfo_fd = os.open("/proc/meminfo", os.O_RDONLY | os.O_CLOEXEC)
    data = os.pread(_meminfo_fd, 16384, 0)
    start = data.find(b"MemAvailable:")
    if start < 0:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return int(data[start:data.index(b"\n", start)].split()[1]) * 1024


class HostBackend(ParkableBackend[HostArena, HostChunk]):
    name = "host"
    instance = "host"
    granularity = GRANULE

    def __init__(self, host_pool_bytes: int = 0, host_piece: int = HOST_PIECE, clock: Clock | None = None) -> None:
        """``host_pool_bytes``: host-tier pieces of ``host_piece`` bytes kept made ahead of demotes (see
        ``pool.py``), by ``clock`` (the daemon's)."""
        self.total_bytes = host_memory_bytes()
        self._open_chunks = 0
        self._counting = threading.Lock()
        """Held while ``_open_chunks`` changes: the host pool's thread opens and closes chunks too."""
        self._counted = (0, -RECOUNT_EVERY)
        """``(descriptors open, chunks open)`` when the process's descriptors were last counted."""
        self.host_piece = host_piece
        self._host_pool: HostPool[HostChunk] = HostPool(
            host_piece, host_pool_bytes, self._make_host, self._release, clock=clock)

    def _fds_left(self) -> bool:
        """Whether one more chunk leaves the daemon its descriptor headroom.

        Sessions cost descriptors too, so this counts them all, but only every
        :data:`RECOUNT_EVERY` chunks (a count lists them all), adding the chunks
        opened since; what it misses in between stays within the headroom.
        """
        counted, at_chunks = self._counted
        if abs(self._open_chunks - at_chunks) >= RECOUNT_EVERY:
            counted, at_chunks = self._counted = (fds.open_count(), self._open_chunks)
        return counted + self._open_chunks - at_chunks < fds.usable()

    def _opened(self, chunk: HostChunk) -> HostChunk:
        with self._counting:
            self._open_chunks += 1
        return chunk

    def open_arena(self, reserved_bytes: int, shareable: bool) -> HostArena:
        return HostArena()

    def create(self, arena: HostArena, offset: int, size: int, tier: str = TIER_DEVICE) -> HostChunk:
        if tier == TIER_HOST:
            return self._host_pool.take(size)
        if not self._fds_left():
            raise out_of_fds(size)
        return self._opened(HostChunk(sealed_memfd(size), size))

    def _make_host(self, size: int) -> HostChunk:
        if not self._fds_left():
            raise out_of_fds(size)
        return self._opened(HostChunk(sealed_memfd(size, "hbmd-host-chunk"), size))

    def export(self, arena: HostArena, chunk: HostChunk) -> int:
        return os.dup(chunk.fd)

    def release(self, arena: HostArena, chunk: HostChunk) -> None:
        self._release(chunk)

    def _release(self, chunk: HostChunk) -> None:
        try:
            punch_out(chunk.fd, chunk.size)
        finally:
            os.close(chunk.fd)
            with self._counting:
                self._open_chunks -= 1

    def idle(self, host_room: int, moving: bool) -> bool:
        """Tell the host pool's thread the room ``host_room`` leaves it, to fill or trim the pool to; nothing is left
        for the daemon's loop."""
        self._host_pool.idle(host_room, moving)
        return False

    def host_pool_bytes(self) -> int:
        return self._host_pool.bytes

    def close(self) -> None:
        self._host_pool.close()

    def close_arena(self, arena: HostArena) -> None:
        """Nothing to drop: the chunks were the buffer's only memory."""

    def free_bytes(self) -> int:
        return host_available_bytes()

    def parked_fd(self, arena: HostArena, chunk: HostChunk) -> int:
        return os.dup(chunk.fd)

    def adopt_arena(self, reserved_bytes: int, shareable: bool) -> HostArena:
        return HostArena()

    def adopt(self, arena: HostArena, offset: int, size: int, fd: int) -> HostChunk:
        # The parked FD is the memory itself: take it only if it is still the sealed chunk handed out.
        if not memfd.is_sealed_chunk(fd, size):
            raise InternalError(f"the FD parked for the chunk at {offset} is not a sealed memfd of {size} bytes")
        return self._opened(HostChunk(os.dup(fd), size))

    def accept(self, arena: HostArena, size: int, fd: int) -> HostChunk:
        """A chunk a client made: kept (a duplicate of its FD) if it is a sealed memfd of exactly ``size`` bytes,
        open for writing, as :func:`hbmd.memfd.sealed_memfd` makes them; ``InvalidRequest`` otherwise.

        Its pages were allocated by the client, and are charged to the
        client's cgroup; they are the budget's from now on all the same.
        """
        if not memfd.is_sealed_chunk(fd, size):
            raise InvalidRequest(f"a chunk the client made is not a sealed, writable memfd of {size} bytes")
        if not self._fds_left():
            raise out_of_fds(size)
        return self._opened(HostChunk(os.dup(fd), size))
