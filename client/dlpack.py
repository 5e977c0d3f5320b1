"""Zero-copy torch views over raw address ranges, through DLPack.

torch is imported lazily: it is an optional dependency of the client only.
"""

from __future__ import annotations

import ctypes
from typing import Any

KDL_CPU = 1
KDL_CUDA = 2
_KDL_UINT = 1


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_PyCapsule_New = ctypes.pythonapi.PyCapsule_New
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# Structures handed to torch stay alive here until torch calls their deleter.
_alive: dict[int, tuple[Any, ...]] = {}


@_Deleter
def _release(managed: Any) -> None:
    _alive.pop(ctypes.addressof(managed.contents), None)


def uint8_view(address: int, size: int, device_type: int, device_id: int, owner: Any = None) -> Any:
    """A ``torch.uint8`` tensor of ``size`` bytes at ``address``, sharing the memory.

    ``owner`` is kept alive until torch lets go of the view (and of every view derived from it).
    """
    try:
        import torch
    except ImportError as exc:
        raise ImportError("tensor views need torch: pip install 'torch>=2.4' numpy") from exc
    shape = (ctypes.c_int64 * 1)(size)
    strides = (ctypes.c_int64 * 1)(1)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(
        ctypes.c_void_p(address), _DLDevice(device_type, device_id), 1, _DLDataType(_KDL_UINT, 8, 1), shape, strides, 0
    )
    managed.deleter = _release
    _alive[ctypes.addressof(managed)] = (managed, shape, strides, owner)
    capsule = _PyCapsule_New(ctypes.addressof(managed), b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(capsule)
