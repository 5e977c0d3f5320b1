"""The daemon's state: sessions, buffers, chunks, leases and the budget.

Plain data and arithmetic over a :class:`Backend`; nothing here knows about
sockets. Each concern is a part of its own, which the request handlers call
for what it alone does: ``tenants`` (the budget: the only place that admits,
charges and says what is left), ``sessions``, ``buffers``, ``holders`` (who
holds a buffer), ``sealed``, ``orphans``, ``leases``, ``pressure`` and
``chunks``, over the data in ``records``, checked by ``invariants``.
:class:`State` builds the parts, gives each what it needs of the others and
the one clock, and does what spans them.

Every request either completes or raises with the state unchanged, with one
exception the caller asks for: a discarding defragment that cannot make its
new chunks leaves the buffer released (its data was already given up).
"""

from __future__ import annotations

from typing import Generic

from hbmd.proto import TIER_DEVICE, TIER_HOST, TenantInfo
from hbmd.proto.errors import PermissionDenied
from hbmd.proto.undo import Undo

from ..backends import A, Backend, C
from ..clock import Clock
from ..config import Config
from .buffers import Buffers
from .chunks import Chunks
from .invariants import check_invariants
from .leases import DEFAULT_CREDIT_BYTES, DEFAULT_LEASE_BYTES, LEASE_IDLE_S, Leases
from .orphans import Orphans
from .pressure import DEMOTE_IDLE_S, Pressure
from .records import Answer, Buffer, Chunk, ConfigLoad, Limits, Reclaim, Session, Tenant, check_int
from .sealed import Sealed, check_unread
from .sessions import RECLAIM_PATIENCE_S, Sessions
from .tenants import Tenants
from .writers import Writer

__all__ = [
    "DEFAULT_CREDIT_BYTES", "DEFAULT_LEASE_BYTES", "DEMOTE_IDLE_S", "Answer", "Buffer", "Chunk", "ConfigLoad",
    "Limits", "Reclaim", "Session", "State", "Tenant",
]


class State(Generic[A, C]):
    """Sessions, buffers, leases and the budget of one daemon instance: its parts, and what spans them."""

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
        clock: Clock | None = None,
    ) -> None:
        """``lease_bytes``: the most one session is leased (0: no leases); ``lease_idle_s``: see :data:`LEASE_IDLE_S`;
        ``host_budget_bytes``: the most the host tier holds (0: no host tier); ``credit_bytes``: the most credit one
        session holds (0: none); ``demote_idle_s``: see :data:`DEMOTE_IDLE_S`; ``clock``: the time every part
        keeps its deadlines by (the system's where None; a test's moves without waiting)."""
        self.clock = clock = clock or Clock()
        self.backend = backend
        self.limits = limits
        self.tenants = Tenants(budget_bytes, config or Config(), host_budget_bytes)
        self.chunks: Chunks[A, C] = Chunks(backend)
        self.sessions = Sessions(limits, reclaim_patience_s, clock)
        self.leases: Leases[A, C] = Leases(backend, self.chunks, self.tenants, lease_bytes, lease_idle_s, credit_bytes,
                                           clock)
        self.pressure: Pressure[A, C] = Pressure(self.sessions, self.tenants, self.leases, demote_idle_s, clock)
        self.buffers: Buffers[A, C] = Buffers(backend, self.chunks, self.tenants, limits, self.pressure, clock)
        self.orphans: Orphans[A, C] = Orphans(self.buffers, self.tenants, backend.granularity, clock)
        self.sealed: Sealed[A, C] = Sealed(self.buffers)
        self.started_at = clock.monotonic()
        self.config_load = ConfigLoad()
        """The ``--config`` file and its reloads (the daemon's command line and SIGHUP set it)."""

    def open_session(
        self, pid: int, uid: int, gid: int, client_name: str, tenant: str, admin: bool = False, observer: bool = False,
        lease: bool = False, credit: bool = False, starting_over: tuple[int, str] = (0, ""),
    ) -> Session:
        """Raises ``Conflict`` (retryable) when ``uid`` already has its :attr:`Limits.sessions_per_uid`,
        ``PermissionDenied`` for a tenant it may not declare. ``starting_over``: see :meth:`Sessions.open`."""
        charged = self.tenants.resolve(uid, tenant)
        wants_lease = lease and not observer and self.leases.granules > 0
        with Undo() as undo:
            # Held first, so that a hello refused below lets go of a tenant it named and nothing else held.
            self.tenants.hold(charged)
            undo.push(self.tenants.let_go, charged)
            session = self.sessions.open(
                pid, uid, gid, client_name, charged, admin, observer, wants_lease, starting_over
            )
        session.grown_at = self.clock.monotonic()
        session.wants_credit = credit and not observer and self.leases.credit_max > 0
        return session

    def close_session(self, session: Session, writer: Writer | None = None) -> int:
        """End a session: its lease and read claims go, its anonymous buffers are freed, its persistent ones
        orphaned (mid-defragment keeping the old chunks, which hold the data), watched through copies of ``writer``
        (the caller's), its process where that lives on. Returns the bytes freed."""
        self.leases.end_session(session)
        freed = self.buffers.end_session(session, writer)
        self.sessions.forget(session)
        self.tenants.let_go(session.tenant)
        return freed

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
        if persistent and not readonly and not self.sessions.credentials.proves_name(
                session.replaces, session.uid, session.pid, name, name_proof):
            raise PermissionDenied(
                f"persistent buffer {name!r} is declared again only with the proof that the session this process "
                "started over held it (a client of protocol 1.13 keeps it): another process of the uid may hold it",
                field="name_proof",
            )
        return self.buffers.redeclare(session, previous_id, capacities, sizes, chunks, name, persistent, shareable,
                                      sealed, readonly, tier)

    def commit(self, session: Session, buffer_id: int, sizes: int | list[int]) -> list[Chunk[C]]:
        """Grow each segment's committed prefix to ``sizes[i]`` (an int: the same for all); returns the new chunks.

        A commit a lease could have served tells the lease it was short.
        """
        created = self.buffers.commit(session, buffer_id, sizes)
        self.leases.note_demand(session, created)
        session.grown_at = self.clock.monotonic()
        return created

    def move(self, session: Session, buffer_id: int, tier: str) -> list[Chunk[C]]:
        """Demote the buffer to the host tier or promote it back; see :meth:`Buffers.move`.

        A demote while the daemon's request to demote is unanswered is one done
        for it: marked now, with the move, for the room it makes can be given
        away before the answer comes, and a restart in between would lose it.
        """
        chunks = self.buffers.move(session, buffer_id, tier)
        reclaim = session.reclaim
        if chunks and tier == TIER_HOST and reclaim is not None and reclaim.demote and reclaim.released_bytes is None:
            session.demoted_under_pressure = True
        return chunks

    def idle(self) -> bool:
        """A step of the backend's background work, its host pool kept within the host budget's room and paused while
        a move (or a preserving defragment) is in flight."""
        return self.backend.idle(self.tenants.host_room(), self.buffers.pending_bytes > 0)

    def free(self, session: Session, buffer_id: int) -> int:
        """Drop the buffer (a sealed one only once nobody reads it). Returns the bytes freed."""
        buffer = self.buffers.of(session, buffer_id)
        check_unread(buffer, self.sessions.pids())
        return self.buffers.drop(buffer)

    def graft(self, session: Session, buffer_id: int, name: str) -> Buffer[A, C]:
        """Give every chunk of the orphan ``name`` to the session's empty buffer ``buffer_id``; see
        :meth:`Orphans.graft`. The buffer grew: its session is busy, not to be asked to demote it at once."""
        buffer = self.orphans.graft(session, buffer_id, name)
        session.grown_at = self.clock.monotonic()
        return buffer

    def delete(self, session: Session, name: str, owner_uid: int = -1) -> tuple[int, int]:
        """Free an orphaned persistent buffer by name: the session's user's, or for an admin ``owner_uid``'s.

        Returns its id and the bytes freed.
        """
        check_int("owner_uid", owner_uid, -1, (1 << 32) - 1)
        uid = session.uid if owner_uid == -1 else owner_uid
        if uid != session.uid and not session.admin:
            raise PermissionDenied("only an admin may delete another user's persistent buffer")
        buffer = self.buffers.orphan(uid, name)
        check_unread(buffer, self.sessions.pids())
        return buffer.buffer_id, self.buffers.drop(buffer)

    def place(
        self, session: Session, buffer_id: int, sizes: list[int], chunk_ids: list[int], offsets: list[int]
    ) -> Buffer[A, C]:
        """Leased granules now back the session's buffer, which grows to ``sizes``: what the client mapped.

        The granules must be exactly the ones the growth needs, each a chunk
        of the session's lease; otherwise nothing changes.
        """
        buffer = self.buffers.growable(session, buffer_id)
        self.leases.check_placement(session, buffer, sizes, chunk_ids, offsets)
        runs = self.buffers.growth(buffer, sizes)
        self.buffers.grow(buffer, sizes, self.leases.take(session, buffer, runs, chunk_ids, offsets))
        session.grown_at = self.clock.monotonic()
        return buffer

    def bind(self, session: Session, buffer_id: int, sizes: list[int], offsets: list[int], chunk_sizes: list[int],
             fds: list[int]) -> Buffer[A, C]:
        """Chunks the client made (their FDs ``fds``, which the caller closes) now back the session's buffer, which
        grows to ``sizes``: what the client mapped, paid from its credit.

        One chunk per run the growth needs, each shown by the backend to be
        what it claims; otherwise nothing changes. A bind taken already
        (sent again after a restart) changes nothing either, and is no error.
        """
        buffer = self.buffers.growable(session, buffer_id)
        self.leases.check_segments(buffer_id, sizes)
        if self.leases.bound_before(session, buffer, sizes, offsets, chunk_sizes):
            return buffer
        runs = self.buffers.growth(buffer, sizes)
        self.buffers.grow(buffer, sizes, self.leases.bind(session, buffer, runs, offsets, chunk_sizes, fds))
        session.grown_at = self.clock.monotonic()
        return buffer

    def reconfigure(self, config: Config) -> None:
        """Make ``config`` the daemon's (``ConfigError`` and nothing changed where it cannot be honoured); leases
        granted under the old limits are asked back."""
        self.tenants.reconfigure(config)
        self.pressure.ask_back_all_leases()

    def tenant_infos(self, uid: int | None = None) -> list[TenantInfo]:
        """Every tenant in use by name, or with ``uid`` only those its sessions and buffers are charged to."""
        return self.tenants.infos(self._tenants_of(uid), self.sessions.workers_of)

    def tenants_listed(self, uid: int | None, limit: int) -> tuple[list[TenantInfo], int]:
        """The tenants status shows (:meth:`Tenants.listed`): to an admin (``uid`` None) those in use and those owed
        a guaranteed minimum, to ``uid`` those its sessions and buffers are charged to; at most ``limit``, and how
        many more there are."""
        return self.tenants.listed(self._tenants_of(uid), self.sessions.workers_of, limit)

    def _tenants_of(self, uid: int | None) -> set[str] | None:
        """The names of the tenants ``uid``'s sessions and buffers are charged to; None (every one) without a uid."""
        if uid is None:
            return None
        names = {s.tenant.name for s in self.sessions.of_uid.get(uid, {}).values()}
        return names | {b.tenant.name for b in self.buffers.of_uid.get(uid, {}).values()}

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first count that does not agree with what it counts."""
        check_invariants(self.sessions, self.buffers, self.tenants)
