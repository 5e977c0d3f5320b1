"""Sealed memfds: the host backend's chunks, made by the daemon or, within a credit, by a client.

A chunk is a memfd of exactly its size, every page allocated with
``fallocate`` (so the bytes are really there, and counted, once it exists) and
sealed with ``F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL``: nobody holding an FD
of it can grow it, shrink it (which would fault every mapping past the new
end) or change its seals.
"""

from __future__ import annotations

import errno
import fcntl
import os

from hbmd.proto.errors import OutOfDeviceMemory
from hbmd.proto.undo import Undo
from hbmd.proto.units import format_bytes

SEALS = fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
"""A chunk's size is fixed for good: no grow, no shrink, and no seal may be added (or taken) by anyone."""


def sealed_memfd(size: int, name: str = "hbmd-chunk") -> int:
    """A new memfd of exactly ``size`` allocated bytes, sealed; ``OutOfDeviceMemory`` when memory is short, ``OSError``
    (``EMFILE``...) when no descriptor is left."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    with Undo() as undo:
        undo.push(os.close, fd)
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOMEM, errno.ENOSPC):
                raise OutOfDeviceMemory(
                    f"host memory exhausted backing {format_bytes(size)}: {exc.strerror}", requested=size
                ) from None
            raise
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


def is_sealed_chunk(fd: int, size: int) -> bool:
    """Whether ``fd`` is a chunk as :func:`sealed_memfd` makes them, of ``size`` bytes, open for reading and writing."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        stat = os.fstat(fd)
    except OSError:
        return False  # not a memfd (F_GET_SEALS: EINVAL), or not a descriptor at all
    return seals & SEALS == SEALS and stat.st_size == size and flags & os.O_ACCMODE == os.O_RDWR
