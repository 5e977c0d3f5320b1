"""The daemon's file descriptors: how many it may use, and the room it keeps free.

Every chunk on the host backend, every session's handle socket and every
control-plane connection costs the daemon a descriptor. Running out is worse
than refusing a request: nothing more can be accepted or created. So the
daemon refuses new chunks and new sessions while fewer than :func:`headroom`
descriptors are left, and keeps that room for the control connections, which
it accepts as they come (out of descriptors, it pauses accepting them).
"""

from __future__ import annotations

import os
import resource

MIN_HEADROOM = 64


def limit() -> int:
    """The soft ``RLIMIT_NOFILE`` (``hbmd`` lifts it to the hard one at start)."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def headroom(fd_limit: int) -> int:
    """Descriptors kept free: an eighth of the limit, at least :data:`MIN_HEADROOM`."""
    return max(MIN_HEADROOM, fd_limit // 8)


def usable() -> int:
    """Descriptors the daemon may hold before it refuses what would cost more."""
    fd_limit = limit()
    return fd_limit - headroom(fd_limit)


def open_count() -> int:
    """Descriptors open in this process now (a directory listing: for occasional checks, not per chunk)."""
    return len(os.listdir("/proc/self/fd")) - 1  # less the one listing it
