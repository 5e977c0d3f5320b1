"""Sessions: who is connected, by id and by token, and the reclaim requests made to them."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import Any

from hbmd.proto import BufferInfo, SessionInfo
from hbmd.proto.buffers import MAX_NAME
from hbmd.proto.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    SessionLost,
)

from ..clock import Clock
from ..shares import fair_share, fits
from .credentials import KEY_BYTES, LINE_HEX, Credentials
from .records import MAX_CAPACITY, Buffer, Limits, Reclaim, Session, Tenant, check_int

RECLAIM_PATIENCE_S = 30.0
"""By default a reclaim request unanswered this long is reported as ignored (the session is never killed for it)."""


class Sessions:
    """The instance's open sessions; a session's token is its only credential on the control plane."""

    def __init__(self, limits: Limits, reclaim_patience_s: float, clock: Clock) -> None:
        """``clock``: the state's, whose monotonic time sessions are stamped with and reclaims judged by."""
        self.limits = limits
        self.clock = clock
        self.credentials = Credentials(secrets.token_bytes(KEY_BYTES))
        """Issues and checks resume credentials: under a key of this run's own until the instance's is given."""
        self.reclaim_patience_s = reclaim_patience_s
        self.by_id: dict[int, Session] = {}
        self._by_token: dict[str, Session] = {}
        self.of_uid: dict[int, dict[int, Session]] = {}
        """Every session by its uid, then by id: what a hello and a status count without walking every session."""
        self.workers_of: dict[str, int] = {}
        """How many worker sessions (not observers) are charged to each tenant, by its name."""
        self._next_id = 1
        self._next_reclaim = 1
        self.reclaims_due: list[tuple[Session, Reclaim]] = []
        """Reclaim requests made, for the server to send."""

    def open(
        self, pid: int, uid: int, gid: int, client_name: str, tenant: Tenant, admin: bool, observer: bool, lease: bool,
        starting_over: tuple[int, str] = (0, ""),
    ) -> Session:
        """A new session charged to ``tenant`` (the caller holds it for the session); ``starting_over``: the id and the
        credential of a session this daemon does not keep that it replaces (:meth:`may_start_over`), spent once it
        opens, so that it may declare what its process maps.

        Raises ``Conflict`` (retryable) when ``uid`` already has its :attr:`Limits.sessions_per_uid`, or its fair
        share of :attr:`Limits.sessions` (:mod:`hbmd.daemon.shares`),
        ``InvalidRequest`` for a ``client_name`` longer than ``MAX_NAME`` or not printable.
        """
        # The name reaches the daemon's log and hbmctl's terminal: a control character would forge lines there.
        if len(client_name) > MAX_NAME or not client_name.isprintable():
            raise InvalidRequest(
                f"client name must be at most {MAX_NAME} printable characters", field="client_name"
            )
        open_sessions = len(self.of_uid.get(uid, ()))
        if open_sessions >= self.limits.sessions_per_uid:
            raise Conflict(
                f"uid {uid} already has {open_sessions} sessions, the most allowed (--max-sessions-per-uid)",
                uid=uid, limit=self.limits.sessions_per_uid,
            )
        limits = self.limits
        total = max(limits.sessions, limits.sessions_per_uid)
        others = len(self.of_uid) - (uid in self.of_uid)
        if not fits(open_sessions, 1, len(self.by_id), others, limits.sessions_per_uid, total, limits.sessions_floor):
            share = fair_share(limits.sessions_per_uid, total, limits.sessions_floor, others)
            raise Conflict(
                f"uid {uid} already has {open_sessions} sessions, its share now of the {total} all uids may have "
                f"({len(self.by_id)} open, {share} each while {others + 1} uids hold some); retry once others end",
                uid=uid, limit=share,
            )
        now = self.clock.monotonic()
        session = Session(
            self._next_id, secrets.token_hex(16), pid, uid, gid, client_name, tenant, admin, observer,
            wants_lease=lease, connected_at=now, lease_used_at=now,
        )
        replaced, credential = starting_over
        session.declaring = bool(credential) and not observer
        session.replaces = (credential[:LINE_HEX], replaced) if credential else ("", 0)
        self._next_id += 1
        self._add(session)
        if credential:
            self.credentials.spend(replaced, credential)
        return session

    def _add(self, session: Session) -> None:
        self.by_id[session.session_id] = session
        self._by_token[session.token] = session
        self.of_uid.setdefault(session.uid, {})[session.session_id] = session
        if not session.observer:
            self.workers_of[session.tenant.name] = self.workers_of.get(session.tenant.name, 0) + 1

    def may_start_over(self, session_id: int, uid: int, pid: int, credential: str) -> bool:
        """Whether the process ``pid`` of ``uid`` may open a session in place of ``session_id``, which this daemon does
        not keep for it: the process proves with ``credential`` that it held that session (its client library keeps
        the credential of the last welcome; no other process has it), issued before the last cold start (a session
        this line of daemons ended is not started over: :class:`~.credentials.Credentials`). A pid alone would not
        do: in a pid namespace of the daemon's own every peer's reads 0."""
        return self.credentials.start_over(uid, session_id, pid, credential)

    def issue_credential(self, session: Session) -> str:
        """A new credential that resumes ``session`` after a restart; the one before it is void. Only its hash is
        kept."""
        credential = self.credentials.issue(session.uid, session.session_id, session.pid)
        session.previous_credential_hash, session.credential_hash = session.credential_hash, _digest(credential)
        return credential

    @property
    def next_id(self) -> int:
        """The id the next session opened gets."""
        return self._next_id

    def continue_from(self, next_id: int) -> None:
        """Give no session an id below ``next_id``: one a session of this line of daemons had (journaled, or lost
        restoring the journal). A reused id would let the credential of the session that had it first start over as
        the one that has it now."""
        self._next_id = max(self._next_id, next_id)

    def restore(self, session: Session, resume_by: float) -> None:
        """Take back a session journaled before a restart; it waits for its client until ``resume_by``."""
        session.connected_at = session.lease_used_at = self.clock.monotonic()
        session.resume_by = resume_by
        self._add(session)
        self._next_id = max(self._next_id, session.session_id + 1)

    def suspend(self, session: Session, resume_by: float) -> None:
        """The session's client was hung up on (its daemon hands over to another): it may resume until ``resume_by``,
        with its credential; its token is void."""
        del self._by_token[session.token]
        session.token = secrets.token_hex(16)
        self._by_token[session.token] = session
        session.resume_by = resume_by

    def resume(self, session_id: int, uid: int, pid: int, credential: str) -> Session:
        """The restored session ``session_id``, back with its client: its process (``uid``, ``pid``) proved it with
        its credential. It gets a new token.

        Raises ``SessionLost`` where no such session waits to be resumed (the
        client connects anew), ``PermissionDenied`` for another process or a
        wrong credential (the session goes on waiting for its own).
        """
        session = self.by_id.get(session_id)
        if session is None or session.resume_by is None:
            raise SessionLost(f"hbmd has no session {session_id} to resume: connect anew", session_id=session_id)
        offered = _digest(credential)
        known = [h for h in (session.credential_hash, session.previous_credential_hash) if h]
        # Both compared, always: how long the check takes says nothing of which one matched.
        matches = [hmac.compare_digest(offered, h) for h in known]
        if (uid, pid) != (session.uid, session.pid) or not any(matches):
            raise PermissionDenied(f"session {session_id} belongs to another process or credential")
        del self._by_token[session.token]
        session.token = secrets.token_hex(16)
        self._by_token[session.token] = session
        session.resume_by = None
        session.connected_at = self.clock.monotonic()
        return session

    def pids(self) -> dict[int, int]:
        """Each session's pid, by session id: to name the sessions that hold something."""
        return {s.session_id: s.pid for s in self.by_id.values()}

    def info_for_holder(self, buffer: Buffer[Any, Any], session: Session) -> BufferInfo:
        """``buffer``'s info as its holder ``session`` is told it: a persistent buffer's with the proof that the
        session holds its name (:attr:`BufferInfo.name_proof`), which no one else is shown."""
        info = buffer.info()
        if buffer.persistent and buffer.owner is session:
            info = dataclasses.replace(info, name_proof=self.credentials.name_proof(
                session.uid, session.session_id, session.pid, buffer.name))
        return info

    def unresumed(self, now: float, gone: Callable[[int], bool]) -> list[Session]:
        """Restored sessions whose clients did not come back in time, or whose process is ``gone`` (by pid)."""
        return [s for s in self.by_id.values() if s.resume_by is not None and (now > s.resume_by or gone(s.pid))]

    def forget(self, session: Session) -> None:
        if self.by_id.pop(session.session_id, None) is None:
            return
        self._by_token.pop(session.token, None)
        held = self.of_uid[session.uid]
        del held[session.session_id]
        if not held:
            del self.of_uid[session.uid]
        if not session.observer:
            name = session.tenant.name
            self.workers_of[name] -= 1
            if not self.workers_of[name]:
                del self.workers_of[name]

    def for_token(self, token: str) -> Session:
        session = self._by_token.get(token)
        if session is None:
            # Flagged, so that a client tells its own ended session (SessionLost) from a refusal.
            raise PermissionDenied("unknown or expired session token", token="unknown")
        return session

    @property
    def workers(self) -> list[Session]:
        """The sessions that may hold memory: every one but observers."""
        return [s for s in self.by_id.values() if not s.observer]

    @property
    def num_workers(self) -> int:
        return sum(self.workers_of.values())

    def info(self, session: Session) -> SessionInfo:
        buffers = session.buffers.values()
        reclaim = session.reclaim
        return SessionInfo(
            session_id=session.session_id,
            pid=session.pid,
            uid=session.uid,
            gid=session.gid,
            client_name=session.client_name,
            tenant=session.tenant.name,
            committed_bytes=session.committed_bytes,
            reserved_bytes=sum(b.reserved for b in buffers),
            num_buffers=len(session.buffers),
            num_chunks=sum(len(b.chunks) for b in buffers),
            connected_s=self.clock.monotonic() - session.connected_at,
            reclaim_requested_bytes=reclaim.requested_bytes if reclaim else 0,
            reclaim_released_bytes=reclaim.released_bytes if reclaim and reclaim.released_bytes is not None else -1,
            reclaim_state=reclaim.outcome(self.clock.monotonic(), self.reclaim_patience_s) if reclaim else "",
            leased_bytes=session.leased_bytes,
            resuming=session.resume_by is not None,
        )

    # reclaim

    def request_reclaim(
        self, session: Session, requested_bytes: int, reason: str, asked_at: float, demote: bool = False
    ) -> Reclaim:
        """Record a request, made at ``asked_at`` (monotonic), that ``session`` give ``requested_bytes`` back
        (``demote``: move them to the host tier); the server delivers it."""
        check_int("bytes", requested_bytes, 1, MAX_CAPACITY)
        session.reclaim = Reclaim(self._next_reclaim, requested_bytes, reason[:200], asked_at, demote=demote)
        self._next_reclaim += 1
        self.reclaims_due.append((session, session.reclaim))
        return session.reclaim

    def reclaim_answered(self, session: Session, reclaim_id: int, released_bytes: int) -> None:
        if session.reclaim is None or session.reclaim.reclaim_id != reclaim_id:
            raise NotFound(f"no reclaim request {reclaim_id} for this session", reclaim_id=reclaim_id)
        check_int("released_bytes", released_bytes, 0, MAX_CAPACITY)
        session.reclaim.released_bytes = released_bytes
        if session.reclaim.demote and released_bytes:
            session.demoted_under_pressure = True


def _digest(credential: str) -> str:
    return hashlib.sha256(credential.encode()).hexdigest()
