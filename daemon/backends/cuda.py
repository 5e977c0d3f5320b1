"""CUDA backend: chunks are ``cuMemCreate`` allocations exported as POSIX FDs.

The daemon calls ``cuInit`` and nothing that needs a context, so it holds no
CUDA context and costs no GPU memory of its own. It keeps each chunk's
allocation handle (not an FD): exported FDs are closed as soon as they are
sent, so a 10,000-chunk buffer costs no descriptors.

The host tier is host-NUMA memory (``CU_MEM_LOCATION_TYPE_HOST_NUMA``, on the
node nearest the GPU), made and exported as POSIX FDs with no context just
like device chunks, and mapped by clients at the same addresses with device
access (SPEC, "host-NUMA VMM memory").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Any

from hbmd import driver
from hbmd.driver import nvml
from hbmd.proto import TIER_DEVICE, TIER_HOST
from hbmd.proto.errors import DriverError, InvalidRequest
from hbmd.proto.instance import gpu_instance
from hbmd.proto.undo import Undo

from ..clock import Clock
from . import ParkableBackend
from .pool import HOST_PIECE, HostPool

log = logging.getLogger("hbmd.cuda")


@dataclasses.dataclass
class CudaChunk:
    """One ``cuMemCreate`` allocation, and an exported FD of it where the daemon holds one.

    A chunk restored after a restart has no handle: its parked FD is what
    keeps it alive, and a handle imported from that FD could not be
    exported again (the driver answers CUDA_ERROR_INVALID_VALUE, seen on the
    H200), so every export is a duplicate of the FD. A warm chunk, created
    and exported while the daemon was idle, gives its ready FD to its first
    export and is exported anew after that; so does a host-tier piece of the
    host pool.
    """

    handle: Any | None
    fd: int = -1
    host_bytes: int = 0
    """The size of a chunk of host-NUMA memory (the host tier); 0 for the device's."""

    def export(self) -> int:
        if self.handle is None:
            return os.dup(self.fd)
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            return fd
        return driver.export_fd(self.handle)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.handle is not None:
            driver.release(self.handle)


@dataclasses.dataclass
class CudaArena:
    rdma: bool
    """Whether this buffer's chunks are GPU-direct-RDMA capable."""


class CudaBackend(ParkableBackend[CudaArena, CudaChunk]):
    """One GPU's memory. ``warm_chunks`` granules are kept created and exported ahead of time.

    The export sentinel: the driver exports and closes a POSIX FD an order of
    magnitude faster while any exported FD is open anywhere on the machine
    than while none is (``bench/export_probe.py`` measures both). So the
    daemon keeps one exported granule's FD open for its whole life, taken out
    of the budget like the warm pool, and every export and every client's
    close on the node take the fast path from the first commit on
    (``export_sentinel=False`` turns it off, for measuring).

    Exporting a POSIX FD costs about as much as everything else in a small
    commit, so single-granule runs, the common case
    of block-by-block growth, take a warm chunk when one is there; the
    server tops the pool up while idle (the host pool fills on a thread of its own).
    """

    name = "cuda"

    def __init__(self, index: int, warm_chunks: int = 0, export_sentinel: bool = True, host_pool_bytes: int = 0,
                 host_piece: int = HOST_PIECE, clock: Clock | None = None) -> None:
        """``host_pool_bytes``: host-NUMA pieces of ``host_piece`` bytes kept made ahead of demotes (``pool.py``), by
        ``clock`` (the daemon's)."""
        self.warm_target = warm_chunks
        self._warm: list[CudaChunk] = []
        driver.pin_device_order()
        driver.init()
        count = driver.device_count()
        if not 0 <= index < count:
            raise driver.CudaUnavailable(f"no GPU {index}: this node has {count}")
        self.device_index = index
        self.instance = gpu_instance(index)
        self.device_uuid = driver.device_uuid(index)
        # NVML takes a few hundred ms to start: while the daemon starts (restores, takes over, binds), not at the
        # first status, which every client resuming after a restart sends.
        self._nvml_started = threading.Thread(target=self._nvml_free_bytes, name="hbmd-nvml", daemon=True)
        self._nvml_started.start()
        self.device_name = driver.device_name(index)
        self.total_bytes = driver.total_memory(index)
        self.granularity = driver.granularity(index)
        self._rdma_refused = False
        self._scratch = (0, 0)
        """The address and size of the range :meth:`accept` checks clients' chunks in (none yet)."""
        # Prove POSIX-FD allocations work here before serving anyone; the proof may stay as the sentinel.
        probe = CudaChunk(driver.create(index, self.granularity, rdma=False))
        with Undo() as undo:
            undo.push(probe.release)
            probe.fd = driver.export_fd(probe.handle)
        self._sentinel: CudaChunk | None = probe
        if not export_sentinel:
            self._sentinel = None
            probe.release()
        self.host_numa_node = driver.host_numa_node(index)
        self.host_piece = host_piece
        self._host_pool: HostPool[CudaChunk] = HostPool(
            host_piece, host_pool_bytes, self._make_host, CudaChunk.release, clock=clock)

    def _make_host(self, size: int) -> CudaChunk:
        """A host-NUMA chunk, exported as it is made: its demote then costs no driver call."""
        chunk = CudaChunk(driver.create_host(self.host_numa_node, size), host_bytes=size)
        with Undo() as undo:
            undo.push(chunk.release)
            chunk.fd = driver.export_fd(chunk.handle)
        return chunk

    def check_host_tier(self) -> None:
        """Refuse, with ``DriverError``, a host tier this driver cannot serve: host-NUMA memory whose granule does not
        divide the device's, or pieces that are not whole device granules (chunks are)."""
        host_granule = driver.host_granularity(self.host_numa_node)
        if self.granularity % host_granule or self.host_piece % self.granularity:
            raise DriverError(
                f"host-NUMA granularity {host_granule} and pieces of {self.host_piece} bytes do not fit the device's "
                f"granule of {self.granularity}",
                function="cuMemGetAllocationGranularity", result="CUDA_ERROR_NOT_SUPPORTED",
            )

    def open_arena(self, reserved_bytes: int, shareable: bool) -> CudaArena:
        return CudaArena(rdma=shareable and not self._rdma_refused)

    def create(self, arena: CudaArena, offset: int, size: int, tier: str = TIER_DEVICE) -> CudaChunk:
        if tier == TIER_HOST:
            return self._host_pool.take(size)
        if size == self.granularity and not arena.rdma and self._warm:
            return self._warm.pop()
        if arena.rdma:
            try:
                return CudaChunk(driver.create(self.device_index, size, rdma=True))
            except DriverError as exc:
                # Some systems refuse RDMA-capable allocations; the buffer still works without.
                log.warning("GPU %d refuses RDMA-capable allocations (%s); shareable buffers fall back to plain ones",
                            self.device_index, exc.result)
                self._rdma_refused = True
                arena.rdma = False
        return CudaChunk(driver.create(self.device_index, size, rdma=False))

    def export(self, arena: CudaArena, chunk: CudaChunk) -> int:
        return chunk.export()

    def release(self, arena: CudaArena, chunk: CudaChunk) -> None:
        """A host-tier chunk goes to the host pool's thread: unpinning its pages is slow."""
        if chunk.host_bytes:
            self._host_pool.give_back(chunk, chunk.host_bytes)
        else:
            chunk.release()

    def close_arena(self, arena: CudaArena) -> None:
        """Nothing per buffer to drop: each chunk is its own allocation."""

    def parked_fd(self, arena: CudaArena, chunk: CudaChunk) -> int:
        """An FD for the service manager; the chunk keeps a copy for its first export to a client, so that one driver
        export serves both (a chunk is parked as it is made, and its client asks for it at once)."""
        fd = chunk.export()
        if chunk.handle is not None and chunk.fd < 0:
            chunk.fd = os.dup(fd)
        return fd

    def adopt_arena(self, reserved_bytes: int, shareable: bool) -> CudaArena:
        return CudaArena(rdma=shareable and not self._rdma_refused)

    def adopt(self, arena: CudaArena, offset: int, size: int, fd: int) -> CudaChunk:
        """Keep (a duplicate of) the parked FD: one descriptor per restored chunk, no driver call, no context."""
        return CudaChunk(None, os.dup(fd))

    def accept(self, arena: CudaArena, size: int, fd: int) -> CudaChunk:
        """A chunk a client made: kept as a duplicate of its FD (as a restored chunk is) once the driver shows it is
        plain memory of this GPU of exactly ``size`` bytes; ``InvalidRequest`` otherwise.

        The check imports the FD, reads the allocation's properties and maps
        it in a scratch range of the daemon's (no context needed), then lets
        the import go, while the client waits for its zeroing.
        """
        try:
            handle = driver.import_fd(fd)
        except DriverError as exc:
            raise InvalidRequest(f"a chunk the client made is not a CUDA allocation ({exc.result})") from None
        try:
            fits = driver.is_plain_device_memory(handle, self.device_index) and driver.spans_exactly(
                handle, size, self.granularity, self._scratch_for(size))
        finally:
            driver.release(handle)
        if not fits:
            raise InvalidRequest(f"a chunk the client made is not plain memory of GPU {self.device_index} of exactly "
                                 f"{size} bytes")
        return CudaChunk(None, os.dup(fd))

    def _scratch_for(self, size: int) -> int:
        """A reserved range of ``size`` bytes and a granule more, to check a client's chunk in; kept, and grown as
        larger chunks come."""
        needed = size + self.granularity
        if self._scratch[1] < needed:
            if self._scratch[1]:
                driver.unreserve(*self._scratch)
                self._scratch = (0, 0)
            self._scratch = (driver.reserve(needed, self.granularity), needed)
        return self._scratch[0]

    def held_back_bytes(self) -> int:
        """The warm pool and the export sentinel: device memory the daemon holds for itself."""
        return (self.warm_target + (self._sentinel is not None)) * self.granularity

    def idle(self, host_room: int, moving: bool) -> bool:
        """Create and export one warm chunk if the pool is short (True while it still is), and tell the host pool's
        thread the room ``host_room`` leaves it."""
        self._host_pool.idle(host_room, moving)
        if len(self._warm) >= self.warm_target:
            return False
        handle = driver.create(self.device_index, self.granularity, rdma=False)
        with Undo() as undo:
            undo.push(driver.release, handle)
            fd = driver.export_fd(handle)
        self._warm.append(CudaChunk(handle, fd))
        return len(self._warm) < self.warm_target

    def host_pool_bytes(self) -> int:
        return self._host_pool.bytes

    def close(self) -> None:
        self._host_pool.close()
        if self._scratch[1]:
            driver.unreserve(*self._scratch)
        while self._warm:
            self._warm.pop().release()
        if self._sentinel is not None:
            self._sentinel.release()
            self._sentinel = None

    def free_bytes(self) -> int:
        """From NVML, which needs no context; -1 where NVML is unavailable."""
        self._nvml_started.join()
        return self._nvml_free_bytes()

    def _nvml_free_bytes(self) -> int:
        try:
            return nvml.free_bytes(self.device_uuid)
        except nvml.NvmlUnavailable as exc:
            log.debug("free memory unknown: %s", exc)
            return -1
