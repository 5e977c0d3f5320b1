"""Inspection messages, the ones ``hbmctl`` sends."""

from __future__ import annotations

import dataclasses

from .buffers import BufferInfo
from .codec import Message, Request, message, record


@record
class TenantInfo:
    """A tenant's use against its limits; ``max_bytes`` is -1 for none."""

    name: str
    used_bytes: int
    guaranteed_bytes: int
    max_bytes: int
    num_sessions: int
    host_bytes: int = 0
    """Bytes of its buffers demoted to the host tier (1.6), charged to the host budget, not to ``used_bytes``."""


@message("admin.status_reply")
class StatusReply(Message):
    """Totals of one daemon instance, in bytes; ``device_free_bytes`` is -1 where unknown.

    ``tenants``: those in use (a session or buffer is charged to them) for
    an admin, else the asking user's own; at
    most a thousand (limited ones and the largest first), and
    ``tenants_left_out`` says how many more there are (protocol 1.2).
    """

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
    tenants: list[TenantInfo] = dataclasses.field(default_factory=list)
    held_back_bytes: int = 0
    """Device memory the daemon holds for itself (warm pool, export sentinel), already taken out of the budget (1.1)."""
    admissible_bytes: int = -1
    """What more the daemon would admit for the asking session now: its tenant's maximum, the budget and
    others' guaranteed minimums all counted (1.1; -1 from older daemons)."""
    tenants_left_out: int = 0
    """Tenants not listed in ``tenants`` (1.2)."""
    leased_bytes: int = 0
    """Granules leased to sessions and not placed yet (1.3): charged to their tenants, not part of
    ``committed_bytes``."""
    config_path: str = ""
    """The daemon's ``--config`` file, empty without one (1.5)."""
    config_loaded_at: float = 0.0
    """Unix time the config in force was read, at start or by the last reload that took effect (1.5)."""
    config_reload_failed_at: float = 0.0
    """Unix time of the last reload refused since then, the config in force kept; 0 for none (1.5)."""
    config_reload_error: str = ""
    """Why that reload was refused (1.5)."""
    host_budget_bytes: int = 0
    """Most bytes the host tier holds at once, 0 where it is off (1.6)."""
    host_bytes: int = 0
    """Bytes of buffers demoted to the host tier (1.6), not part of ``committed_bytes``."""
    host_pool_bytes: int = 0
    """Host-tier memory made ahead of demotes, inside the host budget (1.6)."""
    held_for_guarantees_bytes: int = -1
    """Bytes of the budget held for other tenants' guaranteed minimums, as far as they have not used them: room the
    asking session's tenant cannot commit into, part of why ``admissible_bytes`` is below ``budget_bytes -
    committed_bytes - leased_bytes`` (1.9; -1 from older daemons)."""
    credit_bytes: int = -1
    """Of ``leased_bytes``, the credit (leased as bytes, not granules) (1.9; -1 from older daemons)."""


@message("admin.status")
class Status(Request[StatusReply]):
    """Ask for the instance's totals."""

    changes_state = False


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
    reclaim_requested_bytes: int = 0
    reclaim_released_bytes: int = -1
    reclaim_state: str = ""
    """Of the last reclaim request: "" (none), "pending", "answered" or "ignored"."""
    leased_bytes: int = 0
    """Granules leased to the session and not placed yet (1.3)."""
    resuming: bool = False
    """Restored after a daemon restart, its client not back yet (1.4)."""


MAX_LISTED = 1000
"""The most sessions or buffers in one page of a list (1.10)."""
MAX_LISTED_SEGMENTS = 1 << 16
"""The most segments of the buffers in one page (1.10), a buffer of more always alone: with their sizes a page
stays far below the frame limit, however many buffers peers make."""


@message("admin.session_list")
class SessionList(Message):
    """A page of sessions, by id (1.10: earlier daemons send all in one)."""

    sessions: list[SessionInfo]
    more: bool = False
    """More follow (1.10): ask again with ``after`` the last one's id."""


@message("admin.sessions")
class ListSessions(Request[SessionList]):
    """Ask for the live sessions: every one the asking session may see, or ``session_id`` alone (1.10).

    A page holds at most :data:`MAX_LISTED`, those of an id above ``after``
    (1.10); the client library asks for the next until none are left.
    """

    changes_state = False

    after: int = 0
    session_id: int = -1


@message("admin.buffer_list")
class BufferList(Message):
    """A page of buffers, by id (1.10: earlier daemons send all in one)."""

    buffers: list[BufferInfo]
    more: bool = False
    """More follow (1.10): ask again with ``after`` the last one's id."""


@message("admin.buffers")
class ListBuffers(Request[BufferList]):
    """Ask for buffers; ``session_id`` = -1 lists all.

    Only those named ``name`` (1.10, where not empty) and of user
    ``owner_uid`` (1.10, where not -1): what a client looking for one buffer
    asks for, so that others' buffers never stand in its way. A page holds at
    most :data:`MAX_LISTED` buffers of :data:`MAX_LISTED_SEGMENTS` segments in
    all, those of an id above ``after`` (1.10); the client library asks for the
    next until none are left.
    """

    changes_state = False

    session_id: int = -1
    after: int = 0
    name: str = ""
    owner_uid: int = -1


@message("admin.reclaim_sent")
class ReclaimSent(Message):
    reclaim_id: int
    session_id: int
    pid: int


@message("admin.reclaim")
class Reclaim(Request[ReclaimSent]):
    """Ask session ``session_id`` to give ``bytes`` back (its own user's sessions, or any for an admin)."""

    session_id: int
    bytes: int
