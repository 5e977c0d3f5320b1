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
    SessionLost,
    TensorUnusable,
    VersionMismatch,
)
from hbmd.proto.instance import VERSION

from .budget import DeviceMemory
from .core import ForkedClient
from .kv import ExtensibleKVCacheBuffers
from .kv_layout import (
    bytes_per_block_per_segment,
    kv_blocks_that_fit,
    kv_view,
    narrow_blocks,
    num_segments,
)
from .opening import connect, default_client
from .session import Client
from .tensor import ExtensibleTensor

__version__ = VERSION

__all__ = [
    "Client",
    "Conflict",
    "DaemonUnavailable",
    "DeviceMemory",
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
    "SessionLost",
    "TensorUnusable",
    "VersionMismatch",
    "__version__",
    "bytes_per_block_per_segment",
    "connect",
    "default_client",
    "kv_blocks_that_fit",
    "kv_view",
    "narrow_blocks",
    "num_segments",
]
