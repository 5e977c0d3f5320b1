"""hbmd client: connect to a daemon instance and use its memory as growable tensors."""

from hbmd.proto.errors import (
    Conflict,
    DaemonUnavailable,
    DriverError,
    HbmdError,
    InternalError,
    InvalidRequest,
    NotFound,
    OutOfBudget,
    OutOfDeviceMemory,
    PermissionDenied,
    ProtocolError,
    VersionMismatch,
)

from .kv import ExtensibleKVCacheBuffers
from .session import Client, ForkedClient, connect, default_client
from .tensor import ExtensibleTensor

__all__ = [
    "Client",
    "Conflict",
    "DaemonUnavailable",
    "DriverError",
    "ExtensibleKVCacheBuffers",
    "ExtensibleTensor",
    "ForkedClient",
    "HbmdError",
    "InternalError",
    "InvalidRequest",
    "NotFound",
    "OutOfBudget",
    "OutOfDeviceMemory",
    "PermissionDenied",
    "ProtocolError",
    "VersionMismatch",
    "connect",
    "default_client",
]
