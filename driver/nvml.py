"""Free device memory from NVML, which needs no CUDA context (the daemon has none).

Loaded with ctypes from the driver's ``libnvidia-ml.so.1``; only the three
calls hbmd needs.
"""

from __future__ import annotations

import ctypes
import functools


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or answered with an error."""


@functools.cache
def _library() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as exc:
        raise NvmlUnavailable(f"libnvidia-ml.so.1 not loadable: {exc}") from None
    _check(lib.nvmlInit_v2(), "nvmlInit_v2")
    return lib


def _check(rc: int, function: str) -> None:
    if rc != 0:
        raise NvmlUnavailable(f"{function} returned NVML error {rc}")


def free_bytes(uuid: str) -> int:
    """Free memory of the GPU with ``uuid`` as the driver sees it (all processes' allocations counted)."""
    lib = _library()
    device = ctypes.c_void_p()
    _check(lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(device)), "nvmlDeviceGetHandleByUUID")
    memory = _Memory()
    _check(lib.nvmlDeviceGetMemoryInfo(device, ctypes.byref(memory)), "nvmlDeviceGetMemoryInfo")
    return memory.free
