"""Host-side mapping: a ``PROT_NONE`` reservation filled with ``MAP_SHARED|MAP_FIXED`` chunk mappings."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from typing import Any

from hbmd import memfd
from hbmd.proto import ChunkInfo
from hbmd.proto.units import round_up

from .dlpack import KDL_CPU, uint8_view

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
_libc.mremap.restype = ctypes.c_void_p
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mprotect.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int

_MAP_FAILED = ctypes.c_void_p(-1).value
_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MADV_DONTFORK = 10
_RESERVE_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE


def _mmap(addr: int, size: int, prot: int, flags: int, fd: int, offset: int) -> int:
    result = _libc.mmap(addr or None, size, prot, flags, fd, offset)
    if result == _MAP_FAILED or result is None:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    return result


def _not_inherited(address: int, size: int) -> None:
    """Keep a chunk's mapping from the children this process forks (``MADV_DONTFORK``): one that outlived its parent
    would write pages the daemon may since have given to another process (a graft of the orphan its parent left,
    issue #61), and the daemon knows nothing of it. The child finds the range unmapped: a touch faults."""
    if _libc.madvise(address, size, _MADV_DONTFORK) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise of {size} bytes failed: {os.strerror(err)}")


class HostMapper:
    """Maps host-backend chunks (memfd ranges) into one reserved address range per buffer."""

    kind = "cpu"

    def __init__(self, granularity: int) -> None:
        self.granularity = granularity

    def reserve(self, size: int) -> int:
        """An inaccessible, granule-aligned address range of ``size`` bytes."""
        span = size + self.granularity
        raw = _mmap(0, span, _PROT_NONE, _RESERVE_FLAGS, -1, 0)
        base = round_up(raw, self.granularity)
        # Trim the alignment slack so that exactly [base, base + size) stays reserved.
        if base > raw:
            _libc.munmap(raw, base - raw)
        if raw + span > base + size:
            _libc.munmap(base + size, raw + span - base - size)
        return base

    def map(self, address: int, chunk: ChunkInfo, fd: int, readonly: bool = False) -> None:
        """Map ``chunk`` (from its FD) at ``address``; ``readonly`` without ``PROT_WRITE``, so a write is a SIGSEGV."""
        self.map_prepared(address, chunk, fd, readonly)

    def prepare(self, fd: int) -> int:
        """A copy of the chunk's FD: a memfd needs no import."""
        return os.dup(fd)

    def map_prepared(self, address: int, chunk: ChunkInfo, prepared: int, readonly: bool = False) -> None:
        _mmap(
            address,
            chunk.size,
            mmap.PROT_READ if readonly else mmap.PROT_READ | mmap.PROT_WRITE,
            mmap.MAP_SHARED | _MAP_FIXED,
            prepared,
            0,
        )
        _not_inherited(address, chunk.size)

    def discard(self, prepared: int) -> None:
        os.close(prepared)

    def beside_capture(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def make(self, size: int) -> int:
        """A sealed memfd of ``size`` bytes, every page allocated, as the daemon's own chunks."""
        return memfd.sealed_memfd(size)

    def export(self, prepared: int) -> int:
        return os.dup(prepared)

    def alias(self, source: int, size: int, destination: int) -> None:
        """A second mapping of the same shared pages: ``mremap`` of a shared mapping with no old size duplicates it."""
        result = _libc.mremap(source, 0, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, destination)
        if result == _MAP_FAILED or result is None:
            err = ctypes.get_errno()
            raise OSError(err, f"mremap of {size} bytes failed: {os.strerror(err)}")
        _not_inherited(destination, size)

    def unmap(self, address: int, size: int) -> None:
        """Put the range back to reserved-but-inaccessible, atomically."""
        _mmap(address, size, _PROT_NONE, _RESERVE_FLAGS | _MAP_FIXED, -1, 0)

    def protect(self, address: int, size: int) -> None:
        """Drop ``PROT_WRITE`` from a mapped range: a write is a SIGSEGV from now on."""
        if _libc.mprotect(address, size, mmap.PROT_READ) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mprotect of {size} bytes failed: {os.strerror(err)}")

    def copy(self, destination: int, source: int, size: int) -> None:
        ctypes.memmove(destination, source, size)

    def zero(self, address: int, size: int) -> None:
        ctypes.memset(address, 0, size)

    def unreserve(self, base: int, size: int) -> None:
        _libc.munmap(base, size)

    def view(self, base: int, size: int, owner: Any = None) -> Any:
        return uint8_view(base, size, KDL_CPU, 0, owner)

    def synchronize(self) -> None:
        """Host writes are visible at once; nothing to wait for."""
