"""CUDA backend: chunks are ``cuMemCreate`` allocations exported as POSIX FDs.

The daemon calls ``cuInit`` and nothing that needs a context, so it holds no
CUDA context and costs no GPU memory of its own. It keeps each chunk's
allocation handle (not an FD): exported FDs are closed as soon as they are
sent, so a 10,000-chunk buffer costs no descriptors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from hbmd import driver
from hbmd.driver import nvml
from hbmd.proto.errors import DriverError
from hbmd.proto.layout import gpu_instance

from . import Backend

log = logging.getLogger("hbmd.cuda")


@dataclasses.dataclass
class AdoptedChunk:
    """A chunk taken back after a restart: its parked FD keeps it alive.

    A handle imported from that FD cannot be exported again (the driver
    answers CUDA_ERROR_INVALID_VALUE, seen on the H200), so the daemon keeps
    the FD itself and hands out duplicates of it.
    """

    fd: int


@dataclasses.dataclass
class WarmChunk:
    """A granule created and exported while the daemon was idle; its FD goes to the first export."""

    handle: Any
    fd: int
    """-1 once handed out."""


@dataclasses.dataclass
class CudaArena:
    rdma: bool
    """Whether this buffer's chunks are GPU-direct-RDMA capable."""


class CudaBackend(Backend):
    """One GPU's memory. ``warm_chunks`` granules are kept created and exported ahead of time.

    Exporting a POSIX FD costs about as much as everything else in a small
    commit (0.5-0.7 ms on the H200), so single-granule runs, the common case
    of block-by-block growth, take a warm chunk when one is there; the
    server tops the pool up while idle.
    """

    name = "cuda"

    def __init__(self, index: int, warm_chunks: int = 0) -> None:
        self.warm_target = warm_chunks
        self._warm: list[WarmChunk] = []
        driver.pin_device_order()
        driver.init()
        count = driver.device_count()
        if not 0 <= index < count:
            raise driver.CudaUnavailable(f"no GPU {index}: this node has {count}")
        self.device_index = index
        self.instance = gpu_instance(index)
        self.device_uuid = driver.device_uuid(index)
        self.device_name = driver.device_name(index)
        self.total_bytes = driver.total_memory(index)
        self.granularity = driver.granularity(index)
        self._rdma_refused = False
        # Prove POSIX-FD allocations work here before serving anyone.
        probe = driver.create(index, self.granularity, rdma=False)
        try:
            os.close(driver.export_fd(probe))
        finally:
            driver.release(probe)

    def open_arena(self, reserved_bytes: int, shareable: bool) -> CudaArena:
        return CudaArena(rdma=shareable and not self._rdma_refused)

    def create(self, arena: CudaArena, offset: int, size: int) -> Any:
        if size == self.granularity and not arena.rdma and self._warm:
            return self._warm.pop()
        if arena.rdma:
            try:
                return driver.create(self.device_index, size, rdma=True)
            except DriverError as exc:
                # Some systems refuse RDMA-capable allocations; the buffer still works without.
                log.warning("GPU %d refuses RDMA-capable allocations (%s); shareable buffers fall back to plain ones",
                            self.device_index, exc.result)
                self._rdma_refused = True
                arena.rdma = False
        return driver.create(self.device_index, size, rdma=False)

    def handle_offset(self, arena: CudaArena, chunk: Any) -> int:
        return 0

    def export(self, arena: CudaArena, chunk: Any) -> int:
        if isinstance(chunk, AdoptedChunk):
            return os.dup(chunk.fd)
        if isinstance(chunk, WarmChunk):
            if chunk.fd >= 0:
                fd, chunk.fd = chunk.fd, -1
                return fd
            return driver.export_fd(chunk.handle)
        return driver.export_fd(chunk)

    def release(self, arena: CudaArena, chunk: Any) -> None:
        if isinstance(chunk, AdoptedChunk):
            os.close(chunk.fd)
        elif isinstance(chunk, WarmChunk):
            if chunk.fd >= 0:
                os.close(chunk.fd)
            driver.release(chunk.handle)
        else:
            driver.release(chunk)

    def close_arena(self, arena: CudaArena) -> None:
        """Nothing per buffer to drop: each chunk is its own allocation."""

    parks_chunks = True  # each chunk is its own allocation

    def parked_fd(self, arena: CudaArena, chunk: Any | None) -> int:
        return self.export(arena, chunk)

    def adopt_arena(self, reserved_bytes: int, shareable: bool, fd: int | None) -> CudaArena:
        return CudaArena(rdma=shareable and not self._rdma_refused)

    def adopt(self, arena: CudaArena, offset: int, size: int, handle_offset: int, fd: int | None) -> AdoptedChunk:
        """Keep (a duplicate of) the parked FD: one descriptor per restored chunk, no driver call, no context."""
        if fd is None:
            raise driver.CudaUnavailable("a CUDA chunk cannot be adopted without its FD")
        return AdoptedChunk(os.dup(fd))

    def held_back_bytes(self) -> int:
        return self.warm_target * self.granularity

    def idle(self) -> bool:
        """Create and export one warm chunk if the pool is short; True while it still is."""
        if len(self._warm) >= self.warm_target:
            return False
        handle = driver.create(self.device_index, self.granularity, rdma=False)
        try:
            fd = driver.export_fd(handle)
        except BaseException:
            driver.release(handle)
            raise
        self._warm.append(WarmChunk(handle, fd))
        return len(self._warm) < self.warm_target

    def close(self) -> None:
        while self._warm:
            self.release(CudaArena(rdma=False), self._warm.pop())

    def free_bytes(self) -> int:
        """From NVML, which needs no context; -1 where NVML is unavailable."""
        try:
            return nvml.free_bytes(self.device_uuid)
        except nvml.NvmlUnavailable as exc:
            log.debug("free memory unknown: %s", exc)
            return -1
