"""The one module that talks to the CUDA driver (``cuda.bindings.driver``).

Both the daemon's CUDA backend and the client's CUDA mapper call through
here. :func:`check` turns the bindings' ``(CUresult, *values)`` tuples into
values or a :class:`~hbmd.proto.errors.DriverError` whose ``function`` and
``result`` fields name the call and the CUresult; an out-of-memory result
becomes the retryable :class:`~hbmd.proto.errors.OutOfDeviceMemory`.

Nothing here creates a context: the daemon only ever calls the functions
that work after ``cuInit`` alone. The client makes the device's primary
context current (the one torch uses) before mapping.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

from hbmd.proto.errors import DriverError, OutOfDeviceMemory

log = logging.getLogger("hbmd.driver")


DRIVER_VERSION_FILE = "/proc/driver/nvidia/version"
"""Where a loaded NVIDIA kernel module says its version, which decides the cuda-bindings major to install."""


class CudaUnavailable(RuntimeError):
    """No usable CUDA driver, device or VMM support here; the message says which."""


@functools.cache
def _bindings() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise CudaUnavailable(f"cuda-bindings is not installed ({exc}): {bindings_to_install()}") from None
    return driver


def driver_loaded() -> bool:
    """Whether an NVIDIA kernel module is loaded on this node: without one, no CUDA is to be expected here."""
    return os.path.exists(DRIVER_VERSION_FILE)


def bindings_to_install(version_file: str | None = None) -> str:
    """The cuda-bindings this node's driver runs, as an install that works wherever hbmd came from: the bindings by
    their own name (13.x needs an R580 or newer driver, 12.x R525 or newer), or hbmd's extra of the same pin from a
    checkout or a built wheel (pyproject's ``cuda13``/``cuda12``). ``version_file``: the driver's, by default
    :data:`DRIVER_VERSION_FILE`."""
    try:
        with open(version_file or DRIVER_VERSION_FILE, encoding="utf-8") as f:
            found = re.search(r"\s(\d+)\.\d+(?:\.\d+)?\s", f.read())
    except OSError:
        found = None
    if found is None:
        return ("install the cuda-bindings of the node's driver: pip install 'cuda-bindings>=13,<14' for R580 and "
                "newer, 'cuda-bindings>=12,<13' for R525 and newer (no NVIDIA driver is loaded here)")
    major = int(found.group(1))
    if major < 525:
        return f"this node's driver R{major} is older than any cuda-bindings hbmd takes (R525 for cuda-bindings 12)"
    pin, extra = ("'cuda-bindings>=13,<14'", "cuda13") if major >= 580 else ("'cuda-bindings>=12,<13'", "cuda12")
    return f"pip install {pin} (this node's driver is R{major}; from an hbmd checkout, pip install '.[{extra}]')"


def check(result: Any, function: str) -> Any:
    """Unwrap ``(CUresult, *values)``: nothing, the one value, or a tuple of them."""
    err, *values = result if isinstance(result, tuple) else (result,)
    cu = _bindings()
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.CUresult(err).name
        cls = OutOfDeviceMemory if err == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY else DriverError
        raise cls(f"{function} failed: {name}", function=function, result=name)
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def call(function: str, *args: Any) -> Any:
    """``check(cuda.<function>(*args), function)``."""
    return check(getattr(_bindings(), function)(*args), function)


@functools.cache
def init() -> None:
    """``cuInit(0)``; :class:`CudaUnavailable` with the reason where it cannot work.

    Without a driver the bindings raise rather than return an error code.
    """
    cu = _bindings()
    try:
        err, = cu.cuInit(0)
    except Exception as exc:  # the bindings raise their own loader errors
        log.debug("cuInit raised: %s", exc)
        raise CudaUnavailable("no NVIDIA driver (libcuda.so.1 could not be loaded)") from None
    if err != cu.CUresult.CUDA_SUCCESS:
        raise CudaUnavailable(f"cuInit failed: {cu.CUresult(err).name}")


def device_count() -> int:
    init()
    return call("cuDeviceGetCount")


def device(ordinal: int) -> Any:
    init()
    return call("cuDeviceGet", ordinal)


def device_uuid(ordinal: int) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, as nvidia-smi prints it."""
    raw = bytes(call("cuDeviceGetUuid", device(ordinal)).bytes)
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def ordinal_of_uuid(uuid: str) -> int:
    """This process's CUDA ordinal of the GPU with ``uuid`` (it depends on ``CUDA_VISIBLE_DEVICES``)."""
    for ordinal in range(device_count()):
        if device_uuid(ordinal) == uuid:
            return ordinal
    raise CudaUnavailable(f"GPU {uuid} is not visible to this process (check CUDA_VISIBLE_DEVICES)")


def device_name(ordinal: int) -> str:
    return call("cuDeviceGetName", 96, device(ordinal)).split(b"\0", 1)[0].decode()


def total_memory(ordinal: int) -> int:
    return call("cuDeviceTotalMem", device(ordinal))


@functools.cache
def _allocation_prop(ordinal: int, rdma: bool) -> Any:
    """Built once per device and kind: the driver only reads it, and every chunk of every commit is made from it."""
    cu = _bindings()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    if rdma:
        prop.allocFlags.gpuDirectRDMACapable = 1
    return prop


def host_numa_node(ordinal: int) -> int:
    """The host NUMA node nearest the device (``CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID``, CUDA 12.2), 0 where the driver
    does not say or the host has no NUMA (it answers -1)."""
    cu = _bindings()
    attribute = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_HOST_NUMA_ID", None)
    if attribute is None:
        return 0
    return max(0, int(call("cuDeviceGetAttribute", attribute, device(ordinal))))


def _host_allocation_prop(numa_node: int) -> Any:
    """Pinned host memory on NUMA node ``numa_node``, exportable as a POSIX FD: a context-free process makes it and a
    client maps it with device access beside device chunks (H200, driver 580: SPEC, "host-NUMA VMM memory")."""
    cu = _bindings()
    host_numa = getattr(cu.CUmemLocationType, "CU_MEM_LOCATION_TYPE_HOST_NUMA", None)
    if host_numa is None:  # cuda-bindings before 12.2
        raise DriverError("these cuda-bindings have no host-NUMA allocations (CUDA 12.2 and later do)",
                          function="cuMemCreate", result="CUDA_ERROR_NOT_SUPPORTED")
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = host_numa
    prop.location.id = numa_node
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def host_granularity(numa_node: int) -> int:
    cu = _bindings()
    return call(
        "cuMemGetAllocationGranularity",
        _host_allocation_prop(numa_node),
        cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
    )


def create_host(numa_node: int, size: int) -> Any:
    """A host-NUMA allocation exportable as a POSIX FD (its pages pinned as it is made, slowly)."""
    return call("cuMemCreate", size, _host_allocation_prop(numa_node), 0)


def granularity(ordinal: int) -> int:
    cu = _bindings()
    return call(
        "cuMemGetAllocationGranularity",
        _allocation_prop(ordinal, False),
        cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
    )


def create(ordinal: int, size: int, rdma: bool) -> Any:
    """A physical allocation exportable as a POSIX FD (and RDMA-capable if asked)."""
    return call("cuMemCreate", size, _allocation_prop(ordinal, rdma), 0)


def export_fd(handle: Any) -> int:
    cu = _bindings()
    return int(
        call(
            "cuMemExportToShareableHandle",
            handle,
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    )


def import_fd(fd: int) -> Any:
    cu = _bindings()
    return call(
        "cuMemImportFromShareableHandle", fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    )


def is_plain_device_memory(handle: Any, ordinal: int) -> bool:
    """Whether the allocation is pinned memory of device ``ordinal`` (not host memory, not another GPU's)."""
    cu = _bindings()
    prop = call("cuMemGetAllocationPropertiesFromHandle", handle)
    return (
        prop.type == cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        and prop.location.type == cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        and int(prop.location.id) == ordinal
    )


def spans_exactly(handle: Any, size: int, granule: int, scratch: int) -> bool:
    """Whether the allocation is of exactly ``size`` bytes: it maps whole at ``scratch`` (a reserved range of at
    least ``size`` + ``granule`` bytes) and one granule more does not.

    The driver reads no size from a handle. Both mappings are needed: an
    H200's driver refuses a mapping shorter than its allocation, but the
    driver API allows one, and where it does only the second tells a larger
    allocation apart. Works without a context.
    """
    try:
        map(scratch, size + granule, handle)
    except DriverError:
        pass
    else:
        unmap(scratch, size + granule)
        return False
    try:
        map(scratch, size, handle)
    except DriverError:
        return False
    unmap(scratch, size)
    return True


def release(handle: Any) -> None:
    call("cuMemRelease", handle)


def reserve(size: int, alignment: int) -> int:
    return int(call("cuMemAddressReserve", size, alignment, 0, 0))


def unreserve(address: int, size: int) -> None:
    call("cuMemAddressFree", address, size)


def map(address: int, size: int, handle: Any) -> None:  # the driver's own verb, though it shadows the builtin
    call("cuMemMap", address, size, 0, handle, 0)


def unmap(address: int, size: int) -> None:
    call("cuMemUnmap", address, size)


def retain(address: int) -> Any:
    """The handle of the allocation mapped at ``address``, as a reference of its own (``release`` it)."""
    return call("cuMemRetainAllocationHandle", address)


def set_access(address: int, size: int, ordinals: list[int], readonly: bool = False) -> None:
    """Grant read-write (or, ``readonly``, read-only) access to ``[address, address + size)`` from each device in
    ``ordinals``.

    A kernel that writes through a read-only mapping faults: the context
    reports an illegal-address error, as for an unmapped address.
    """
    descs = _access_descs(tuple(ordinals), readonly)
    call("cuMemSetAccess", address, size, descs, len(descs))


@functools.cache
def _access_descs(ordinals: tuple[int, ...], readonly: bool) -> list[Any]:
    """Built once per device list and mode, as :func:`_allocation_prop`: every mapping of every commit sets access."""
    cu = _bindings()
    flags = cu.CUmemAccess_flags
    descs = []
    for ordinal in ordinals:
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READ if readonly else flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        descs.append(desc)
    return descs


def use_primary_context(ordinal: int) -> Any:
    """Retain the device's primary context (torch's) and make it current on this thread."""
    ctx = call("cuDevicePrimaryCtxRetain", device(ordinal))
    call("cuCtxSetCurrent", ctx)
    return ctx


def make_current(ctx: Any) -> None:
    call("cuCtxSetCurrent", ctx)


def create_stream() -> Any:
    cu = _bindings()
    return call("cuStreamCreate", cu.CUstream_flags.CU_STREAM_NON_BLOCKING)


def memset_async(address: int, size: int, stream: Any) -> None:
    call("cuMemsetD8Async", address, 0, size, stream)


def copy_async(destination: int, source: int, size: int, stream: Any) -> None:
    """Copy between mapped addresses of this context, device or host-NUMA memory alike (the driver tells them apart)."""
    call("cuMemcpyAsync", destination, source, size, stream)


@contextlib.contextmanager
def relaxed_capture() -> Iterator[None]:
    """This thread's driver calls in the scope are not checked against a CUDA graph being captured on another thread.

    A graph captured in the global mode (torch's default) fails when any
    thread makes a call the driver deems unsafe during it; chunks made and
    imported beside the engine, on a thread of the client's own, must not
    fail the engine's capture. The thread's mode is restored after.
    """
    cu = _bindings()
    previous = call("cuThreadExchangeStreamCaptureMode", cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED)
    try:
        yield
    finally:
        call("cuThreadExchangeStreamCaptureMode", previous)


def context_synchronize() -> None:
    call("cuCtxSynchronize")


def pin_device_order() -> None:
    """Make CUDA ordinals equal nvidia-smi indices in this process (PCI bus order, all GPUs visible).

    The daemon is addressed by nvidia-smi index; must run before :func:`init`.
    """
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
