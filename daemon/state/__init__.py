"""The daemon's state: sessions, buffers, chunks, leases and the budget.

Plain data and arithmetic over a :class:`Backend`; nothing here knows about
sockets. Each concern has a module of its own, and :class:`State` is the one
façade the server calls:

- ``records``: the data (sessions, buffers, chunks, tenants, reclaims);
- ``tenants``: the budget: the only place that admits, charges and says
  what is left (:class:`~.tenants.Tenants`);
- ``sessions``: who is connected, and reclaim requests;
- ``buffers``: buffers, their chunks, persistent names, seals and readers;
- ``leases``: granules made ahead of need and placed by clients;
- ``orphans``: persistent buffers no session holds: grafts, grace periods;
- ``chunks``: where chunks are made and released with the backend;
- ``invariants``: whether the counts agree with the records they count.

Every request either completes or raises with the state unchanged, with one
exception the caller asks for: a discarding defragment that cannot make its
new chunks leaves the buffer released (its data was already given up).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Generic

from hbmd.proto import TIER_DEVICE, TIER_HOST, BufferInfo, ChunkInfo, SessionInfo, TenantInfo
from hbmd.proto.errors import PermissionDenied
from hbmd.proto.undo import Undo
from hbmd.proto.units import round_up

from ..backends import A, Backend, C
from ..config import Config
from .buffers import Buffers
from .chunks import Chunks
from .credentials import Credentials
from .invariants import check_invariants
from .leases import DEFAULT_CREDIT_BYTES, DEFAULT_LEASE_BYTES, LEASE_IDLE_S, Leases
from .orphans import Orphans
from .pressure import DEMOTE_IDLE_S, Pressure
from .records import (
    Answer,
    Buffer,
    Chunk,
    ConfigLoad,
    Limits,
    Reclaim,
    Session,
    Tenant,
    check_int,
)
from .sealed import Sealed, check_unread
from .sessions import RECLAIM_PATIENCE_S, Sessions
from .tenants import Tenants
from .writers import Writer

if TYPE_CHECKING:  # a journaled buffer is read by the restart package, which builds on the state
    from ..restart.journaled import JournaledBuffer

__all__ = [
    "DEFAULT_CREDIT_BYTES", "DEFAULT_LEASE_BYTES", "DEMOTE_IDLE_S", "Answer", "Buffer", "Chunk", "ConfigLoad",
    "Limits", "Reclaim", "Session", "State", "Tenant",
]


class State(Generic[A, C]):
    """Sessions, buffers, leases and the budget of one daemon instance."""

    def __init__(
        self,
        backend: Backend[A, C],
        budget_bytes: int,
        config: Config | None = None,
        reclaim_patience_s: float = RECLAIM_PATIENCE_S,
        limits: Limits = Limits(),  # noqa: B008 - frozen: one default shared by every State is safe
        lease_bytes: int = DEFAULT_LEASE_BYTES,
        lease_idle_s: float = LEASE_IDLE_S,
        host_budget_bytes: int = 0,
        credit_bytes: int = DEFAULT_CREDIT_BYTES,
        demote_idle_s: float = DEMOTE_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """``lease_bytes``: the most one session is leased (0: no leases); ``lease_idle_s``: see :data:`LEASE_IDLE_S`;
        ``host_budget_bytes``: the most the host tier holds (0: no host tier); ``credit_bytes``: the most credit one
        session holds (0: none); ``demote_idle_s``: see :data:`DEMOTE_IDLE_S`; ``clock``: the monotonic time that
        growth, refused commits and reclaim requests are stamped with and demotes are decided by (a test's own clock
        advances without waiting); ``wall_clock``: the Unix time orphans' grace periods are kept by (likewise)."""
        self.backend = backend
        self.limits = limits
        self.tenant_table = Tenants(budget_bytes, config or Config(), host_budget_bytes)
        self.chunks: Chunks[A, C] = Chunks(backend)
        self.session_table = Sessions(limits, reclaim_patience_s, clock)
        self.leases: Leases[A, C] = Leases(
            backend, self.chunks, self.tenant_table, lease_bytes, lease_idle_s, credit_bytes, clock
        )
        self.pressure: Pressure[A, C] = Pressure(self.session_table, self.tenant_table, self.leases, demote_idle_s,
                                                 clock)
        self.buffer_table: Buffers[A, C] = Buffers(backend, self.chunks, self.tenant_table, limits, self.pressure,
                                                   wall_clock)
        self.orphan_table: Orphans[A, C] = Orphans(self.buffer_table, self.tenant_table)
        self.sealed_table: Sealed[A, C] = Sealed(self.buffer_table)
        self.clock = clock
        self.started_at = clock()
        self.config_load = ConfigLoad()
        """The ``--config`` file and its reloads (the daemon's command line and SIGHUP set it)."""

    # what the server, metrics and persistence read

    @property
    def sessions(self) -> dict[int, Session]:
        return self.session_table.by_id

    @property
    def buffers(self) -> dict[int, Buffer[A, C]]:
        return self.buffer_table.by_id

    @property
    def persistent(self) -> dict[tuple[int, str], Buffer[A, C]]:
        return self.buffer_table.persistent

    @property
    def tenants(self) -> dict[str, Tenant]:
        return self.tenant_table.by_name

    @property
    def config(self) -> Config:
        return self.tenant_table.config

    @property
    def budget_bytes(self) -> int:
        return self.tenant_table.budget_bytes

    @property
    def committed_bytes(self) -> int:
        return self.tenant_table.committed_bytes

    @property
    def leased_bytes(self) -> int:
        return self.tenant_table.leased_bytes

    @property
    def host_budget_bytes(self) -> int:
        return self.tenant_table.host_budget_bytes

    @property
    def host_bytes(self) -> int:
        return self.tenant_table.host_bytes

    @property
    def reserved_bytes(self) -> int:
        return self.buffer_table.reserved_bytes

    @property
    def num_chunks(self) -> int:
        return self.buffer_table.num_chunks

    @property
    def orphans(self) -> list[Buffer[A, C]]:
        """Persistent buffers no session holds: their memory stays committed until attached again or deleted."""
        return [b for b in self.buffers.values() if b.owner is None]

    @property
    def workers(self) -> list[Session]:
        return self.session_table.workers

    @property
    def num_workers(self) -> int:
        return self.session_table.num_workers

    @property
    def reclaim_patience_s(self) -> float:
        return self.session_table.reclaim_patience_s

    @property
    def changed(self) -> set[int] | None:
        """Persistent buffers changed since the persistence layer last synced (None: nobody tracks them)."""
        return self.buffer_table.changed

    @changed.setter
    def changed(self, value: set[int] | None) -> None:
        self.buffer_table.changed = value

    @property
    def revokes_due(self) -> list[tuple[Session, list[int]]]:
        return self.leases.revokes_due

    @property
    def reclaims_due(self) -> list[tuple[Session, Reclaim]]:
        return self.session_table.reclaims_due

    # sessions

    def tenant_for(self, uid: int, declared: str) -> Tenant:
        return self.tenant_table.resolve(uid, declared)

    def open_session(
        self, pid: int, uid: int, gid: int, client_name: str, tenant: str, admin: bool = False, observer: bool = False,
        lease: bool = False, credit: bool = False, starting_over: tuple[int, str] = (0, ""),
    ) -> Session:
        """Raises ``Conflict`` (retryable) when ``uid`` already has its :attr:`Limits.sessions_per_uid`,
        ``PermissionDenied`` for a tenant it may not declare. ``starting_over``: see :meth:`Sessions.open`."""
        charged = self.tenant_table.resolve(uid, tenant)
        wants_lease = lease and not observer and self.leases.granules > 0
        with Undo() as undo:
            # Held first, so that a hello refused below lets go of a tenant it named and nothing else held.
            self.tenant_table.hold(charged)
            undo.push(self.tenant_table.let_go, charged)
            session = self.session_table.open(
                pid, uid, gid, client_name, charged, admin, observer, wants_lease, starting_over
            )
        session.grown_at = self.clock()
        session.wants_credit = credit and not observer and self.leases.credit_max > 0
        return session

    def restore_session(self, session: Session, lease: list[Chunk[C]], credit: int, resume_by: float) -> None:
        """Take back a session journaled before a restart (its tenant recorded by name on it) with its leased granules
        and credit; it waits for its client until ``resume_by``."""
        session.tenant = self.tenant_table.named(session.tenant.name)
        self.session_table.restore(session, resume_by)
        session.grown_at = self.clock()
        self.tenant_table.hold(session.tenant)
        self.leases.adopt(session, lease, credit)

    def resume_session(self, session_id: int, uid: int, pid: int, credential: str) -> Session:
        """A restored session back with its client; see :meth:`Sessions.resume`."""
        return self.session_table.resume(session_id, uid, pid, credential)

    def use_resume_key(self, key: bytes, last_line: str) -> None:
        """Issue and check resume credentials under the instance's ``key`` (``rundir.resume_key``), kept across runs;
        until then under one of this run's own, whose credentials start no session over after a restart.
        ``last_line``: the line of daemons of the one that ran before (``rundir.pass_line``); see
        :meth:`Credentials.use_key`."""
        self.session_table.credentials.use_key(key, last_line)

    @property
    def credentials(self) -> Credentials:
        """The resume credentials of this line of daemons: what the journal keeps of them, and its line."""
        return self.session_table.credentials

    def may_start_over(self, session_id: int, uid: int, pid: int, credential: str) -> bool:
        """See :meth:`Sessions.may_start_over`."""
        return self.session_table.may_start_over(session_id, uid, pid, credential)

    def suspend_session(self, session: Session, resume_by: float) -> None:
        self.session_table.suspend(session, resume_by)

    def issue_credential(self, session: Session) -> str:
        return self.session_table.issue_credential(session)

    def unresumed_sessions(self, now: float, gone: Callable[[int], bool]) -> list[Session]:
        return self.session_table.unresumed(now, gone)

    def session_for(self, token: str) -> Session:
        return self.session_table.for_token(token)

    def close_session(self, session: Session, writer: Writer | None = None) -> int:
        """End a session: its lease and read claims go, its anonymous buffers are freed, its persistent ones
        orphaned (mid-defragment keeping the old chunks, which hold the data), watched through copies of ``writer``
        (the caller's), its process where that lives on. Returns the bytes freed."""
        self.leases.end_session(session)
        freed = self.buffer_table.end_session(session, writer)
        self.session_table.forget(session)
        self.tenant_table.let_go(session.tenant)
        return freed

    # buffers

    def create_buffer(
        self, session: Session, capacity: int, num_segments: int, name: str = "", persistent: bool = False,
        shareable: bool = False, segment_capacities: list[int] | None = None, keep_orphan_s: float = 0.0,
    ) -> Buffer[A, C]:
        """A buffer of ``num_segments`` equal segments, or of the uneven ``segment_capacities`` (summing to
        ``capacity``); a persistent one is freed ``keep_orphan_s`` after it becomes an orphan (0: never)."""
        return self.buffer_table.create(
            session, capacity, num_segments, segment_capacities, name, persistent, shareable, keep_orphan_s
        )

    def restore_buffer(
        self, record: JournaledBuffer, owner: Session | None, arena: A, chunks: list[Chunk[C]],
        pending: list[Chunk[C]],
    ) -> Buffer[A, C]:
        """Bring back a buffer journaled before a restart, as ``record`` holds it, with what its restore resolved: its
        ``owner`` (None: an orphan), the ``arena`` its chunks were adopted into and those chunks, handles and all. Its
        read claims come back for the sessions restored; its memory counts whatever the budget: it is there already.
        Its grace period as an orphan is taken up as :meth:`Orphans.restored` says; an unsealed persistent one holds
        its name unsealed since the journal says, or from now where it does not."""
        unsealed = record.persistent and not record.sealed
        buffer = Buffer(
            buffer_id=record.buffer_id, name=record.name, persistent=record.persistent, shareable=record.shareable,
            owner=owner, owner_uid=record.uid, tenant=self.tenant_table.named(record.tenant), capacity=record.capacity,
            reserved=round_up(record.capacity, self.backend.granularity), segment_capacities=record.capacities,
            arena=arena, segment_sizes=record.sizes, chunks=chunks, pending=pending, sealed=record.sealed,
            unsealed_since=(record.unsealed_since or self.buffer_table.clock()) if unsealed else 0.0,
        )
        self.buffer_table.adopt(buffer)
        if owner is not None:
            owner.buffers[buffer.buffer_id] = buffer
        for session_id, claims in record.readers.items():
            reader = self.sessions.get(session_id)
            if reader is not None:
                buffer.readers[session_id] = claims
                reader.reading[buffer.buffer_id] = buffer
        self.orphan_table.restored(buffer, *record.orphan)
        return buffer

    def redeclare(
        self, session: Session, previous_id: int, capacities: list[int], sizes: list[int],
        chunks: list[tuple[int, int]], name: str, persistent: bool, shareable: bool, sealed: bool, readonly: bool,
        tier: str = TIER_DEVICE, name_proof: str = "",
    ) -> Buffer[A, C]:
        """A buffer the session's process still maps, declared again after a cold restart; see
        :meth:`Buffers.redeclare`. Refused (``PermissionDenied``) but on a session whose process started over, before
        it asks for anything else (:attr:`Session.declaring`), and, for a persistent buffer of its own, with the
        proof that the session it replaces held its name (``name_proof``)."""
        if not session.declaring:
            raise PermissionDenied(
                "buffers are declared again only by a session whose process found its own gone after a restart, "
                "before any other request"
            )
        if persistent and not readonly and not self.credentials.proves_name(
                session.replaces, session.uid, session.pid, name, name_proof):
            raise PermissionDenied(
                f"persistent buffer {name!r} is declared again only with the proof that the session this process "
                "started over held it (a client of protocol 1.13 keeps it): another process of the uid may hold it",
                field="name_proof",
            )
        return self.buffer_table.redeclare(session, previous_id, capacities, sizes, chunks, name, persistent,
                                           shareable, sealed, readonly, tier)

    def info_for_holder(self, buffer: Buffer[A, C], session: Session) -> BufferInfo:
        """``buffer``'s info as its holder ``session`` is told it: a persistent buffer's with the proof that the
        session holds its name (:attr:`BufferInfo.name_proof`), which no one else is shown."""
        info = buffer.info()
        if buffer.persistent and buffer.owner is session:
            info = dataclasses.replace(info, name_proof=self.credentials.name_proof(
                session.uid, session.session_id, session.pid, buffer.name))
        return info

    def remappable(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        """The session's buffer, to send all its chunks again: refused where some are held only by its mappers."""
        buffer = self.buffer_table.of(session, buffer_id)
        self.buffer_table.check_handed_out(buffer)
        return buffer

    def buffer_of(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        return self.buffer_table.of(session, buffer_id)

    def commit(self, session: Session, buffer_id: int, sizes: int | list[int]) -> list[Chunk[C]]:
        """Grow each segment's committed prefix to ``sizes[i]`` (an int: the same for all); returns the new chunks.

        A commit a lease could have served tells the lease it was short.
        """
        created = self.buffer_table.commit(session, buffer_id, sizes)
        self.leases.note_demand(session, created)
        session.grown_at = self.clock()
        return created

    def defragment(self, session: Session, buffer_id: int, preserve: bool) -> list[Chunk[C]]:
        return self.buffer_table.defragment(session, buffer_id, preserve)

    def finish_defragment(self, session: Session, buffer_id: int, keep_new: bool) -> int:
        return self.buffer_table.finish_defragment(session, buffer_id, keep_new)

    def move(self, session: Session, buffer_id: int, tier: str) -> list[Chunk[C]]:
        """Demote the buffer to the host tier or promote it back; see :meth:`Buffers.move`.

        A demote while the daemon's request to demote is unanswered is one done
        for it: marked now, with the move, for the room it makes can be given
        away before the answer comes, and a restart in between would lose it.
        """
        chunks = self.buffer_table.move(session, buffer_id, tier)
        reclaim = session.reclaim
        if chunks and tier == TIER_HOST and reclaim is not None and reclaim.demote and reclaim.released_bytes is None:
            session.demoted_under_pressure = True
        return chunks

    def idle(self) -> bool:
        """A step of the backend's background work, its host pool kept within the host budget's room and paused while
        a move (or a preserving defragment) is in flight."""
        return self.backend.idle(self.tenant_table.host_room(), self.buffer_table.pending_bytes > 0)

    def release(self, session: Session, buffer_id: int) -> int:
        """Drop every chunk, keep the reservation. Returns the bytes freed."""
        return self.buffer_table.release_all(self.buffer_table.changeable(session, buffer_id))

    def free(self, session: Session, buffer_id: int) -> int:
        """Drop the buffer (a sealed one only once nobody reads it). Returns the bytes freed."""
        buffer = self.buffer_table.of(session, buffer_id)
        check_unread(buffer, self._pids())
        return self.buffer_table.drop(buffer)

    def attach(self, session: Session, name: str, uneven_ok: bool = True) -> Buffer[A, C]:
        return self.orphan_table.attach(session, name, uneven_ok)

    def graft(self, session: Session, buffer_id: int, name: str) -> Buffer[A, C]:
        """Give every chunk of the orphan ``name`` to the session's empty buffer ``buffer_id``; see
        :meth:`Orphans.graft`. The buffer grew: its session is busy, not to be asked to demote it at once."""
        buffer = self.orphan_table.graft(session, buffer_id, name)
        session.grown_at = self.clock()
        return buffer

    def expire_orphans(self) -> int:
        """Free the orphans whose grace period is over; returns how many."""
        return self.orphan_table.expire()

    def seal(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        return self.sealed_table.seal(session, buffer_id)

    def attach_reader(self, session: Session, name: str, uneven_ok: bool = True) -> Buffer[A, C]:
        return self.sealed_table.attach_reader(session, name, uneven_ok)

    def detach_reader(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        return self.sealed_table.detach_reader(session, buffer_id)

    def detach(self, session: Session, buffer_id: int) -> int:
        return self.orphan_table.detach(session, buffer_id)

    def delete(self, session: Session, name: str, owner_uid: int = -1) -> tuple[int, int]:
        """Free an orphaned persistent buffer by name: the session's user's, or for an admin ``owner_uid``'s.

        Returns its id and the bytes freed.
        """
        check_int("owner_uid", owner_uid, -1, (1 << 32) - 1)
        uid = session.uid if owner_uid == -1 else owner_uid
        if uid != session.uid and not session.admin:
            raise PermissionDenied("only an admin may delete another user's persistent buffer")
        buffer = self.buffer_table.orphan(uid, name)
        check_unread(buffer, self._pids())
        return buffer.buffer_id, self.buffer_table.drop(buffer)

    def _pids(self) -> dict[int, int]:
        return {s.session_id: s.pid for s in self.sessions.values()}

    def chunk_info(self, chunk: Chunk[C]) -> ChunkInfo:
        return ChunkInfo(chunk.chunk_id, chunk.offset, chunk.size)

    def export(self, buffer: Buffer[A, C], chunk: Chunk[C]) -> int:
        """A new FD for a buffer's chunk."""
        assert chunk.handle is not None, "a chunk held only by its mappers is never handed out"
        return self.backend.export(buffer.arena, chunk.handle)

    def export_leased(self, chunk: Chunk[C]) -> int:
        """A new FD for a leased granule."""
        return self.leases.export(chunk)

    # leases

    def take_lease_due(self) -> list[int]:
        """Sessions (by id) whose lease may need topping up, longest waiting first; each is named once until it needs
        it again."""
        return self.leases.take_due()

    def lease_due_again(self, session_ids: list[int]) -> None:
        """Sessions taken from :meth:`take_lease_due` and not served: first in line next time."""
        self.leases.due_again(session_ids)

    @property
    def top_ups_due(self) -> bool:
        """Whether some session's lease may need topping up."""
        return bool(self.leases.due)

    def lease_bytes_for(self, session: Session) -> int:
        return self.leases.bytes_for(session)

    def top_up_lease(self, session: Session, until: float = math.inf) -> list[Chunk[C]]:
        return self.leases.top_up(session, until)

    def place(
        self, session: Session, buffer_id: int, sizes: list[int], chunk_ids: list[int], offsets: list[int]
    ) -> Buffer[A, C]:
        """Leased granules now back the session's buffer, which grows to ``sizes``: what the client mapped.

        The granules must be exactly the ones the growth needs, each a chunk
        of the session's lease; otherwise nothing changes.
        """
        buffer = self.buffer_table.growable(session, buffer_id)
        self.leases.check_placement(session, buffer, sizes, chunk_ids, offsets)
        runs = self.buffer_table.growth(buffer, sizes)
        self.buffer_table.grow(buffer, sizes, self.leases.take(session, buffer, runs, chunk_ids, offsets))
        session.grown_at = self.clock()
        return buffer

    def return_lease(self, session: Session, chunk_ids: list[int]) -> list[int]:
        return self.leases.given_back(session, chunk_ids)

    def credit_for(self, session: Session) -> int:
        return self.leases.credit_for(session)

    def top_up_credit(self, session: Session) -> int:
        return self.leases.top_up_credit(session)

    def bind(self, session: Session, buffer_id: int, sizes: list[int], offsets: list[int], chunk_sizes: list[int],
             fds: list[int]) -> Buffer[A, C]:
        """Chunks the client made (their FDs ``fds``, which the caller closes) now back the session's buffer, which
        grows to ``sizes``: what the client mapped, paid from its credit.

        One chunk per run the growth needs, each shown by the backend to be
        what it claims; otherwise nothing changes. A bind taken already
        (sent again after a restart) changes nothing either, and is no error.
        """
        buffer = self.buffer_table.growable(session, buffer_id)
        self.leases.check_segments(buffer_id, sizes)
        if self.leases.bound_before(session, buffer, sizes, offsets, chunk_sizes):
            return buffer
        runs = self.buffer_table.growth(buffer, sizes)
        self.buffer_table.grow(buffer, sizes, self.leases.bind(session, buffer, runs, offsets, chunk_sizes, fds))
        session.grown_at = self.clock()
        return buffer

    def withdraw_credit(self, session: Session, granted: int) -> None:
        """Take back a grant that could not be sent."""
        self.leases.withdraw(session, granted)

    def return_credit(self, session: Session) -> int:
        return self.leases.credit_returned(session)

    @property
    def credit_revokes_due(self) -> list[Session]:
        return self.leases.credit_revokes_due

    def ask_back_lease(self, session: Session) -> None:
        self.leases.ask_back(session)

    def ask_back_idle_leases(self, now: float) -> None:
        self.leases.ask_back_idle(list(self.sessions.values()), now)

    # pressure and reclaim

    def promotes_due(self, now: float) -> list[tuple[Session, int]]:
        return self.pressure.promotes_due(now)

    def request_reclaim(self, session: Session, requested_bytes: int, reason: str, demote: bool = False) -> Reclaim:
        return self.pressure.request_reclaim(session, requested_bytes, reason, demote)

    def reclaim_answered(self, session: Session, reclaim_id: int, released_bytes: int) -> None:
        self.session_table.reclaim_answered(session, reclaim_id, released_bytes)

    # the budget

    def admissible_for(self, session: Session) -> int:
        return self.pressure.admissible_for(session)

    def reconfigure(self, config: Config) -> None:
        """Make ``config`` the daemon's (``ConfigError`` and nothing changed where it cannot be honoured); leases
        granted under the old limits are asked back."""
        self.tenant_table.reconfigure(config)
        self.pressure.ask_back_all_leases()

    # inspection

    def session_info(self, session: Session) -> SessionInfo:
        return self.session_table.info(session)

    def tenant_infos(self, uid: int | None = None) -> list[TenantInfo]:
        """Every tenant in use by name, or with ``uid`` only those its sessions and buffers are charged to."""
        return self.tenant_table.infos(self._tenants_of(uid), self.session_table.workers_of)

    def tenants_listed(self, uid: int | None, limit: int) -> tuple[list[TenantInfo], int]:
        """The tenants status shows (:meth:`Tenants.listed`): to an admin (``uid`` None) those in use and those owed
        a guaranteed minimum, to ``uid`` those its sessions and buffers are charged to; at most ``limit``, and how
        many more there are."""
        return self.tenant_table.listed(self._tenants_of(uid), self.session_table.workers_of, limit)

    def _tenants_of(self, uid: int | None) -> set[str] | None:
        """The names of the tenants ``uid``'s sessions and buffers are charged to; None (every one) without a uid."""
        if uid is None:
            return None
        names = {s.tenant.name for s in self.session_table.of_uid.get(uid, {}).values()}
        return names | {b.tenant.name for b in self.buffer_table.of_uid.get(uid, {}).values()}

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first count that does not agree with what it counts."""
        check_invariants(self)
