"""The ``Mapper`` protocol: how a client maps a daemon's chunks into its own address space.

Two implementations, one per backend: :class:`hbmd.client.host.HostMapper`
(``mmap`` of memfd chunks) and :class:`hbmd.client.cuda.CudaMapper` (CUDA
VMM import, map and access). :class:`hbmd.client.tensor.ExtensibleTensor`
speaks only this protocol.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

from hbmd.proto import ChunkInfo


class Mapper(Protocol):
    kind: str
    """``"cpu"`` or ``"cuda"``: the torch device type of the views."""
    granularity: int

    def reserve(self, size: int) -> int:
        """An inaccessible, granule-aligned address range of ``size`` bytes; returns its base."""
        ...

    def map(self, address: int, chunk: ChunkInfo, fd: int, readonly: bool = False) -> None:
        """Map ``chunk`` from its FD at ``address`` (the caller closes the FD); undoes itself on failure.

        ``readonly``: a write through the mapping faults (SIGSEGV on the host,
        an illegal-address error on a GPU) instead of changing shared bytes.
        """
        ...

    def prepare(self, fd: int) -> Any:
        """Import a chunk from its FD ahead of mapping it (a leased granule); the caller closes the FD.

        What comes back is what :meth:`map_prepared` maps, and :meth:`discard`
        lets go of once mapped or no longer wanted.
        """
        ...

    def map_prepared(self, address: int, chunk: ChunkInfo, prepared: Any, readonly: bool = False) -> None:
        """Map a chunk imported with :meth:`prepare` at ``address``, as :meth:`map` would; undoes itself on failure."""
        ...

    def discard(self, prepared: Any) -> None:
        """Let go of what :meth:`prepare` returned (a mapping made from it stays)."""
        ...

    def beside_capture(self) -> AbstractContextManager[None]:
        """A scope for making, importing and letting go of chunks on a thread of the client's own (the listener)
        without failing a CUDA graph the engine captures meanwhile."""
        ...

    def make(self, size: int) -> Any:
        """A new chunk of ``size`` bytes made in this process, as the daemon makes them (a commit on credit), ready
        for :meth:`map_prepared`, :meth:`export` and :meth:`discard`; raises ``OutOfDeviceMemory`` when short."""
        ...

    def export(self, prepared: Any) -> int:
        """A new FD of a chunk :meth:`make` made, for the daemon (the caller closes it)."""
        ...

    def alias(self, source: int, size: int, destination: int) -> None:
        """Map the chunk mapped whole at ``[source, source + size)`` at ``destination`` too, read-write, with no copy
        (the memory lives until both are unmapped); undoes itself on failure."""
        ...

    def unmap(self, address: int, size: int) -> None:
        """Put the range back to reserved and inaccessible."""
        ...

    def protect(self, address: int, size: int) -> None:
        """Make a mapped range read-only, as ``map(..., readonly=True)`` would have mapped it."""
        ...

    def unreserve(self, base: int, size: int) -> None:
        ...

    def copy(self, destination: int, source: int, size: int) -> None:
        """Copy bytes; :meth:`synchronize` waits for it (copies are done in the order they were asked for)."""
        ...

    def zero(self, address: int, size: int) -> None:
        """Zero bytes; :meth:`synchronize` waits for it."""
        ...

    def synchronize(self) -> None:
        """Wait for all work on the memory this mapper maps."""
        ...

    def view(self, base: int, size: int, owner: Any = None) -> Any:
        """A ``torch.uint8`` tensor over ``size`` bytes at ``base`` that keeps ``owner`` alive while it lives."""
        ...
