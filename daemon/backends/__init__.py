"""Memory backends: where the daemon's physical chunks come from.

A backend creates, exports and releases chunks; it knows nothing of sessions,
budgets or sockets. Each backend lives in its own module behind this one
interface, so the state and the server are the same for host and GPU memory.
"""

from __future__ import annotations

import abc
from typing import Any


class Backend(abc.ABC):
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

    @abc.abstractmethod
    def open_arena(self, reserved_bytes: int, shareable: bool) -> Any:
        """Per-buffer backend state, made when a buffer is created."""

    @abc.abstractmethod
    def create(self, arena: Any, offset: int, size: int) -> Any:
        """Back ``size`` bytes at ``offset`` of the buffer; returns a chunk handle.

        Raises ``OutOfDeviceMemory`` when the memory is not there.
        """

    @abc.abstractmethod
    def handle_offset(self, arena: Any, chunk: Any) -> int:
        """Where the chunk's mapping starts inside its exported handle."""

    @abc.abstractmethod
    def export(self, arena: Any, chunk: Any) -> int:
        """A new file descriptor for the chunk; the caller closes it once sent."""

    @abc.abstractmethod
    def release(self, arena: Any, chunk: Any) -> None:
        """Return the chunk's memory; must not fail for a chunk that was created."""

    @abc.abstractmethod
    def close_arena(self, arena: Any) -> None:
        """Drop the per-buffer state once its last chunk is released."""

    # Parking memory with the service manager across restarts (see daemon/persist.py).

    parks_chunks: bool
    """True: one FD per chunk keeps the memory alive; False: one FD per buffer (its arena) does."""

    @abc.abstractmethod
    def parked_fd(self, arena: Any, chunk: Any | None) -> int:
        """A new FD keeping ``chunk`` (or, with None, the whole arena) alive; the caller closes it."""

    @abc.abstractmethod
    def adopt_arena(self, reserved_bytes: int, shareable: bool, fd: int | None) -> Any:
        """Rebuild a buffer's backend state after a restart (taking ownership of ``fd``)."""

    @abc.abstractmethod
    def adopt(self, arena: Any, offset: int, size: int, handle_offset: int, fd: int | None) -> Any:
        """Rebuild a chunk handle after a restart from its parked FD (which the caller closes)."""

    @abc.abstractmethod
    def free_bytes(self) -> int:
        """Memory free on the device right now, as its driver or kernel reports it."""

    def held_back_bytes(self) -> int:
        """Device memory the backend keeps for itself (a warm pool), taken out of the budget."""
        return 0

    def idle(self) -> bool:
        """A little background work while no request waits; True while more remains."""
        return False

    def close(self) -> None:
        """Release the backend itself at shutdown."""
