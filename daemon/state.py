"""The daemon's state: sessions, buffers, chunks and the budget.

Everything here is plain data and arithmetic over a :class:`Backend`; nothing
knows about sockets. Every method either completes or raises with the state
unchanged. The budget is checked in exactly one place (:meth:`State._admit`),
committed and leased bytes change in exactly one place (:meth:`State._account`),
and :meth:`State.check_invariants` says whether the books balance.

Leases: a session that asks for them is leased granules created ahead of
need (:meth:`State.top_up_lease`), charged to its tenant at once. Its client
places them in its buffers itself and says so (:meth:`State.place`), so a
commit that fits the lease costs no round trip. The lease grows when a
commit found it short, stays empty while the budget is tight, and is taken
back first under pressure: unplaced granules are asked back (a client may be
placing them at that moment, so only it can give them up); a client whose own
commit does not fit gives its whole lease back and retries.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from typing import Any, Generic

from hbmd.proto import (
    MAX_PLACED_GRANULES,
    BufferInfo,
    ChunkInfo,
    SessionInfo,
    TenantInfo,
)
from hbmd.proto.errors import (
    Conflict,
    HbmdError,
    InvalidRequest,
    NotFound,
    OutOfBudget,
    OutOfDeviceMemory,
    PermissionDenied,
    VersionMismatch,
)
from hbmd.proto.runs import backed_runs, merge_runs, prefix_offsets, subtract_runs
from hbmd.proto.units import format_bytes, round_up

from .backends import A, Backend, C
from .config import Config

log = logging.getLogger("hbmd.state")

MAX_CAPACITY = 1 << 50
"""1 PiB: more than any device, small enough that offsets never overflow."""
MAX_SEGMENTS = 1 << 16
MAX_NAME = 128
DEFAULT_LEASE_BYTES = 64 << 20
"""The most one session is leased (``--lease``): 32 granules of 2 MiB."""
LEASE_TIGHT_DIVISOR = 16
"""No lease is granted that would leave a tenant less room than a 16th of the budget."""
LEASE_TOTAL_DIVISOR = 8
"""All leases together stay within an 8th of the budget."""
LEASE_IDLE_S = 30.0
"""A lease the session has not drawn on for this long is asked back; it grows again with the next demand."""


@dataclasses.dataclass
class Chunk(Generic[C]):
    chunk_id: int
    offset: int
    size: int
    handle: C
    live: bool = True
    """False once released: a queued export of it must not happen."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-uid bounds on what costs the daemon something besides the budget: descriptors, memory, its state directory."""

    sessions_per_uid: int = 128
    persistent_buffers_per_uid: int = 64
    buffers_per_uid: int = 1024
    segments_per_uid: int = 1 << 20
    """Buffers cost no budget, but each segment costs the daemon memory to describe."""


RECLAIM_PATIENCE_S = 30.0
"""By default a reclaim request unanswered this long is reported as ignored (the session is never killed for it)."""


@dataclasses.dataclass
class Tenant:
    """Whom commits are charged to: a configured or client-declared name, else ``uid:<N>``."""

    name: str
    max_bytes: int | None = None
    guaranteed_bytes: int = 0
    used_bytes: int = 0
    holders: int = 0
    """Sessions and buffers charged to it: a tenant nobody configured goes with its last one."""

    @property
    def unmet_guarantee(self) -> int:
        return max(0, self.guaranteed_bytes - self.used_bytes)


@dataclasses.dataclass
class Reclaim:
    """The last request to a session to give memory back, and its outcome."""

    reclaim_id: int
    requested_bytes: int
    reason: str
    asked_at: float = dataclasses.field(default_factory=time.monotonic)
    released_bytes: int | None = None
    reported: bool = False
    """Whether the daemon already logged it as ignored."""

    def outcome(self, now: float, patience_s: float) -> str:
        if self.released_bytes is not None:
            return "answered"
        return "ignored" if now - self.asked_at > patience_s else "pending"


@dataclasses.dataclass
class Session:
    session_id: int
    token: str
    pid: int
    uid: int
    gid: int
    client_name: str
    tenant: Tenant
    admin: bool = False
    observer: bool = False
    connected_at: float = dataclasses.field(default_factory=time.monotonic)
    buffers: dict[int, "Buffer[Any, Any]"] = dataclasses.field(default_factory=dict)
    reading: dict[int, "Buffer[Any, Any]"] = dataclasses.field(default_factory=dict)
    """Sealed buffers this session holds a read claim on (it maps them read-only)."""
    reclaim: Reclaim | None = None
    wants_lease: bool = False
    """The client places leased granules itself (it said so in its hello)."""
    lease: dict[int, Chunk[Any]] = dataclasses.field(default_factory=dict)
    """Granules leased and not placed yet, by chunk id: sent, or queued to be sent."""
    leased_bytes: int = 0
    lease_target: int = 0
    """Granules the daemon keeps leased to it: doubles when a commit found the lease short, 0 under pressure."""
    revoking: set[int] = dataclasses.field(default_factory=set)
    """Leased chunk ids asked back and not returned yet."""
    lease_used_at: float = dataclasses.field(default_factory=time.monotonic)
    """When the session last placed leased granules or found its lease short."""


@dataclasses.dataclass
class Buffer(Generic[A, C]):
    buffer_id: int
    name: str
    persistent: bool
    shareable: bool
    owner: Session | None
    owner_uid: int
    tenant: Tenant
    capacity: int
    reserved: int
    segment_capacities: list[int]
    arena: A
    segment_sizes: list[int] = dataclasses.field(default_factory=list)
    """Committed bytes of each segment: a prefix of it."""
    segment_offsets: list[int] = dataclasses.field(default_factory=list)
    chunks: list[Chunk[C]] = dataclasses.field(default_factory=list)
    physical_bytes: int = 0
    """Bytes of ``chunks``: what the owner has mapped."""
    pending: list[Chunk[C]] = dataclasses.field(default_factory=list)
    """New chunks of a preserving defragment, until the client confirms its remap."""
    pending_bytes: int = 0
    sealed: bool = False
    """Immutable from now on: no commit, release or defragment; sessions of its user may read it at once."""
    readers: dict[int, int] = dataclasses.field(default_factory=dict)
    """Read claims on a sealed buffer: how many read-only attaches each session id holds (never 0)."""

    def __post_init__(self) -> None:
        self.segment_offsets = prefix_offsets(self.segment_capacities)
        if not self.segment_sizes:
            self.segment_sizes = [0] * len(self.segment_capacities)

    @property
    def num_segments(self) -> int:
        return len(self.segment_capacities)

    @property
    def uniform(self) -> bool:
        """Equal segments: what a client of protocol 1.0 understands."""
        return len(set(self.segment_capacities)) == 1

    @property
    def segment_capacity(self) -> int:
        """The capacity every segment has (the smallest one where they differ)."""
        return min(self.segment_capacities)

    @property
    def bytes_per_segment(self) -> int:
        """The committed prefix every segment has (the smallest one where they differ)."""
        return min(self.segment_sizes)

    def backed_runs(self, sizes: list[int], granule: int) -> list[tuple[int, int]]:
        return backed_runs(self.segment_offsets, sizes, granule)

    def info(self) -> BufferInfo:
        return BufferInfo(
            buffer_id=self.buffer_id,
            name=self.name,
            persistent=self.persistent,
            session_id=self.owner.session_id if self.owner else 0,
            owner_uid=self.owner_uid,
            capacity_bytes=self.capacity,
            reserved_bytes=self.reserved,
            num_segments=self.num_segments,
            segment_capacity_bytes=self.segment_capacity,
            bytes_per_segment=self.bytes_per_segment,
            physical_bytes=self.physical_bytes,
            num_chunks=len(self.chunks),
            segment_capacities=list(self.segment_capacities),
            segment_sizes=list(self.segment_sizes),
            sealed=self.sealed,
            readers=len(self.readers),
            shareable=self.shareable,
        )


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def _check_int(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise InvalidRequest(f"{name} {value} is out of range [{low}, {high}]", field=name, value=str(value))


class State(Generic[A, C]):
    """Sessions, buffers and the budget of one daemon instance."""

    def __init__(
        self,
        backend: Backend[A, C],
        budget_bytes: int,
        config: Config | None = None,
        reclaim_patience_s: float = RECLAIM_PATIENCE_S,
        limits: Limits = Limits(),
        lease_bytes: int = DEFAULT_LEASE_BYTES,
        lease_idle_s: float = LEASE_IDLE_S,
    ) -> None:
        """``lease_bytes``: the most one session is leased (0: no leases); ``lease_idle_s``: see :data:`LEASE_IDLE_S`."""
        self.backend = backend
        self.lease_idle_s = lease_idle_s
        self.lease_granules = max(0, lease_bytes) // backend.granularity
        self._lease_arena: A | None = None
        self.leased_bytes = 0
        self.lease_due: set[int] = set()
        """Sessions (by id) whose lease may need topping up, for the server to serve."""
        self.revokes_due: list[tuple[Session, list[int]]] = []
        """Leased chunks asked back, for the server to send."""
        self.limits = limits
        self.reclaim_patience_s = reclaim_patience_s
        self.budget_bytes = budget_bytes
        self.config = config or Config()
        self.tenants: dict[str, Tenant] = {
            t.name: Tenant(t.name, t.max_bytes, t.guaranteed_bytes) for t in self.config.tenants
        }
        self._configured = frozenset(self.tenants)
        self.changed: set[int] | None = None
        """Persistent buffers whose chunks changed since the persistence layer last synced them
        (None: nobody is tracking, and nothing is recorded)."""
        self.reclaims_due: list[tuple[Session, Reclaim]] = []
        """Reclaim requests made by the state, for the server to send."""
        self._next_reclaim = 1
        self.committed_bytes = 0
        self.sessions: dict[int, Session] = {}
        self.buffers: dict[int, Buffer[A, C]] = {}
        self._by_token: dict[str, Session] = {}
        self._persistent: dict[tuple[int, str], Buffer[A, C]] = {}
        self._next_session = 1
        self._next_buffer = 1
        self._next_chunk = 1
        self.started_at = time.monotonic()

    # sessions

    def tenant_for(self, uid: int, declared: str) -> Tenant:
        """The tenant a session of ``uid`` declaring ``declared`` (maybe empty) is charged to.

        A declared name never lifts a uid's limits. A uid with its own
        ``[[tenants]] uid = N`` entry is held to it: it may declare a
        configured name only where that name's ``uids`` lists it, and any
        other name it declares is charged to its own entry. For other uids a
        configured name is open as its ``uids`` say, and an unknown name is a
        tenant of its own without limits (as the uid's own would be).
        """
        own = f"uid:{uid}"
        if not declared:
            return self._tenant(own)
        if declared.startswith("uid:") or len(declared) > MAX_NAME or not declared.isprintable():
            raise PermissionDenied(f"tenant name {declared[:MAX_NAME]!r} is not allowed")
        limited = any(t.uid == uid for t in self.config.tenants)
        limits = next((t for t in self.config.tenants if t.name == declared and t.uid is None), None)
        if limits is None:
            return self._tenant(own if limited else declared)
        if limits.uids is not None and uid not in limits.uids:
            raise PermissionDenied(f"uid {uid} may not declare tenant {declared!r}")
        if limited and limits.uids is None:
            raise PermissionDenied(
                f"uid {uid} is held to its own tenant {own!r}; tenant {declared!r} would need to list it in uids"
            )
        return self._tenant(declared)

    def _tenant(self, name: str) -> Tenant:
        return self.tenants.setdefault(name, Tenant(name))

    def _hold(self, tenant: Tenant) -> None:
        tenant.holders += 1

    def _let_go(self, tenant: Tenant) -> None:
        """One holder fewer; an unconfigured tenant left without any is forgotten (names must not pile up)."""
        tenant.holders -= 1
        if tenant.holders == 0 and tenant.name not in self._configured:
            del self.tenants[tenant.name]

    def open_session(
        self,
        pid: int,
        uid: int,
        gid: int,
        client_name: str,
        tenant: str,
        admin: bool = False,
        observer: bool = False,
        lease: bool = False,
    ) -> Session:
        """Raises ``Conflict`` (retryable) when ``uid`` already has its :attr:`Limits.sessions_per_uid`."""
        open_sessions = sum(1 for s in self.sessions.values() if s.uid == uid)
        if open_sessions >= self.limits.sessions_per_uid:
            raise Conflict(
                f"uid {uid} already has {open_sessions} sessions, the most allowed (--max-sessions-per-uid)",
                uid=uid, limit=self.limits.sessions_per_uid,
            )
        session = Session(
            self._next_session,
            secrets.token_hex(16),
            pid,
            uid,
            gid,
            client_name[:MAX_NAME],
            self.tenant_for(uid, tenant),
            admin,
            observer,
            wants_lease=lease and not observer and self.lease_granules > 0,
        )
        self._hold(session.tenant)
        self._next_session += 1
        self.sessions[session.session_id] = session
        self._by_token[session.token] = session
        return session

    @property
    def workers(self) -> list[Session]:
        """The sessions that may hold memory: every one but observers."""
        return [s for s in self.sessions.values() if not s.observer]

    def session_for(self, token: str) -> Session:
        session = self._by_token.get(token)
        if session is None:
            # Flagged, so that a client tells its own ended session (SessionLost) from a refusal.
            raise PermissionDenied("unknown or expired session token", token="unknown")
        return session

    def close_session(self, session: Session) -> int:
        """End a session: free its anonymous buffers, orphan its persistent ones. Returns the bytes freed.

        A persistent buffer caught mid-defragment keeps its old chunks, the
        ones holding the data: the unconfirmed new ones are dropped.
        """
        freed = 0
        self._drop_lease(session)
        self.lease_due.discard(session.session_id)
        for buffer in list(session.reading.values()):
            buffer.readers.pop(session.session_id, None)
        session.reading.clear()
        for buffer in list(session.buffers.values()):
            if buffer.persistent:
                freed += self._drop_pending(buffer)
                self._disown(buffer)
            else:
                freed += self._drop(buffer)
        self.sessions.pop(session.session_id, None)
        self._by_token.pop(session.token, None)
        self._let_go(session.tenant)
        return freed

    # buffers

    def create_buffer(
        self,
        session: Session,
        capacity: int,
        num_segments: int,
        name: str = "",
        persistent: bool = False,
        shareable: bool = False,
        segment_capacities: list[int] | None = None,
    ) -> Buffer[A, C]:
        """A buffer of ``num_segments`` equal segments, or of the uneven ``segment_capacities`` (summing to ``capacity``)."""
        self._check_not_observer(session)
        _check_int("capacity", capacity, 1, MAX_CAPACITY)
        if segment_capacities:
            _check_int("len(segment_capacities)", len(segment_capacities), 1, MAX_SEGMENTS)
            if min(segment_capacities) <= 0 or sum(segment_capacities) != capacity:
                raise InvalidRequest(
                    f"segment_capacities must be positive and sum to the capacity {capacity}",
                    field="segment_capacities",
                )
        else:
            _check_int("num_segments", num_segments, 1, min(MAX_SEGMENTS, capacity))
            if capacity % num_segments:
                raise InvalidRequest(
                    f"capacity {capacity} is not divisible by num_segments {num_segments}",
                    field="num_segments",
                )
            segment_capacities = [capacity // num_segments] * num_segments
        if len(name) > MAX_NAME or not name.isprintable():
            raise InvalidRequest(f"buffer name must be at most {MAX_NAME} printable characters", field="name")
        self._check_buffers_of(session.uid, len(segment_capacities))
        if persistent:
            if not name:
                raise InvalidRequest("a persistent buffer needs a name", field="name")
            existing = self._persistent.get((session.uid, name))
            if existing is not None:
                raise Conflict(
                    f"a persistent buffer named {name!r} already exists; attach to it or delete it",
                    buffer_id=existing.buffer_id,
                )
            held = sum(1 for uid, _ in self._persistent if uid == session.uid)
            if held >= self.limits.persistent_buffers_per_uid:
                raise OutOfBudget(
                    f"uid {session.uid} already has {held} persistent buffers, the most allowed "
                    "(--max-persistent-per-uid); delete one it no longer needs",
                    uid=session.uid, limit=self.limits.persistent_buffers_per_uid,
                )
        reserved = round_up(capacity, self.backend.granularity)
        arena = self.backend.open_arena(reserved, shareable)
        buffer = Buffer(
            buffer_id=self._next_buffer,
            name=name,
            persistent=persistent,
            shareable=shareable,
            owner=session,
            owner_uid=session.uid,
            tenant=session.tenant,
            capacity=capacity,
            reserved=reserved,
            segment_capacities=list(segment_capacities),
            arena=arena,
        )
        self._hold(buffer.tenant)
        self._next_buffer += 1
        self.buffers[buffer.buffer_id] = buffer
        session.buffers[buffer.buffer_id] = buffer
        if persistent:
            self._persistent[(session.uid, name)] = buffer
            self._mark_changed(buffer)
        return buffer

    def _check_buffers_of(self, uid: int, new_segments: int) -> None:
        """Refuse a buffer past the uid's :attr:`Limits.buffers_per_uid` or :attr:`Limits.segments_per_uid`."""
        held = [b for b in self.buffers.values() if b.owner_uid == uid]
        segments = sum(b.num_segments for b in held)
        if len(held) >= self.limits.buffers_per_uid or segments + new_segments > self.limits.segments_per_uid:
            raise OutOfBudget(
                f"uid {uid} already holds {len(held)} buffers of {segments} segments; at most "
                f"{self.limits.buffers_per_uid} buffers (--max-buffers-per-uid) of {self.limits.segments_per_uid} "
                "segments in all: free one it no longer needs",
                uid=uid, limit=self.limits.buffers_per_uid,
            )

    def adopt_buffer(
        self,
        buffer_id: int,
        name: str,
        owner_uid: int,
        tenant: str,
        capacity: int,
        segment_capacities: list[int],
        segment_sizes: list[int],
        shareable: bool,
        arena: A,
        chunks: list[Chunk[C]],
        sealed: bool = False,
    ) -> Buffer[A, C]:
        """Bring back an orphaned persistent buffer after a restart; its memory counts whatever the budget."""
        buffer = Buffer(
            buffer_id=buffer_id,
            name=name,
            persistent=True,
            shareable=shareable,
            owner=None,
            owner_uid=owner_uid,
            tenant=self._tenant(tenant),
            capacity=capacity,
            reserved=round_up(capacity, self.backend.granularity),
            segment_capacities=segment_capacities,
            arena=arena,
            segment_sizes=segment_sizes,
            chunks=chunks,
            sealed=sealed,
        )
        self._hold(buffer.tenant)
        self.buffers[buffer_id] = buffer
        self._persistent[(owner_uid, name)] = buffer
        self._account(buffer, mapped=sum(c.size for c in chunks))
        self._next_buffer = max(self._next_buffer, buffer_id + 1)
        self._next_chunk = max([self._next_chunk] + [c.chunk_id + 1 for c in chunks])
        return buffer

    def attach(self, session: Session, name: str, uneven_ok: bool = True) -> Buffer[A, C]:
        """Give an orphaned persistent buffer of the session's user to the session.

        Names are per user: another user's buffer of the same name is not found.
        A client that cannot read uneven segments (``uneven_ok`` False) is
        refused such a buffer rather than handed a layout it would misread.
        """
        self._check_not_observer(session)
        buffer = self._orphan(session.uid, name)
        if not (uneven_ok or buffer.uniform):
            raise VersionMismatch(
                f"persistent buffer {name!r} has uneven segments: attaching it needs an hbmd client of protocol 1.1 or later"
            )
        buffer.owner = session
        session.buffers[buffer.buffer_id] = buffer
        return buffer

    def seal(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        """Make the session's persistent buffer immutable, so that any session of its user may read it at once.

        Sealing a sealed buffer changes nothing. An anonymous buffer ends with
        its session, so there is nothing for others to read: refused; so is a
        buffer mid-defragment, whose chunks are about to change.
        """
        buffer = self.buffer_of(session, buffer_id)
        if buffer.sealed:
            return buffer
        if not buffer.persistent:
            raise InvalidRequest(
                f"buffer {buffer_id} is anonymous: only a persistent buffer can be sealed and read by others",
                buffer_id=buffer_id,
            )
        if buffer.pending:
            raise Conflict(f"buffer {buffer_id} is being defragmented", buffer_id=buffer_id)
        buffer.sealed = True
        self._mark_changed(buffer)
        return buffer

    def attach_reader(self, session: Session, name: str, uneven_ok: bool = True) -> Buffer[A, C]:
        """Add a read claim of the session on its user's sealed buffer ``name``, beside its owner and other readers.

        An unsealed buffer can change under a reader: refused. The claim is
        dropped by :meth:`detach_reader` or when the session ends; readers
        are never charged for the buffer's memory.
        """
        self._check_not_observer(session)
        buffer = self._named(session.uid, name)
        if not buffer.sealed:
            raise InvalidRequest(
                f"persistent buffer {name!r} is not sealed: only a sealed buffer can be attached read-only",
                buffer_id=buffer.buffer_id,
            )
        if not (uneven_ok or buffer.uniform):
            raise VersionMismatch(
                f"persistent buffer {name!r} has uneven segments: attaching it needs an hbmd client of protocol 1.1 or later"
            )
        buffer.readers[session.session_id] = buffer.readers.get(session.session_id, 0) + 1
        session.reading[buffer.buffer_id] = buffer
        return buffer

    def detach_reader(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        """Drop one read claim of the session on sealed buffer ``buffer_id``."""
        buffer = session.reading.get(buffer_id)
        if buffer is None:
            raise NotFound(f"this session does not read buffer {buffer_id}", buffer_id=buffer_id)
        claims = buffer.readers[session.session_id] - 1
        if claims:
            buffer.readers[session.session_id] = claims
        else:
            del buffer.readers[session.session_id]
            del session.reading[buffer_id]
        return buffer

    def detach(self, session: Session, buffer_id: int) -> int:
        """Let go of the session's persistent buffer: it stays, an orphan with its chunks, until attached by name.

        Mid-defragment the old chunks stay (they hold the data, as when the
        session ends) and the unconfirmed new ones are dropped; returns their
        bytes. An anonymous buffer has no name to come back by: refused.
        """
        buffer = self.buffer_of(session, buffer_id)
        if not buffer.persistent:
            raise InvalidRequest(
                f"buffer {buffer_id} is anonymous: only a persistent buffer can be detached and attached again",
                buffer_id=buffer_id,
            )
        freed = self._drop_pending(buffer)
        self._disown(buffer)
        return freed

    def delete(self, session: Session, name: str, owner_uid: int = -1) -> tuple[int, int]:
        """Free an orphaned persistent buffer by name: the session's user's, or for an admin ``owner_uid``'s.

        Returns its id and the bytes freed.
        """
        _check_int("owner_uid", owner_uid, -1, (1 << 32) - 1)
        uid = session.uid if owner_uid == -1 else owner_uid
        if uid != session.uid and not session.admin:
            raise PermissionDenied("only an admin may delete another user's persistent buffer")
        buffer = self._orphan(uid, name)
        self._check_unread(buffer)
        return buffer.buffer_id, self._drop(buffer)

    def _check_unread(self, buffer: Buffer[A, C]) -> None:
        """Refuse to drop a sealed buffer that sessions still read.

        Their mappings would keep the pages alive outside the budget (and
        the daemon's books), so the buffer goes only once its readers have
        let go: they detach or end.
        """
        if not buffer.readers:
            return
        readers = sorted(buffer.readers)
        named = ", ".join(
            f"{session_id} (pid {self.sessions[session_id].pid})" if session_id in self.sessions else str(session_id)
            for session_id in readers
        )
        raise Conflict(
            f"sealed buffer {buffer.name!r} is read by session{'s' if len(readers) > 1 else ''} {named}; "
            "it can be deleted once they detach or end",
            buffer_id=buffer.buffer_id,
            session_id=readers[0],
            readers=",".join(map(str, readers)),
        )

    @staticmethod
    def _check_not_observer(session: Session) -> None:
        if session.observer:
            raise PermissionDenied("an observer session holds no memory; connect without observer=True")

    def _orphan(self, uid: int, name: str) -> Buffer[A, C]:
        """The persistent buffer ``name`` of ``uid``, refused while a live session holds it."""
        buffer = self._named(uid, name)
        if buffer.owner is not None:
            raise Conflict(
                f"persistent buffer {name!r} is attached by session {buffer.owner.session_id} "
                f"(pid {buffer.owner.pid}); it is free once that session ends",
                session_id=buffer.owner.session_id,
            )
        return buffer

    def _named(self, uid: int, name: str) -> Buffer[A, C]:
        if len(name) > MAX_NAME:
            raise InvalidRequest(f"buffer names have at most {MAX_NAME} characters", field="name")
        buffer = self._persistent.get((uid, name))
        if buffer is None:
            raise NotFound(f"no persistent buffer named {name!r} for uid {uid}", name=name)
        return buffer

    def buffer_of(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        """The session's own buffer ``buffer_id``; another session's is answered as one that does not exist.

        So a stranger trying ids learns nothing of what others hold.
        """
        buffer = self.buffers.get(buffer_id)
        if buffer is None or buffer.owner is not session:
            raise NotFound(f"no buffer {buffer_id} in this session", buffer_id=buffer_id)
        return buffer

    def commit(self, session: Session, buffer_id: int, sizes: int | list[int]) -> list[Chunk[C]]:
        """Grow each segment's committed prefix to ``sizes[i]`` (an int: the same for all); returns the new chunks.

        One chunk per maximal run of uncommitted granules, in offset order.
        The whole growth fits the budget or nothing is allocated.
        """
        buffer = self._idle_buffer(session, buffer_id)
        if isinstance(sizes, int):
            sizes = [sizes] * buffer.num_segments
        self._check_sizes(buffer, sizes)
        granule = self.backend.granularity
        runs = subtract_runs(buffer.backed_runs(sizes, granule), buffer.backed_runs(buffer.segment_sizes, granule))
        created = self._create_runs(buffer, runs, "commit")
        buffer.chunks.extend(created)
        buffer.segment_sizes = list(sizes)
        self._account(buffer, mapped=sum(c.size for c in created))
        self._note_demand(session, created)
        return created

    def _check_sizes(self, buffer: Buffer[A, C], sizes: list[int]) -> None:
        """Refuse segment sizes that are not one per segment, within capacity and grow-only."""
        if len(sizes) != buffer.num_segments:
            raise InvalidRequest(f"expected {buffer.num_segments} segment sizes, got {len(sizes)}", field="sizes")
        for index, (size, old, capacity) in enumerate(zip(sizes, buffer.segment_sizes, buffer.segment_capacities)):
            if size < 0:
                raise InvalidRequest(f"segment {index}: size {size} is negative", field="bytes_per_segment")
            if size > capacity:
                raise InvalidRequest(
                    f"segment {index}: {size} bytes exceeds the segment capacity of {capacity} bytes",
                    field="bytes_per_segment",
                )
            if size < old:
                raise InvalidRequest(
                    f"buffers are grow-only: segment {index} has {old} bytes committed, asked for {size}",
                    field="bytes_per_segment",
                )

    def defragment(self, session: Session, buffer_id: int, preserve: bool) -> list[Chunk]:
        """Re-back each run of the committed prefixes with one chunk; returns the new chunks.

        ``preserve``: the new chunks are created beside the old ones (the
        budget must hold both) and stay pending until :meth:`finish_defragment`,
        so a client that dies mid-way loses nothing. Otherwise the old chunks
        are released first: the caller has unmapped them and drops the data.
        Where every run already is one chunk nothing changes: a preserving
        defragment returns ``[]``, a discarding one the chunks as they are
        (the caller unmapped them and maps them again).
        """
        buffer = self._idle_buffer(session, buffer_id)
        runs = buffer.backed_runs(buffer.segment_sizes, self.backend.granularity)
        if len(buffer.chunks) == len(runs):
            return [] if preserve else buffer.chunks
        if preserve:
            buffer.pending = self._create_runs(buffer, runs, "defragment (old and new chunks coexist until the copy is done)")
            self._account(buffer, pending=sum(c.size for c in buffer.pending))
            return buffer.pending
        self._drop_mapped(buffer)
        try:
            buffer.chunks = self._create_runs(buffer, runs, "defragment")
        except BaseException:
            buffer.segment_sizes = [0] * buffer.num_segments  # the old pages are gone: the buffer is released
            raise
        self._account(buffer, mapped=sum(c.size for c in buffer.chunks))
        return buffer.chunks

    def finish_defragment(self, session: Session, buffer_id: int, keep_new: bool) -> int:
        """Swap in the pending chunks (``keep_new``) or drop them; returns the bytes freed."""
        buffer = self.buffer_of(session, buffer_id)
        if not buffer.pending:
            raise InvalidRequest(f"buffer {buffer_id} has no defragment in progress", buffer_id=buffer_id)
        if not keep_new:
            return self._drop_pending(buffer)
        freed = self._drop_mapped(buffer)
        buffer.chunks, buffer.pending = buffer.pending, []
        self._account(buffer, mapped=buffer.pending_bytes, pending=-buffer.pending_bytes)
        return freed

    def _idle_buffer(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        """The session's buffer, to change: refused while sealed or mid-defragment."""
        buffer = self.buffer_of(session, buffer_id)
        if buffer.sealed:
            raise InvalidRequest(
                f"buffer {buffer_id} ({buffer.name!r}) is sealed: it is immutable, no commit, release or defragment",
                buffer_id=buffer_id,
            )
        if buffer.pending:
            raise Conflict(f"buffer {buffer_id} is being defragmented", buffer_id=buffer_id)
        return buffer

    def _create_runs(self, buffer: Buffer[A, C], runs: list[tuple[int, int]], purpose: str) -> list[Chunk[C]]:
        """One new chunk per run, admitted as a whole; none on any failure. The caller accounts for them."""
        requested = sum(end - start for start, end in runs)
        self._admit_asking_back_leases(buffer, requested, purpose)
        created: list[Chunk[C]] = []
        try:
            for start, end in runs:
                handle = self.backend.create(buffer.arena, start, end - start)
                created.append(Chunk(self._next_chunk, start, end - start, handle))
                self._next_chunk += 1
        except BaseException as exc:
            for chunk in created:
                self._release_chunk(buffer, chunk)
            guaranteed = buffer.tenant.used_bytes + requested <= buffer.tenant.guaranteed_bytes
            if isinstance(exc, OutOfDeviceMemory) and guaranteed:
                self._reclaim_for(buffer.tenant, requested)
            raise
        return created

    def admissible_bytes(self, tenant: Tenant) -> int:
        """The most a commit charged to ``tenant`` would be admitted for now: what :meth:`_admit` allows."""
        held = sum(t.unmet_guarantee for t in self.tenants.values() if t is not tenant)
        room = self.budget_bytes - self.committed_bytes - self.leased_bytes - held
        if tenant.max_bytes is not None:
            room = min(room, tenant.max_bytes - tenant.used_bytes)
        return max(0, room)

    def _admit(self, tenant: Tenant, requested: int, purpose: str) -> None:
        """The one place a commit is checked against the tenant's maximum, the budget and others' guarantees."""
        if tenant.max_bytes is not None and tenant.used_bytes + requested > tenant.max_bytes:
            raise OutOfBudget(
                f"{purpose} of {format_bytes(requested)} exceeds the budget of tenant {tenant.name!r}: "
                f"max {format_bytes(tenant.max_bytes)}, used {format_bytes(tenant.used_bytes)}, "
                f"requested {format_bytes(requested)}",
                tenant=tenant.name,
                budget=tenant.max_bytes,
                used=tenant.used_bytes,
                requested=requested,
            )
        held = sum(t.unmet_guarantee for t in self.tenants.values() if t is not tenant)
        used = self.committed_bytes + self.leased_bytes
        if used + requested + held > self.budget_bytes:
            extra = f", {format_bytes(held)} held for other tenants' guaranteed minimums" if held else ""
            if self.leased_bytes:
                extra += f", {format_bytes(self.leased_bytes)} of it leased (being asked back: retry)"
            raise OutOfBudget(
                f"{purpose} of {format_bytes(requested)} does not fit the budget: "
                f"budget {format_bytes(self.budget_bytes)}, used {format_bytes(used)}, "
                f"requested {format_bytes(requested)}{extra}",
                budget=self.budget_bytes,
                used=used,
                requested=requested,
                held=held,
            )

    # leases

    def _admit_asking_back_leases(self, buffer: Buffer[A, C], requested: int, purpose: str) -> None:
        """:meth:`_admit`; a refusal asks other sessions for their unplaced granules, and says to retry.

        The owner's own lease is left to its client, which holds it: a
        client whose commit does not fit gives its lease back itself and
        retries (its lease counts as room in :meth:`admissible_for`).
        """
        try:
            self._admit(buffer.tenant, requested, purpose)
        except OutOfBudget:
            self._ask_back_leases(buffer.owner)
            raise

    def lease_bytes_for(self, session: Session) -> int:
        """The most ``session`` may be leased: 0 unless it asked for leases."""
        return self.lease_granules * self.backend.granularity if session.wants_lease else 0

    def admissible_for(self, session: Session) -> int:
        """What a commit of ``session`` would be admitted for now: its own lease counts as room (it is given up for it)."""
        return self.admissible_bytes(session.tenant) + session.leased_bytes

    def _note_demand(self, session: Session, created: list[Chunk[C]]) -> None:
        """A commit that made ``created`` came through the daemon: where a lease could have served it, the lease was
        short, so it grows (up to the most allowed).

        A lease serves commits of runs of one granule, :data:`MAX_PLACED_GRANULES` at most.
        """
        granule = self.backend.granularity
        count = len(created)
        if session.wants_lease and 0 < count <= min(self.lease_granules, MAX_PLACED_GRANULES) and all(
            c.size == granule for c in created
        ):
            session.lease_target = min(self.lease_granules, max(2 * session.lease_target, 2 * count))
            session.lease_used_at = time.monotonic()
            self.lease_due.add(session.session_id)

    def top_up_lease(self, session: Session) -> list[Chunk[C]]:
        """Create granules to bring the session's lease up to its target; the server sends them.

        None while the tenant's room would drop below a 16th of the budget,
        all leases together would pass an 8th of it, or the device is short.
        """
        granule = self.backend.granularity
        wanted = session.lease_target - len(session.lease)
        room = self.admissible_bytes(session.tenant) - self.budget_bytes // LEASE_TIGHT_DIVISOR
        total_room = self.budget_bytes // LEASE_TOTAL_DIVISOR - self.leased_bytes
        count = min(wanted, room // granule, total_room // granule)
        if count <= 0 or session.revoking:
            return []
        if self._lease_arena is None:
            self._lease_arena = self.backend.open_arena(granule, False)
        created: list[Chunk[C]] = []
        for _ in range(count):
            try:
                handle = self.backend.create(self._lease_arena, 0, granule)
            except (HbmdError, OSError) as exc:
                log.debug("lease for session %d stopped at %d granules: %s", session.session_id, len(created), exc)
                break
            chunk = Chunk(self._next_chunk, 0, granule, handle)
            self._next_chunk += 1
            session.lease[chunk.chunk_id] = chunk
            created.append(chunk)
        self._account(session=session, leased=len(created) * granule)
        return created

    def place(self, session: Session, buffer_id: int, sizes: list[int], chunk_ids: list[int], offsets: list[int]) -> Buffer[A, C]:
        """Leased granules now back the session's buffer, which grows to ``sizes``: what the client mapped.

        The granules must be exactly the ones the growth needs, each a chunk
        of the session's lease; otherwise nothing changes.
        """
        buffer = self._idle_buffer(session, buffer_id)
        if buffer.shareable:
            raise InvalidRequest(f"buffer {buffer_id} is shareable: leased granules are plain ones", buffer_id=buffer_id)
        self._check_sizes(buffer, sizes)
        granule = self.backend.granularity
        runs = subtract_runs(buffer.backed_runs(sizes, granule), buffer.backed_runs(buffer.segment_sizes, granule))
        # Counted before any list of granules is made: a peer's sizes may claim a petabyte.
        if sum(end - start for start, end in runs) != len(chunk_ids) * granule:
            raise InvalidRequest(
                f"buffer {buffer_id}: the growth to {sizes[:8]} needs {sum(e - s for s, e in runs) // granule} granules, "
                f"{len(chunk_ids)} were placed",
                buffer_id=buffer_id,
            )
        needed = [start for begin, end in runs for start in range(begin, end, granule)]
        if len(chunk_ids) != len(offsets) or sorted(offsets) != needed:
            raise InvalidRequest(
                f"buffer {buffer_id}: the growth to {sizes[:8]} needs granules at {needed[:8]}, got {sorted(offsets)[:8]}",
                buffer_id=buffer_id,
            )
        if len(set(chunk_ids)) != len(chunk_ids) or not all(c in session.lease for c in chunk_ids):
            raise InvalidRequest(f"buffer {buffer_id}: chunks {chunk_ids[:8]} are not all leased to this session")
        placed = []
        for chunk_id, offset in zip(chunk_ids, offsets):
            chunk = session.lease.pop(chunk_id)
            chunk.offset = offset
            placed.append(chunk)
        session.revoking.difference_update(chunk_ids)
        buffer.chunks.extend(placed)
        buffer.segment_sizes = list(sizes)
        placed_bytes = sum(c.size for c in placed)
        self._account(session=session, leased=-placed_bytes)
        self._account(buffer, mapped=placed_bytes)
        if placed:
            session.lease_used_at = time.monotonic()
            self.lease_due.add(session.session_id)
        return buffer

    def return_lease(self, session: Session, chunk_ids: list[int]) -> list[int]:
        """The client gave these leased chunks up; those still in its lease are released (others are ignored)."""
        return self._drop_lease(session, [c for c in dict.fromkeys(chunk_ids) if c in session.lease])

    def committed_by(self, tenant: Tenant) -> int:
        """What ``tenant`` holds in buffers: its use less its sessions' leases."""
        return tenant.used_bytes - sum(s.leased_bytes for s in self.sessions.values() if s.tenant is tenant)

    def ask_back_all_leases(self) -> None:
        self._ask_back_leases(None)

    def _ask_back_leases(self, requester: Session | None) -> None:
        """Budget pressure: ask every other session for its unplaced granules, and lease them none until they commit again."""
        for session in self.sessions.values():
            if session is not requester:
                self.ask_back_lease(session)

    def ask_back_idle_leases(self, now: float) -> None:
        """Ask back the leases their sessions have not drawn on for :attr:`lease_idle_s`: demand went elsewhere."""
        for session in self.sessions.values():
            if session.lease and not session.revoking and now - session.lease_used_at > self.lease_idle_s:
                self.ask_back_lease(session)

    def ask_back_lease(self, session: Session) -> None:
        session.lease_target = 0
        asked = [c for c in session.lease if c not in session.revoking]
        if asked:
            session.revoking.update(asked)
            self.revokes_due.append((session, asked))

    def _drop_lease(self, session: Session, chunk_ids: list[int] | None = None) -> list[int]:
        """Release leased chunks (all by default); returns their ids."""
        chunk_ids = list(session.lease) if chunk_ids is None else chunk_ids
        for chunk_id in chunk_ids:
            self._release_chunk_handle(session.lease.pop(chunk_id), self._lease_arena)
        session.revoking.difference_update(chunk_ids)
        self._account(session=session, leased=-len(chunk_ids) * self.backend.granularity)
        return chunk_ids

    # reclaim

    def request_reclaim(self, session: Session, requested_bytes: int, reason: str) -> Reclaim:
        """Record a request that ``session`` give ``requested_bytes`` back; the server delivers it."""
        _check_int("bytes", requested_bytes, 1, MAX_CAPACITY)
        self.ask_back_lease(session)
        session.reclaim = Reclaim(self._next_reclaim, requested_bytes, reason[:200])
        self._next_reclaim += 1
        self.reclaims_due.append((session, session.reclaim))
        return session.reclaim

    def reclaim_answered(self, session: Session, reclaim_id: int, released_bytes: int) -> None:
        if session.reclaim is None or session.reclaim.reclaim_id != reclaim_id:
            raise NotFound(f"no reclaim request {reclaim_id} for this session", reclaim_id=reclaim_id)
        _check_int("released_bytes", released_bytes, 0, MAX_CAPACITY)
        session.reclaim.released_bytes = released_bytes

    def _reclaim_for(self, tenant: Tenant, needed: int) -> None:
        """Ask sessions of tenants above their guarantee for memory a guaranteed tenant could not get, leases first."""
        for session in self.sessions.values():
            if session.tenant is not tenant:
                self.ask_back_lease(session)
        for other in self.tenants.values():
            excess = other.used_bytes - other.guaranteed_bytes
            if other is tenant or excess <= 0:
                continue
            for session in self.sessions.values():
                held = sum(b.physical_bytes for b in session.buffers.values())
                if session.tenant is not other or held == 0 or needed <= 0:
                    continue
                ask = min(excess, held, needed)
                self.request_reclaim(session, ask, f"tenant {tenant.name!r} needs its guaranteed minimum")
                needed -= ask
                excess -= ask

    def release(self, session: Session, buffer_id: int) -> int:
        """Drop every chunk, keep the reservation. Returns the bytes freed."""
        return self._release_all(self._idle_buffer(session, buffer_id))

    def free(self, session: Session, buffer_id: int) -> int:
        """Drop the buffer (a sealed one only once nobody reads it). Returns the bytes freed."""
        buffer = self.buffer_of(session, buffer_id)
        self._check_unread(buffer)
        return self._drop(buffer)

    def chunk_info(self, buffer: Buffer[A, C], chunk: Chunk[C]) -> ChunkInfo:
        return ChunkInfo(chunk.chunk_id, chunk.offset, chunk.size, self.backend.handle_offset(buffer.arena, chunk.handle))

    def export(self, buffer: Buffer[A, C] | None, chunk: Chunk[C]) -> int:
        """A new FD for a buffer's chunk, or (``buffer`` None) a leased one."""
        return self.backend.export(buffer.arena if buffer is not None else self._lease_arena, chunk.handle)

    # inspection

    def session_info(self, session: Session) -> SessionInfo:
        buffers = session.buffers.values()
        return SessionInfo(
            session_id=session.session_id,
            pid=session.pid,
            uid=session.uid,
            gid=session.gid,
            client_name=session.client_name,
            tenant=session.tenant.name,
            committed_bytes=sum(b.physical_bytes for b in buffers),
            reserved_bytes=sum(b.reserved for b in buffers),
            num_buffers=len(session.buffers),
            num_chunks=sum(len(b.chunks) for b in buffers),
            connected_s=time.monotonic() - session.connected_at,
            reclaim_requested_bytes=session.reclaim.requested_bytes if session.reclaim else 0,
            reclaim_released_bytes=(
                session.reclaim.released_bytes
                if session.reclaim and session.reclaim.released_bytes is not None
                else -1
            ),
            reclaim_state=session.reclaim.outcome(time.monotonic(), self.reclaim_patience_s) if session.reclaim else "",
            leased_bytes=session.leased_bytes,
        )

    def tenant_infos(self, uid: int | None = None) -> list[TenantInfo]:
        """Every tenant by name, or with ``uid`` only those its sessions and buffers are charged to."""
        counts: dict[str, int] = {}
        for session in self.workers:
            counts[session.tenant.name] = counts.get(session.tenant.name, 0) + 1
        tenants = self.tenants.values()
        if uid is not None:
            names = {s.tenant.name for s in self.sessions.values() if s.uid == uid}
            names |= {b.tenant.name for b in self.buffers.values() if b.owner_uid == uid}
            tenants = [t for t in tenants if t.name in names]
        return [
            TenantInfo(t.name, t.used_bytes, t.guaranteed_bytes, -1 if t.max_bytes is None else t.max_bytes, counts.get(t.name, 0))
            for t in sorted(tenants, key=lambda t: t.name)
        ]

    @property
    def reserved_bytes(self) -> int:
        return sum(b.reserved for b in self.buffers.values())

    @property
    def num_chunks(self) -> int:
        return sum(len(b.chunks) for b in self.buffers.values())

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first thing that does not add up.

        Committed bytes equal the sum of chunk sizes, leased bytes the sum of
        the sessions' leased granules, and both the sum of tenant usage; each
        buffer's chunks lie inside it, on granule boundaries, never back a
        granule twice and back exactly its committed prefixes (a preserving
        defragment's pending chunks likewise, on their own); every buffer and
        session points at the other, readers included; only a persistent
        buffer is sealed, and only a sealed one has readers.
        """
        granule = self.backend.granularity
        chunk_ids: set[int] = set()
        total = 0
        for buffer in self.buffers.values():
            wanted = buffer.backed_runs(buffer.segment_sizes, granule)
            for label, chunks, accounted in (
                ("chunks", buffer.chunks, buffer.physical_bytes),
                ("pending chunks", buffer.pending, buffer.pending_bytes),
            ):
                where = f"buffer {buffer.buffer_id} {label}"
                _require(sum(c.size for c in chunks) == accounted, f"{where}: sizes do not add up to {accounted}")
                end = 0
                for chunk in sorted(chunks, key=lambda c: c.offset):
                    _require(chunk.chunk_id not in chunk_ids, f"{where}: chunk id {chunk.chunk_id} used twice")
                    chunk_ids.add(chunk.chunk_id)
                    _require(chunk.size > 0 and chunk.offset % granule == 0 and chunk.size % granule == 0,
                             f"{where}: chunk {chunk.chunk_id} is not whole granules")
                    _require(chunk.offset >= end, f"{where}: chunk {chunk.chunk_id} backs a granule twice")
                    _require(chunk.offset + chunk.size <= buffer.reserved, f"{where}: chunk {chunk.chunk_id} lies outside")
                    end = chunk.offset + chunk.size
                if chunks or label == "chunks":
                    covered = merge_runs((c.offset, c.offset + c.size) for c in chunks)
                    _require(covered == wanted, f"{where} cover {covered}, not the committed prefixes {wanted}")
            total += buffer.physical_bytes + buffer.pending_bytes
            if buffer.owner is not None:
                _require(buffer.owner.buffers.get(buffer.buffer_id) is buffer, f"buffer {buffer.buffer_id}: owner lost it")
                _require(self.sessions.get(buffer.owner.session_id) is buffer.owner, f"buffer {buffer.buffer_id}: owner ended")
            else:
                _require(buffer.persistent, f"anonymous buffer {buffer.buffer_id} has no owner")
            if buffer.persistent:
                named = self._persistent.get((buffer.owner_uid, buffer.name))
                _require(named is buffer, f"persistent buffer {buffer.buffer_id} is not found by its name")
            _require(buffer.persistent or not buffer.sealed, f"anonymous buffer {buffer.buffer_id} is sealed")
            _require(buffer.sealed or not buffer.readers, f"unsealed buffer {buffer.buffer_id} has readers")
            _require(not (buffer.sealed and buffer.pending), f"sealed buffer {buffer.buffer_id} is mid-defragment")
            for session_id, claims in buffer.readers.items():
                reader = self.sessions.get(session_id)
                _require(claims > 0, f"buffer {buffer.buffer_id}: session {session_id} holds {claims} read claims")
                _require(reader is not None, f"buffer {buffer.buffer_id}: reader session {session_id} ended")
                _require(reader.reading.get(buffer.buffer_id) is buffer, f"buffer {buffer.buffer_id}: reader {session_id} lost it")
        _require(len(self._persistent) == sum(b.persistent for b in self.buffers.values()), "stale persistent names")
        for session in self.sessions.values():
            for buffer in session.buffers.values():
                _require(self.buffers.get(buffer.buffer_id) is buffer, f"session {session.session_id} holds a dropped buffer")
            for buffer in session.reading.values():
                _require(self.buffers.get(buffer.buffer_id) is buffer, f"session {session.session_id} reads a dropped buffer")
                _require(session.session_id in buffer.readers, f"session {session.session_id} reads {buffer.buffer_id} unrecorded")
        _require(self.committed_bytes == total, f"committed {self.committed_bytes} != {total} in chunks")
        leased = 0
        for session in self.sessions.values():
            where = f"session {session.session_id} lease"
            for chunk_id, chunk in session.lease.items():
                _require(chunk_id == chunk.chunk_id and chunk_id not in chunk_ids, f"{where}: chunk {chunk_id} used twice")
                chunk_ids.add(chunk_id)
                _require(chunk.live and chunk.size == granule, f"{where}: chunk {chunk_id} is not a live granule")
            _require(session.leased_bytes == granule * len(session.lease), f"{where}: {session.leased_bytes} bytes")
            _require(session.revoking <= set(session.lease), f"{where}: asked back for chunks it does not hold")
            _require(session.wants_lease or not session.lease, f"{where}: leased without asking")
            leased += session.leased_bytes
        _require(self.leased_bytes == leased, f"leased {self.leased_bytes} != {leased} in sessions' leases")
        used = sum(t.used_bytes for t in self.tenants.values())
        _require(self.committed_bytes + leased == used,
                 f"committed {self.committed_bytes} + leased {leased} != {used} used by tenants")
        holders: dict[str, int] = {}
        for holder in (*self.sessions.values(), *self.buffers.values()):
            _require(self.tenants.get(holder.tenant.name) is holder.tenant, f"tenant {holder.tenant.name!r} was forgotten")
            holders[holder.tenant.name] = holders.get(holder.tenant.name, 0) + 1
        for tenant in self.tenants.values():
            _require(tenant.holders == holders.get(tenant.name, 0), f"tenant {tenant.name!r}: {tenant.holders} holders")
            _require(tenant.holders > 0 or tenant.name in self._configured, f"tenant {tenant.name!r} is kept for nobody")

    # internals

    def _release_chunk(self, buffer: Buffer[A, C], chunk: Chunk[C]) -> None:
        self._release_chunk_handle(chunk, buffer.arena)

    def _release_chunk_handle(self, chunk: Chunk[C], arena: A) -> None:
        chunk.live = False
        try:
            self.backend.release(arena, chunk.handle)
        except (HbmdError, OSError):
            # The memory is lost to this process until exit, but the state stays consistent.
            log.exception("releasing chunk %d failed", chunk.chunk_id)

    def _mark_changed(self, buffer: Buffer[A, C]) -> None:
        if buffer.persistent and self.changed is not None:
            self.changed.add(buffer.buffer_id)

    def _account(
        self, buffer: Buffer[A, C] | None = None, mapped: int = 0, pending: int = 0, *, session: Session | None = None,
        leased: int = 0,
    ) -> None:
        """The one place committed and leased bytes change: a buffer's mapped and pending chunks or a session's
        lease, the tenant's use, the instance's totals.

        A session's committed bytes are those of its buffers.
        """
        if buffer is not None:
            buffer.physical_bytes += mapped
            buffer.pending_bytes += pending
            self.committed_bytes += mapped + pending
            buffer.tenant.used_bytes += mapped + pending
            self._mark_changed(buffer)
        if session is not None:
            session.leased_bytes += leased
            self.leased_bytes += leased
            session.tenant.used_bytes += leased

    def _drop_mapped(self, buffer: Buffer[A, C]) -> int:
        """Release the buffer's (mapped) chunks; returns their bytes."""
        for chunk in buffer.chunks:
            self._release_chunk(buffer, chunk)
        freed = buffer.physical_bytes
        buffer.chunks = []
        self._account(buffer, mapped=-freed)
        return freed

    def _drop_pending(self, buffer: Buffer[A, C]) -> int:
        """Release the chunks of an unfinished preserving defragment; returns their bytes."""
        for chunk in buffer.pending:
            self._release_chunk(buffer, chunk)
        freed = buffer.pending_bytes
        buffer.pending = []
        self._account(buffer, pending=-freed)
        return freed

    def _disown(self, buffer: Buffer[A, C]) -> None:
        """Make a persistent buffer an orphan, attachable again by name."""
        if buffer.owner is not None:
            buffer.owner.buffers.pop(buffer.buffer_id, None)
        buffer.owner = None

    def _release_all(self, buffer: Buffer[A, C]) -> int:
        freed = self._drop_mapped(buffer) + self._drop_pending(buffer)
        buffer.segment_sizes = [0] * buffer.num_segments
        return freed

    def _drop(self, buffer: Buffer[A, C]) -> int:
        freed = self._release_all(buffer)
        self.backend.close_arena(buffer.arena)
        del self.buffers[buffer.buffer_id]
        if buffer.owner is not None:
            buffer.owner.buffers.pop(buffer.buffer_id, None)
        if buffer.persistent:
            self._persistent.pop((buffer.owner_uid, buffer.name), None)
        self._let_go(buffer.tenant)
        return freed
