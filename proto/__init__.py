"""hbmd wire protocol: typed messages, their msgpack codec and the error table.

Imports only the standard library and msgpack, so both the daemon and the
client (and anything else) can speak it.
"""

from .admin import (
    BufferList,
    ListBuffers,
    ListSessions,
    Reclaim,
    ReclaimSent,
    SessionInfo,
    SessionList,
    Status,
    StatusReply,
    TenantInfo,
)
from .buffers import (
    MAX_SEGMENTS,
    Attach,
    BufferCreated,
    BufferInfo,
    ChunkInfo,
    Commit,
    Committed,
    CommitSegments,
    CreateBuffer,
    Defragment,
    Delete,
    Detach,
    Detached,
    FinishDefragment,
    Free,
    Freed,
    Redeclare,
    Release,
    Remap,
    Released,
    Seal,
    Sealed,
)
from .codec import (
    MAX_FRAME_BYTES,
    MAX_REQUEST_BYTES,
    PROTOCOL_VERSION,
    Envelope,
    ErrorReply,
    Message,
    Request,
    decode_body,
    decode_datagram,
    decode_frames,
    encode_datagram,
    encode_frames,
    from_wire,
    peek_request_id,
    read_envelope,
    requests,
    to_wire,
)
from .errors import (
    ERROR_CLASSES,
    Conflict,
    DaemonUnavailable,
    DriverError,
    ErrorCode,
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
from .session import (
    MAX_PLACED_GRANULES,
    MAX_PLACED_SEGMENTS,
    MAX_SEGMENTS_WITH_FDS,
    Ack,
    FdBatch,
    Hello,
    LeasePlace,
    LeaseGrant,
    LeaseReturn,
    LeaseRevoke,
    ReclaimDone,
    ReclaimRequest,
    Refused,
    Welcome,
)

MAX_FDS_PER_DATAGRAM = 250
"""At most this many FDs ride in one ``SCM_RIGHTS`` datagram (the kernel's SCM_MAX_FD is 253)."""
