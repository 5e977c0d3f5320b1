"""Admin requests (``hbmd.proto.admin``): status, the lists of sessions and buffers, and reclaims asked of a session.

Each session sees its own user's sessions and buffers; an admin sees all.
"""

from __future__ import annotations

import heapq
import logging
import os

from hbmd.proto import (
    MAX_LISTED,
    MAX_LISTED_SEGMENTS,
    BufferList,
    ListBuffers,
    ListSessions,
    Reclaim,
    ReclaimSent,
    SessionList,
    Status,
    StatusReply,
)
from hbmd.proto.errors import NotFound
from hbmd.proto.instance import VERSION
from hbmd.proto.units import format_bytes

from ..backends import A, C
from ..state import Buffer, Session
from .connection import HandleConnection
from .registry import RequestHandlers, handles

log = logging.getLogger("hbmd.server.admin")

MAX_TENANTS_LISTED = 1000
"""Tenants in one status reply: it must stay far below the frame limit however many names clients declare."""


class AdminRequests(RequestHandlers[A, C]):
    """What ``hbmctl`` asks: the instance's status, its sessions and buffers, and a reclaim from a session."""

    @handles(Status)
    def status(self, conn: HandleConnection[A, C], request_id: int, msg: Status) -> StatusReply:
        """The instance, its budget and use, and the tenants the asking session may see."""
        state, backend = self.state, self.state.backend
        me = conn.opened_session
        tenants, tenants_left_out = state.tenants_listed(None if me.admin else me.uid, MAX_TENANTS_LISTED)
        return StatusReply(
            instance=backend.instance,
            backend=backend.name,
            device_index=backend.device_index,
            device_uuid=backend.device_uuid,
            pid=os.getpid(),
            daemon_version=VERSION,
            granularity=backend.granularity,
            total_bytes=backend.total_bytes,
            budget_bytes=state.tenants.budget_bytes,
            committed_bytes=state.tenants.committed_bytes,
            reserved_bytes=state.buffers.reserved_bytes,
            num_sessions=state.sessions.num_workers,
            num_buffers=len(state.buffers.by_id),
            num_chunks=state.buffers.num_chunks,
            uptime_s=state.clock.monotonic() - state.started_at,
            device_free_bytes=backend.free_bytes(),
            tenants=tenants,
            tenants_left_out=tenants_left_out,
            admissible_bytes=state.pressure.admissible_for(me),
            held_for_guarantees_bytes=state.tenants.held_for_others(me.tenant),
            credit_bytes=sum(s.credit for s in state.sessions.workers),
            held_back_bytes=backend.held_back_bytes(),
            leased_bytes=state.tenants.leased_bytes,
            config_path=state.config_load.path,
            config_loaded_at=state.config_load.loaded_at,
            config_reload_failed_at=state.config_load.failed_at,
            config_reload_error=state.config_load.error,
            host_budget_bytes=state.tenants.host_budget_bytes,
            host_bytes=state.tenants.host_bytes,
            host_pool_bytes=backend.host_pool_bytes(),
        )

    @handles(ListSessions)
    def list_sessions(self, conn: HandleConnection[A, C], request_id: int, msg: ListSessions) -> SessionList:
        """A page of the worker sessions the asking session may see, by id."""
        me = conn.opened_session
        visible = [
            s for s in self.state.sessions.workers
            if s.session_id > msg.after and msg.session_id in (-1, s.session_id) and (me.admin or s.uid == me.uid)
        ]
        first = heapq.nsmallest(MAX_LISTED + 1, visible, key=lambda s: s.session_id)
        return SessionList([self.state.sessions.info(s) for s in first[:MAX_LISTED]], more=len(first) > MAX_LISTED)

    @handles(ListBuffers)
    def list_buffers(self, conn: HandleConnection[A, C], request_id: int, msg: ListBuffers) -> BufferList:
        """A page of the buffers, every one or one session's, that the asking session may see and asks for, by id."""
        me = conn.opened_session
        if msg.session_id == -1:
            buffers = self.state.buffers.by_id.values()
        else:
            buffers = self._visible_session(me, msg.session_id).buffers.values()
        wanted = [
            b for b in buffers
            if b.buffer_id > msg.after and (me.admin or b.owner_uid == me.uid) and msg.name in ("", b.name)
            and msg.owner_uid in (-1, b.owner_uid)
        ]
        first = heapq.nsmallest(MAX_LISTED + 1, wanted, key=lambda b: b.buffer_id)
        page: list[Buffer[A, C]] = []
        segments = 0
        for buffer in first[:MAX_LISTED]:
            segments += buffer.num_segments
            if page and segments > MAX_LISTED_SEGMENTS:
                break
            page.append(buffer)
        return BufferList([b.info() for b in page], more=len(page) < len(first))

    @handles(Reclaim)
    def reclaim(self, conn: HandleConnection[A, C], request_id: int, msg: Reclaim) -> ReclaimSent:
        """Ask a session to release memory; the loop sends the request on its handle socket (``SessionNotices``)."""
        target = self._visible_session(conn.opened_session, msg.session_id)
        reason = f"asked by session {conn.opened_session.session_id} (uid {conn.uid})"
        reclaim = self.state.pressure.request_reclaim(target, msg.bytes, reason)
        log.info("asked session %d (pid %d) to release %s", target.session_id, target.pid, format_bytes(msg.bytes))
        return ReclaimSent(reclaim.reclaim_id, target.session_id, target.pid)

    def _visible_session(self, me: Session, session_id: int) -> Session:
        """Session ``session_id`` if ``me`` may see it: its own user's, or any for an admin."""
        session = self.state.sessions.by_id.get(session_id)
        if session is None or not (me.admin or session.uid == me.uid):
            raise NotFound(f"no session {session_id}", session_id=session_id)
        return session
