"""Host backend: real memory from memfd files, mapped by clients with ``mmap``.

Each buffer owns one sparse memfd twice as large as its reservation. A chunk
is a range of that file, backed with ``fallocate`` (so the pages are really
there, and counted, when the commit returns) and given back with
``FALLOC_FL_PUNCH_HOLE``. The daemon thus holds one FD per *buffer*, not per
chunk, and a 10,000-chunk buffer costs it one descriptor; each exported FD is
a ``dup`` of the buffer's memfd, closed as soon as it is sent.

A chunk for buffer offset ``o`` lives at file offset ``o`` of the first half,
or of the second half while the first is taken there: that is where a
defragment's new chunks go, beside the old ones whose data they copy.

The granule is 2 MiB rather than the 4 KiB page: it is the GPU granule, so a
buffer's chunk layout, its straddling granules and its sizes are the same on
both backends and the host tier tests what the GPU tier runs; it lets the
kernel back a chunk with transparent huge pages where shmem allows; and it
keeps chunk counts, and so mappings per commit, small.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import errno
import os

from hbmd.proto.errors import InternalError, OutOfDeviceMemory

from . import ParkableBackend

GRANULE = 2 << 20

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int


def fallocate(fd: int, mode: int, offset: int, size: int) -> None:
    """``fallocate(2)``; ``OSError`` on failure."""
    if _libc.fallocate(fd, mode, offset, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@dataclasses.dataclass
class HostArena:
    fd: int
    reserved: int
    taken: tuple[list[tuple[int, int]], list[tuple[int, int]]] = dataclasses.field(default_factory=lambda: ([], []))
    """Per half of the file, the sorted ``(start, end)`` buffer ranges of live chunks."""

    def is_free(self, half: int, start: int, end: int) -> bool:
        runs = self.taken[half]
        i = bisect.bisect_left(runs, end, key=lambda run: run[0])
        return i == 0 or runs[i - 1][1] <= start

    def take(self, half: int, start: int, end: int) -> None:
        bisect.insort(self.taken[half], (start, end))

    def give_back(self, half: int, start: int, end: int) -> None:
        runs = self.taken[half]
        del runs[bisect.bisect_left(runs, (start, end))]


@dataclasses.dataclass(frozen=True)
class HostChunk:
    file_offset: int
    size: int
    half: int


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

    def __init__(self) -> None:
        self.total_bytes = host_memory_bytes()

    def open_arena(self, reserved_bytes: int, shareable: bool) -> HostArena:
        fd = os.memfd_create("hbmd-buffer", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 2 * reserved_bytes)
        except BaseException:
            os.close(fd)
            raise
        return HostArena(fd, reserved_bytes)

    def create(self, arena: HostArena, offset: int, size: int) -> HostChunk:
        half = next((h for h in (0, 1) if arena.is_free(h, offset, offset + size)), None)
        if half is None:
            raise InternalError(f"buffer range at {offset} is already backed twice")
        file_offset = half * arena.reserved + offset
        try:
            fallocate(arena.fd, 0, file_offset, size)
        except OSError as exc:
            # A failed fallocate may leave part of the range allocated.
            fallocate(arena.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, file_offset, size)
            if exc.errno in (errno.ENOMEM, errno.ENOSPC):
                raise OutOfDeviceMemory(
                    f"host memory exhausted backing {size} bytes: {exc.strerror}",
                    requested=size,
                ) from None
            raise
        arena.take(half, offset, offset + size)
        return HostChunk(file_offset, size, half)

    def handle_offset(self, arena: HostArena, chunk: HostChunk) -> int:
        return chunk.file_offset

    def export(self, arena: HostArena, chunk: HostChunk) -> int:
        return os.dup(arena.fd)

    def release(self, arena: HostArena, chunk: HostChunk) -> None:
        fallocate(arena.fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, chunk.file_offset, chunk.size)
        start = chunk.file_offset - chunk.half * arena.reserved
        arena.give_back(chunk.half, start, start + chunk.size)

    def close_arena(self, arena: HostArena) -> None:
        os.close(arena.fd)

    def free_bytes(self) -> int:
        return host_available_bytes()

    parks_chunks = False  # the buffer's memfd holds every chunk

    def parked_fd(self, arena: HostArena, chunk: HostChunk | None) -> int:
        return os.dup(arena.fd)

    def adopt_arena(self, reserved_bytes: int, shareable: bool, fd: int | None) -> HostArena:
        if fd is None:
            raise InternalError("a host buffer cannot be adopted without its memfd")
        return HostArena(fd, reserved_bytes)

    def adopt(self, arena: HostArena, offset: int, size: int, handle_offset: int, fd: int | None) -> HostChunk:
        half = handle_offset // arena.reserved
        arena.take(half, offset, offset + size)
        return HostChunk(handle_offset, size, half)
