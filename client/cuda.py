"""GPU-side mapping: import each chunk FD, map it into a reserved VA range, grant access.

Runs in the device's primary context (the one torch uses), made current
before every group of driver calls. Each chunk is imported, mapped at its
offset and given read-write access, and its imported handle released at
once: the mapping keeps the memory alive, so unmapping is what frees it.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import Any

from hbmd import driver
from hbmd.proto import ChunkInfo
from hbmd.proto.errors import NotFound
from hbmd.proto.instance import (
    InstanceInfo,
    InstancePaths,
    list_instances,
    resolve_run_dir,
    run_dir_origin,
)
from hbmd.proto.undo import Undo

from .dlpack import KDL_CUDA, uint8_view


def instance_for_cuda_device(ordinal: int, run_dir: str | os.PathLike | None) -> str:
    """The instance serving this process's CUDA device ``ordinal``, matched by GPU UUID.

    Matching by UUID (not by index) keeps ``CUDA_VISIBLE_DEVICES`` remapping
    from connecting a worker to another GPU's daemon.
    """
    uuid = driver.device_uuid(ordinal)
    root = resolve_run_dir(run_dir)
    for instance in list_instances(root):
        info = InstanceInfo.read(InstancePaths.of(root, instance).info)
        if info is not None and info.device_uuid == uuid:
            return instance
    raise NotFound(f"no hbmd instance serves cuda:{ordinal} ({uuid}) under {run_dir_origin(run_dir)}", device_uuid=uuid)


class CudaMapper:
    """Maps CUDA-backend chunks into one reserved VA range per buffer."""

    kind = "cuda"

    def __init__(self, device_uuid: str, granularity: int) -> None:
        self.ordinal = driver.ordinal_of_uuid(device_uuid)
        self.granularity = granularity
        self._ctx = driver.use_primary_context(self.ordinal)
        self._stream = driver.create_stream()

    def reserve(self, size: int) -> int:
        driver.make_current(self._ctx)
        return driver.reserve(size, self.granularity)

    def map(self, address: int, chunk: ChunkInfo, fd: int, readonly: bool = False) -> None:
        """Import ``chunk``'s FD, map it at ``address``, grant access (read-only if asked).

        A failed step undoes the others.
        """
        handle = self.prepare(fd)
        try:
            self.map_prepared(address, chunk, handle, readonly)
        finally:
            # On success too: the mapping now holds the memory, the handle is not needed.
            self.discard(handle)

    def prepare(self, fd: int) -> Any:
        """The chunk's allocation handle, imported from its FD (any thread: the context is made current here)."""
        driver.make_current(self._ctx)
        return driver.import_fd(fd)

    def map_prepared(self, address: int, chunk: ChunkInfo, prepared: Any, readonly: bool = False) -> None:
        driver.make_current(self._ctx)
        with Undo() as undo:
            driver.map(address, chunk.size, prepared)
            undo.push(driver.unmap, address, chunk.size)
            driver.set_access(address, chunk.size, [self.ordinal], readonly)

    def discard(self, prepared: Any) -> None:
        driver.release(prepared)

    def beside_capture(self) -> AbstractContextManager[None]:
        driver.make_current(self._ctx)
        return driver.relaxed_capture()

    def make(self, size: int) -> Any:
        """Plain device memory exportable as a POSIX FD, as the daemon's own chunks."""
        return driver.create(self.ordinal, size, rdma=False)

    def export(self, prepared: Any) -> int:
        return driver.export_fd(prepared)

    def alias(self, source: int, size: int, destination: int) -> None:
        driver.make_current(self._ctx)
        handle = driver.retain(source)
        try:
            with Undo() as undo:
                driver.map(destination, size, handle)
                undo.push(driver.unmap, destination, size)
                driver.set_access(destination, size, [self.ordinal])
        finally:
            driver.release(handle)  # the mappings hold the memory

    def unmap(self, address: int, size: int) -> None:
        driver.make_current(self._ctx)
        driver.unmap(address, size)

    def protect(self, address: int, size: int) -> None:
        """Set read-only access on a mapped range: a kernel that writes there faults from now on."""
        driver.make_current(self._ctx)
        driver.set_access(address, size, [self.ordinal], readonly=True)

    def copy(self, destination: int, source: int, size: int) -> None:
        """Queue a copy on the mapper's stream (device or host-NUMA memory alike); :meth:`synchronize` waits for it."""
        driver.make_current(self._ctx)
        driver.copy_async(destination, source, size, self._stream)

    def zero(self, address: int, size: int) -> None:
        """Queue zeroing on the mapper's stream; :meth:`synchronize` waits for it."""
        driver.make_current(self._ctx)
        driver.memset_async(address, size, self._stream)

    def unreserve(self, base: int, size: int) -> None:
        driver.make_current(self._ctx)
        driver.unreserve(base, size)

    def view(self, base: int, size: int, owner: Any = None) -> Any:
        return uint8_view(base, size, KDL_CUDA, self.ordinal, owner)

    def synchronize(self) -> None:
        """Wait for all work on the device in this context: before unmapping, nothing may be in flight."""
        driver.make_current(self._ctx)
        driver.context_synchronize()
