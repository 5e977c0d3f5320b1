"""Inspection messages, the ones ``hbmctl`` sends."""

from __future__ import annotations

from .buffers import BufferInfo
from .codec import Message, message, record


@message("admin.status")
class Status(Message):
    """Ask for the instance's totals."""


@message("admin.status_reply")
class StatusReply(Message):
    """Totals of one daemon instance, in bytes; ``device_free_bytes`` is -1 where unknown."""

    instance: str
    backend: str
    device_index: int
    device_uuid: str
    pid: int
    daemon_version: str
    granularity: int
    total_bytes: int
    budget_bytes: int
    committed_bytes: int
    reserved_bytes: int
    num_sessions: int
    num_buffers: int
    num_chunks: int
    uptime_s: float
    device_free_bytes: int = -1


@record
class SessionInfo:
    session_id: int
    pid: int
    uid: int
    gid: int
    client_name: str
    tenant: str
    committed_bytes: int
    reserved_bytes: int
    num_buffers: int
    num_chunks: int
    connected_s: float


@message("admin.sessions")
class ListSessions(Message):
    """Ask for every live session."""


@message("admin.session_list")
class SessionList(Message):
    sessions: list[SessionInfo]


@message("admin.buffers")
class ListBuffers(Message):
    """Ask for buffers; ``session_id`` = -1 lists all."""

    session_id: int = -1


@message("admin.buffer_list")
class BufferList(Message):
    buffers: list[BufferInfo]
