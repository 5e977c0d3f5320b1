"""One buffer's address range in this process, and the chunks mapped into it.

:class:`~hbmd.client.tensor.ExtensibleTensor` keeps the daemon's record of a
buffer (its segments, sizes and chunks) and asks the daemon for changes; a
:class:`Reservation` is this process's side of it: where each chunk is
mapped, through the backend's :class:`~hbmd.client.mapper.Mapper`.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from hbmd.proto import ChunkInfo
from hbmd.proto.undo import Undo

from .delivery import Delivery
from .lease import LeasedGranule
from .mapper import Mapper


class Reservation:
    """One buffer's address range in this process and the chunks mapped in it.

    The range goes back to the system only once :meth:`free` was called
    *and* no view of it is left (views hold their reservation): a view that
    outlives :meth:`ExtensibleTensor.free` then points at an inaccessible
    range that nothing else can be placed in, so touching it faults (SIGSEGV
    on the host, an illegal-address error on a GPU) instead of reading or
    writing someone else's memory.
    """

    def __init__(self, mapper: Mapper, size: int) -> None:
        self.freed = False
        self.mapper = mapper
        self.size = size
        self.base = mapper.reserve(size)
        self.mapped: list[tuple[int, int]] = []
        """``(offset, size)`` of every chunk mapped now, in the order they were mapped."""
        self.changes = 0
        """Mappings made and ranges unmapped so far: equal before and after a step, the step left the range as it was
        (a copy of ``mapped`` would tell as much, at a cost that grows with the chunks)."""

    def map(self, chunk: ChunkInfo, fd: int, readonly: bool) -> None:
        """Map ``chunk`` from its FD at its offset (the caller closes the FD)."""
        self.mapper.map(self.base + chunk.offset, chunk, fd, readonly)
        self.mapped.append((chunk.offset, chunk.size))
        self.changes += 1

    def map_all(self, delivery: Delivery, readonly: bool) -> None:
        """Map every chunk the delivery brings, at its offset."""
        for chunk, fd in delivery:
            self.map(chunk, fd, readonly)

    def map_leased(self, taken: list[LeasedGranule], offsets: list[int]) -> None:
        """Map each leased granule at its offset (the caller discards the imports afterwards)."""
        granule = self.mapper.granularity
        for leased, offset in zip(taken, offsets):
            self._map_prepared(ChunkInfo(leased.chunk_id, offset, granule, 0), leased.prepared)

    def map_made(self, made: list[Any], runs: list[tuple[int, int]]) -> None:
        """Map each chunk made here (:meth:`Mapper.make`) at its run's ``(offset, size)`` (the caller discards them
        afterwards)."""
        for prepared, (offset, size) in zip(made, runs):
            self._map_prepared(ChunkInfo(0, offset, size, 0), prepared)

    def _map_prepared(self, chunk: ChunkInfo, prepared: Any) -> None:
        self.mapper.map_prepared(self.base + chunk.offset, chunk, prepared)
        self.mapped.append((chunk.offset, chunk.size))
        self.changes += 1

    def copy_into(self, chunks: list[tuple[ChunkInfo, int]]) -> None:
        """Copy the bytes mapped at each chunk's offset into the chunk itself, mapped for it in one scratch range.

        Every copy is queued before the one wait, so that a move of many
        chunks runs at the copy engine's pace rather than a round trip each.
        """
        with self._scratch(sum(chunk.size for chunk, _ in chunks)) as (at, mapped):
            self.mapper.synchronize()  # the bytes to copy are final: nothing may still be writing them
            for chunk, fd in chunks:
                self.mapper.map(at, chunk, fd)
                mapped.append((at, chunk.size))
                self.mapper.copy(at, self.base + chunk.offset, chunk.size)
                at += chunk.size
            self.mapper.synchronize()

    def move_into(self, chunks: list[tuple[ChunkInfo, int]]) -> None:
        """Re-back the range with ``chunks``, each mapped once, at its offset, and the bytes copied there from the old
        chunks, mapped again (with no copy) in a scratch range.

        What a demote does: mapping host-tier memory is what costs (access is
        set page by page), so the new chunks are mapped where they stay, and
        each one's copy runs while the next is being mapped. Where a step
        fails the new chunks are unmapped and the old ones mapped back in
        place: the range is as it was.
        """
        old = list(self.mapped)
        with self._scratch(max(offset + size for offset, size in old)) as (scratch, aliased):
            self.mapper.synchronize()  # the bytes to copy are final: nothing may still be writing them
            for offset, size in old:
                self.mapper.alias(self.base + offset, size, scratch + offset)
                aliased.append((scratch + offset, size))
            with Undo() as undo:
                undo.push(self._map_back, old, scratch)
                self.unmap_all()
                for chunk, fd in chunks:
                    self.map(chunk, fd, readonly=False)
                    self.mapper.copy(self.base + chunk.offset, scratch + chunk.offset, chunk.size)
                self.mapper.synchronize()

    @contextlib.contextmanager
    def _scratch(self, size: int) -> Iterator[tuple[int, list[tuple[int, int]]]]:
        """A scratch range of ``size`` bytes for the block, and a list for the ``(address, size)`` of what the block
        maps in it: unmapped, and the range given back, when the block ends."""
        scratch = self.mapper.reserve(size)
        mapped: list[tuple[int, int]] = []
        try:
            yield scratch, mapped
        finally:
            for address, length in mapped:
                self.mapper.unmap(address, length)
            self.mapper.unreserve(scratch, size)

    def _map_back(self, old: list[tuple[int, int]], scratch: int) -> None:
        """Undo a :meth:`move_into`: unmap the new chunks and map the old ones in place again from their aliases."""
        self.unmap_all()
        for offset, size in old:
            self.mapper.alias(scratch + offset, size, self.base + offset)
            self.mapped.append((offset, size))
        self.changes += 1

    def protect(self) -> None:
        """Make every mapped chunk read-only."""
        for offset, size in self.mapped:
            self.mapper.protect(self.base + offset, size)

    def in_one_chunk(self, start: int, size: int) -> bool:
        """Whether ``size`` bytes from offset ``start`` lie inside one mapped chunk."""
        return any(offset <= start and start + size <= offset + length for offset, length in self.mapped)

    def unmap_all(self) -> None:
        """Put the whole range back to reserved and inaccessible, once the work on it is done."""
        self.mapper.synchronize()
        for offset, size in self.mapped:
            self.mapper.unmap(self.base + offset, size)
        if self.mapped:
            self.mapped = []
            self.changes += 1

    def unmap_runs(self, runs: list[tuple[int, int]]) -> None:
        """Unmap the chunks mapped at these ``(offset, size)`` runs, those mapped of them (a growth taken back), once
        the work on them is done."""
        self.mapper.synchronize()
        for run in runs:
            if run in self.mapped:
                self.mapper.unmap(self.base + run[0], run[1])
                self.mapped.remove(run)
                self.changes += 1

    def free(self) -> None:
        """Unmap everything; the range goes back once no view of it is left."""
        self.unmap_all()
        self.freed = True

    def __del__(self) -> None:
        if self.freed and not sys.is_finalizing():
            self.mapper.unreserve(self.base, self.size)
