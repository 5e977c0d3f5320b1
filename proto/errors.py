"""The one error-code table shared by the daemon and its clients.

Every refusal the daemon sends names a code from this table; the client turns
it back into the exception class registered for that code, so both sides raise
the same types and tests match on ``code`` rather than on message text.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class ErrorCode(enum.Enum):
    """Wire name and whether retrying the same request later can succeed."""

    UNAVAILABLE = ("unavailable", True)
    SESSION_LOST = ("session_lost", True)
    PROTOCOL = ("protocol_error", False)
    VERSION_MISMATCH = ("version_mismatch", False)
    INVALID = ("invalid_request", False)
    NOT_FOUND = ("not_found", False)
    PERMISSION = ("permission_denied", False)
    CONFLICT = ("conflict", True)
    OUT_OF_BUDGET = ("out_of_budget", True)
    OUT_OF_MEMORY = ("out_of_memory", True)
    DRIVER = ("driver_error", False)
    INTERNAL = ("internal_error", False)
    UNUSABLE = ("tensor_unusable", False)

    def __init__(self, wire: str, retryable: bool) -> None:
        self.wire = wire
        self.retryable = retryable

    @classmethod
    def from_wire(cls, wire: str) -> ErrorCode:
        for code in cls:
            if code.wire == wire:
                return code
        return cls.INTERNAL


class HbmdError(Exception):
    """Base of every hbmd error; ``code`` says which family it belongs to."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    @property
    def retryable(self) -> bool:
        return self.code.retryable


class DaemonUnavailable(HbmdError):
    """The daemon is not running, not reachable, or did not answer in time."""

    code = ErrorCode.UNAVAILABLE


class SessionLost(DaemonUnavailable):
    """The session is over: its daemon stopped or restarted. Connect again; persistent buffers are attached again by
    name."""

    code = ErrorCode.SESSION_LOST


class ProtocolError(HbmdError):
    """A message could not be decoded or had the wrong shape."""

    code = ErrorCode.PROTOCOL


class VersionMismatch(ProtocolError):
    """Client and daemon speak different major protocol versions."""

    code = ErrorCode.VERSION_MISMATCH


class InvalidRequest(HbmdError, ValueError):
    """A well-formed request with values out of range or inconsistent."""

    code = ErrorCode.INVALID


class NotFound(HbmdError, LookupError):
    """No such buffer, session or instance."""

    code = ErrorCode.NOT_FOUND


class PermissionDenied(HbmdError, PermissionError):
    """The caller may not touch this object, or may not connect at all."""

    code = ErrorCode.PERMISSION


class Conflict(HbmdError):
    """The object is in use (a name attached by a live session, say)."""

    code = ErrorCode.CONFLICT


class OutOfBudget(HbmdError, MemoryError):
    """The commit does not fit in the daemon's budget; nothing was allocated."""

    code = ErrorCode.OUT_OF_BUDGET


class OutOfDeviceMemory(HbmdError, MemoryError):
    """The driver or the kernel ran out of memory; retry after others free some."""

    code = ErrorCode.OUT_OF_MEMORY


class DriverError(HbmdError):
    """A driver call failed; ``function`` and ``result`` name the call and its CUresult."""

    code = ErrorCode.DRIVER

    @property
    def function(self) -> str:
        return str(self.details.get("function", ""))

    @property
    def result(self) -> str:
        return str(self.details.get("result", ""))


class InternalError(HbmdError):
    """A daemon bug: the request failed, the daemon kept running."""

    code = ErrorCode.INTERNAL


class TensorUnusable(HbmdError):
    """A client operation failed and so did putting the tensor back as it was: free it (its memory is the daemon's).

    Raised by the client only, never sent: the tensor's mappings no longer
    match the daemon's record, so any further use of it is refused.
    """

    code = ErrorCode.UNUSABLE


ERROR_CLASSES: dict[ErrorCode, type[HbmdError]] = {
    cls.code: cls
    for cls in (
        DaemonUnavailable,
        SessionLost,
        ProtocolError,
        VersionMismatch,
        InvalidRequest,
        NotFound,
        PermissionDenied,
        Conflict,
        OutOfBudget,
        OutOfDeviceMemory,
        DriverError,
        InternalError,
        TensorUnusable,
    )
}


def error_from_wire(code: str, message: str, details: Mapping[str, object]) -> HbmdError:
    """Rebuild the exception the daemon raised from its wire form."""
    cls = ERROR_CLASSES[ErrorCode.from_wire(code)]
    return cls(message, **{str(k): v for k, v in details.items()})
