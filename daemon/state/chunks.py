"""Chunks: where the state meets the backend to make and release physical memory.

Buffers and leases both take their chunks from here, so chunk ids are unique
across the instance and a release that fails is handled one way.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, Protocol

from hbmd.proto import TIER_DEVICE, TIER_HOST
from hbmd.proto.errors import HbmdError
from hbmd.proto.undo import Undo

from ..backends import A, Backend, C
from .records import Chunk

log = logging.getLogger("hbmd.state")


class FdStore(Protocol):
    """The service manager's file-descriptor store, which keeps chunks alive across a restart of the daemon
    (``daemon/restart/persist.py``): told of each chunk made and released."""

    def made(self, chunk: Chunk[Any], arena: Any) -> None: ...

    def released(self, chunk: Chunk[Any]) -> None: ...


class Chunks(Generic[A, C]):
    """Makes chunks with the backend and gives them ids; releases them."""

    def __init__(self, backend: Backend[A, C]) -> None:
        self.backend = backend
        self.next_id = 1
        self.fd_store: FdStore | None = None

    def make(self, arena: A, offset: int, size: int, tier: str = TIER_DEVICE) -> Chunk[C]:
        """One chunk of ``size`` bytes at ``offset`` in ``tier``; raises as the backend does
        (``OutOfDeviceMemory``...)."""
        chunk = Chunk(self.next_id, offset, size, self.backend.create(arena, offset, size, tier), tier=tier)
        self.next_id += 1
        if self.fd_store is not None:
            self.fd_store.made(chunk, arena)
        return chunk

    def accept(self, arena: A, offset: int, size: int, fd: int) -> Chunk[C]:
        """The chunk of ``size`` bytes at ``offset`` a client made, from its FD (the backend checks it, and raises
        ``InvalidRequest`` where it is not what it claims); from now on as if made here."""
        chunk = Chunk(self.next_id, offset, size, self.backend.accept(arena, size, fd))
        self.next_id += 1
        if self.fd_store is not None:
            self.fd_store.made(chunk, arena)
        return chunk

    def take_id(self) -> int:
        """An id for a chunk the backend did not make (one a client declares it still maps)."""
        self.next_id += 1
        return self.next_id - 1

    def make_runs(self, arena: A, runs: list[tuple[int, int]], tier: str = TIER_DEVICE) -> list[Chunk[C]]:
        """One chunk per ``(start, end)`` run, in order; none on any failure.

        In the host tier a run is made of pieces of the backend's
        ``host_piece`` bytes (and a shorter last one), the size its pool
        makes ahead of need: creating pinned host memory is slow.
        """
        if tier == TIER_HOST:
            piece = self.backend.host_piece
            runs = [(at, min(at + piece, end)) for start, end in runs for at in range(start, end, piece)]
        created: list[Chunk[C]] = []
        with Undo() as undo:
            for start, end in runs:
                chunk = self.make(arena, start, end - start, tier)
                undo.push(self.release, chunk, arena)
                created.append(chunk)
        return created

    def adopted(self, chunks: list[Chunk[C]]) -> None:
        """Chunks rebuilt after a restart keep their ids: new ones come after them."""
        self.next_id = max([self.next_id] + [c.chunk_id + 1 for c in chunks])

    def release(self, chunk: Chunk[C], arena: A) -> None:
        """Give the chunk's memory back; never raises (a queued export of it is cancelled by ``live``)."""
        chunk.live = False
        if chunk.handle is None:
            return  # held by the processes that map it: their unmapping frees it
        if self.fd_store is not None:
            self.fd_store.released(chunk)
        try:
            self.backend.release(arena, chunk.handle)
        except (HbmdError, OSError):
            # The memory is lost to this process until exit, but the state stays consistent.
            log.exception("releasing chunk %d failed", chunk.chunk_id)

    def release_all(self, chunks: list[Chunk[C]], arena: A) -> int:
        """Release every chunk of ``chunks``; returns their bytes."""
        for chunk in chunks:
            self.release(chunk, arena)
        return sum(c.size for c in chunks)
