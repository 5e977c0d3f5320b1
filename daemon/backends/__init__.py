"""Memory backends: where the daemon's physical chunks come from.

A backend creates, exports and releases chunks; it knows nothing of sessions,
budgets or sockets. Each backend lives in its own module behind these two
small interfaces, so the state and the server are the same for host and GPU
memory: :class:`Backend`, generic over its per-buffer *arena* and its
*chunk* types, and :class:`ParkableBackend`, what persistence across a
restart needs on top.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, cast

from hbmd.proto import TIER_DEVICE

A = TypeVar("A")
"""A backend's per-buffer state (its arena)."""
C = TypeVar("C")
"""A backend's chunk handle."""


class Backend(Protocol[A, C]):
    """One device's (or the host's) physical memory."""

    name: str
    """``"host"`` or ``"cuda"``: what clients must map."""
    instance: str
    """Instance directory name: ``host`` or ``gpu<N>``."""
    granularity: int
    """Bytes per granule; every chunk is a whole number of granules."""
    total_bytes: int
    """Physical memory the backend serves, for the default budget."""
    device_uuid: str = ""
    device_index: int = -1
    host_piece: int
    """Bytes of the host-tier pieces its pool makes ahead (see ``pool.py``): demotes are cut into them."""

    def open_arena(self, reserved_bytes: int, shareable: bool) -> A:
        """Per-buffer backend state, made when a buffer is created."""
        ...

    def create(self, arena: A, offset: int, size: int, tier: str = TIER_DEVICE) -> C:
        """Back ``size`` bytes at ``offset`` of the buffer with memory of ``tier``; returns a chunk handle.

        Raises ``OutOfDeviceMemory`` when the memory is not there.
        """
        ...

    def export(self, arena: A, chunk: C) -> int:
        """A new file descriptor for the chunk; the caller closes it once sent."""
        ...

    def accept(self, arena: A, size: int, fd: int) -> C:
        """Take a chunk of ``size`` bytes a client made (within its credit) from its FD, which the caller closes: kept
        as this backend's own once shown to be its kind of memory, of exactly that size; ``InvalidRequest``
        otherwise."""
        ...

    def release(self, arena: A, chunk: C) -> None:
        """Return the chunk's memory; must not fail for a chunk that was created."""
        ...

    def close_arena(self, arena: A) -> None:
        """Drop the per-buffer state once its last chunk is released."""
        ...

    def free_bytes(self) -> int:
        """Memory free on the device right now, as its driver or kernel reports it."""
        ...

    def held_back_bytes(self) -> int:
        """Device memory the backend keeps for itself (a warm pool), taken out of the budget."""
        return 0

    def idle(self, host_room: int, moving: bool) -> bool:
        """A little background work while no request waits (warm pools; the host pool within ``host_room`` bytes,
        paused while a move is ``moving``); True while more remains."""
        return False

    def host_pool_bytes(self) -> int:
        """Host-tier memory made ahead of demotes."""
        return 0

    def close(self) -> None:
        """Release the backend itself at shutdown."""


class ParkableBackend(Backend[A, C], Protocol[A, C]):
    """A backend whose memory can be parked with the service manager across restarts (``daemon/restart/persist.py``)."""

    def parked_fd(self, arena: A, chunk: C) -> int:
        """A new FD keeping ``chunk`` alive (each chunk is parked on its own); the caller closes it."""
        ...

    def adopt_arena(self, reserved_bytes: int, shareable: bool) -> A:
        """Rebuild a buffer's backend state after a restart."""
        ...

    def adopt(self, arena: A, offset: int, size: int, fd: int) -> C:
        """Rebuild a chunk handle after a restart from its parked FD (which the caller closes)."""
        ...


def parkable(backend: Backend[A, C]) -> ParkableBackend[A, C]:
    """``backend`` as a restart needs it: both of hbmd's backends, host and CUDA, are parkable, and only they are
    journaled (``daemon/main.py`` wires the persistence)."""
    return cast("ParkableBackend[A, C]", backend)
