"""Free device memory from NVML, which needs no CUDA context (the daemon has none).

Through ``cuda.bindings.nvml`` where the installed cuda-bindings has it (the
13.x releases); else through ctypes on the driver's ``libnvidia-ml.so.1``,
which older cuda-bindings and nodes without them still have. Only the three
calls hbmd needs.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any


class NvmlUnavailable(RuntimeError):
    """NVML could not be loaded or answered with an error."""


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _check(rc: int, function: str) -> None:
    if rc != 0:
        raise NvmlUnavailable(f"{function} returned NVML error {rc}")


class _Ctypes:
    """NVML loaded by hand from the driver's library."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as exc:
            raise NvmlUnavailable(f"libnvidia-ml.so.1 not loadable: {exc}") from None
        _check(self.lib.nvmlInit_v2(), "nvmlInit_v2")
        self.devices: dict[str, ctypes.c_void_p] = {}

    def free_bytes(self, uuid: str) -> int:
        device = self.devices.get(uuid)
        if device is None:
            device = ctypes.c_void_p()
            _check(self.lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(device)), "nvmlDeviceGetHandleByUUID")
            self.devices[uuid] = device
        memory = _Memory()
        _check(self.lib.nvmlDeviceGetMemoryInfo(device, ctypes.byref(memory)), "nvmlDeviceGetMemoryInfo")
        return memory.free


class _Bindings:
    """NVML through cuda-bindings, whose errors are exceptions already."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.devices: dict[str, Any] = {}
        try:
            nvml.init_v2()
        except (nvml.NvmlError, RuntimeError) as exc:  # RuntimeError: the library itself was not found
            raise NvmlUnavailable(f"nvmlInit_v2: {exc}") from None

    def free_bytes(self, uuid: str) -> int:
        try:
            device = self.devices.get(uuid)
            if device is None:
                device = self.devices[uuid] = self.nvml.device_get_handle_by_uuid(uuid)
            # _v2 is the query current drivers document; it counts the reserved memory as used.
            return self.nvml.device_get_memory_info_v2(device).free
        except self.nvml.NvmlError as exc:
            raise NvmlUnavailable(f"NVML memory query for {uuid}: {exc}") from None


@functools.cache
def _nvml() -> _Bindings | _Ctypes:
    try:
        from cuda.bindings import nvml
    except ImportError:
        return _Ctypes()
    return _Bindings(nvml)


def free_bytes(uuid: str) -> int:
    """Free memory of the GPU with ``uuid`` as the driver sees it (all processes' allocations counted).

    Every ``status`` asks, so each GPU's handle is looked up once.
    """
    return _nvml().free_bytes(uuid)
