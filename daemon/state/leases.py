"""Leases: granules made ahead of need, which a session's client places itself.

A session that asks for them is leased granules created before any commit
needs them (:meth:`Leases.top_up`), charged to its tenant at once. Its
client places them in its buffers itself and says so (:meth:`Leases.place`),
so a commit that fits the lease costs no round trip. The lease grows when a
commit found it short, stays empty while the budget is tight, and is taken
back first under pressure: unplaced granules are asked back (a client may be
placing them at that moment, so only it can give them up); a client whose own
commit does not fit gives its whole lease back and retries.

A lease may also hold credit: bytes rather than granules. Within it the
client makes a commit's chunks itself, one per run as the daemon would, and
sends their FDs (:meth:`Leases.bind`); the daemon checks each (the backend's
``accept``) and keeps it as its own. So a commit of any size costs no round
trip: the client pays the export and one datagram, the daemon the check,
after the client has its memory. The credit grows with the commits that
came through the daemon although it could have served them, and is asked
back as the granules are; a client gives back all of it at once.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from typing import Any, Generic

from hbmd.proto import MAX_OWN_CHUNKS, MAX_PLACED_GRANULES, MAX_PLACED_SEGMENTS
from hbmd.proto.errors import HbmdError, InvalidRequest
from hbmd.proto.undo import Undo
from hbmd.proto.units import format_bytes

from ..backends import A, Backend, C, parkable
from ..clock import Clock
from .chunks import Chunks
from .records import Buffer, Chunk, Session
from .tenants import Tenants

log = logging.getLogger("hbmd.state")

DEFAULT_LEASE_BYTES = 64 << 20
"""The most one session is leased (``--lease``): 32 granules of 2 MiB."""
DEFAULT_CREDIT_BYTES = 16 << 30
"""The most credit one session holds (``--credit``); all leases together stay within an 8th of the budget."""
LEASE_IDLE_S = 30.0
"""A lease the session has not drawn on for this long is asked back; it grows again with the next demand."""
LEASE_RETURN_PATIENCE_S = 2.0
"""A client's listener gives asked-back granules back within milliseconds; one that has not after this is not reading
its socket (stopped, hung), and a commit refused for want of them is no longer told that a retry will find them."""


class Leases(Generic[A, C]):
    """Every session's leased granules; they live in one arena of their own until placed."""

    def __init__(self, backend: Backend[A, C], chunks: Chunks[A, C], tenants: Tenants, lease_bytes: int,
                 idle_s: float, credit_bytes: int, clock: Clock) -> None:
        """``lease_bytes``: the most one session is leased (0: no leases); ``idle_s``: see :data:`LEASE_IDLE_S`;
        ``credit_bytes``: the most credit one session holds (0: none); ``clock``: the state's, whose monotonic time a
        lease's use and a revoke are stamped with."""
        self.clock = clock
        self.backend = backend
        self.chunks = chunks
        self.tenants = tenants
        self.granules = max(0, lease_bytes) // backend.granularity
        self.credit_max = max(0, credit_bytes) // backend.granularity * backend.granularity
        self.idle_s = idle_s
        self.arena: A | None = None
        self.due: dict[int, None] = {}
        """Sessions (by id) whose lease may need topping up, for the server to serve, longest waiting first."""
        self.revokes_due: list[tuple[Session, list[int]]] = []
        """Leased chunks asked back, for the server to send."""
        self.credit_revokes_due: list[Session] = []
        """Sessions whose credit was asked back, for the server to tell."""

    def take_due(self) -> list[int]:
        """The sessions whose lease may need topping up since this was last asked, longest waiting first; the server
        serves them."""
        due, self.due = list(self.due), {}
        return due

    def due_again(self, session_ids: list[int]) -> None:
        """Sessions the server did not top up in full this time: they are served first next time."""
        self.due = {**dict.fromkeys(session_ids), **self.due}

    def bytes_for(self, session: Session) -> int:
        """The most ``session`` may be leased: 0 unless it asked for leases."""
        return self.granules * self.backend.granularity if session.wants_lease else 0

    def _account(self, session: Session, leased: int) -> None:
        session.leased_bytes += leased
        self.tenants.charge(session.tenant, leased=leased)

    def credit_for(self, session: Session) -> int:
        """The most credit ``session`` may hold: 0 unless its client makes chunks itself."""
        return self.credit_max if session.wants_credit else 0

    def note_demand(self, session: Session, created: list[Chunk[C]]) -> None:
        """A commit that made ``created`` came through the daemon: where a lease could have served it, the lease was
        short, so it grows (up to the most allowed).

        Granules serve commits of runs of one granule,
        :data:`MAX_PLACED_GRANULES` at most; credit serves the others, of
        :data:`MAX_OWN_CHUNKS` runs at most, and single granules too when
        the granules run out.
        """
        granule = self.backend.granularity
        count = len(created)
        if not count:
            return
        if session.wants_lease and count <= min(self.granules, MAX_PLACED_GRANULES) and all(
            c.size == granule for c in created
        ):
            session.lease_target = min(self.granules, max(2 * session.lease_target, 2 * count))
            if session.wants_credit:
                # Behind the granules: a client that commits faster than they are made makes the next ones itself.
                session.credit_target = min(self.credit_max, max(2 * session.credit_target, 2 * count * granule))
        elif session.wants_credit and count <= MAX_OWN_CHUNKS:
            grown = sum(c.size for c in created)
            session.credit_target = min(self.credit_max, max(2 * session.credit_target, 2 * grown))
        else:
            return
        session.lease_used_at = self.clock.monotonic()
        self.due[session.session_id] = None

    def top_up(self, session: Session, until: float = math.inf) -> list[Chunk[C]]:
        """Create granules to bring the session's lease up to its target; the server sends them.

        As many as :meth:`Tenants.lease_room` allows, none while some are
        being asked back, fewer where the device is short. Past ``until``
        (``time.perf_counter()``) it stops after one granule at least, and
        the session is due again for the rest.
        """
        granule = self.backend.granularity
        count = min(session.lease_target - len(session.lease), self.tenants.lease_room(session.tenant) // granule)
        if count <= 0 or session.revoking:
            return []
        if self.arena is None:
            self.arena = self.backend.open_arena(granule, False)
        created: list[Chunk[C]] = []
        for _ in range(count):
            if created and time.perf_counter() >= until:
                self.due_again([session.session_id])
                break
            try:
                chunk = self.chunks.make(self.arena, 0, granule)
            except (HbmdError, OSError) as exc:
                log.debug("lease for session %d stopped at %d granules: %s", session.session_id, len(created), exc)
                break
            session.lease[chunk.chunk_id] = chunk
            created.append(chunk)
        self._account(session, len(created) * granule)
        return created

    def top_up_credit(self, session: Session) -> int:
        """Grant what brings the session's credit up to its target, as far as :meth:`Tenants.lease_room` allows, in
        whole granules; none while its credit is asked back. The bytes granted, for the server to send."""
        granule = self.backend.granularity
        wanted = min(session.credit_target - session.credit, self.tenants.lease_room(session.tenant))
        granted = max(0, wanted) // granule * granule
        if not granted or session.credit_asked_back:
            return 0
        session.credit += granted
        self._account(session, granted)
        return granted

    def withdraw(self, session: Session, granted: int) -> None:
        """Undo :meth:`top_up_credit`'s grant of ``granted`` bytes: its client never heard of it."""
        granted = min(granted, session.credit)
        session.credit -= granted
        self._account(session, -granted)

    def bind(self, session: Session, buffer: Buffer[A, C], runs: list[tuple[int, int]], offsets: list[int],
             chunk_sizes: list[int], fds: list[int]) -> list[Chunk[C]]:
        """Take the chunks the client made (``fds``, which the caller closes) to back ``runs`` of ``buffer``, paid
        from the session's credit; returns them.

        One chunk per run, exactly, each checked by the backend; otherwise
        ``InvalidRequest`` and nothing changes. The checks that cost nothing
        come first, whatever the peer sent.
        """
        buffer_id = buffer.buffer_id
        if buffer.shareable:
            raise InvalidRequest(f"buffer {buffer_id} is shareable: the daemon makes its chunks", buffer_id=buffer_id)
        if not len(fds) == len(offsets) == len(chunk_sizes) <= MAX_OWN_CHUNKS:
            raise InvalidRequest(
                f"buffer {buffer_id}: chunks made by the client come at most {MAX_OWN_CHUNKS} at a time, each with an "
                f"offset, a size and an FD; got {len(offsets)} offsets, {len(chunk_sizes)} sizes and {len(fds)} FDs",
                buffer_id=buffer_id,
            )
        if sorted(zip(offsets, chunk_sizes)) != [(start, end - start) for start, end in runs]:
            raise InvalidRequest(
                f"buffer {buffer_id}: the growth needs one chunk per run, {runs[:4]}, got offsets {offsets[:4]} and "
                f"sizes {chunk_sizes[:4]}",
                buffer_id=buffer_id,
            )
        total = sum(chunk_sizes)
        if total > session.credit:
            raise InvalidRequest(
                f"buffer {buffer_id}: chunks of {format_bytes(total)} made on a credit of "
                f"{format_bytes(session.credit)}",
                buffer_id=buffer_id,
            )
        taken: list[Chunk[C]] = []
        with Undo() as undo:
            for offset, size, fd in zip(offsets, chunk_sizes, fds):
                chunk = self.chunks.accept(buffer.arena, offset, size, fd)
                undo.push(self.chunks.release, chunk, buffer.arena)
                taken.append(chunk)
        session.credit -= total
        self._account(session, -total)
        session.lease_used_at = self.clock.monotonic()
        self.due[session.session_id] = None
        return taken

    def bound_before(self, session: Session, buffer: Buffer[A, C], sizes: list[int], offsets: list[int],
                     chunk_sizes: list[int]) -> bool:
        """Whether a bind is one the daemon has taken already: every chunk it names is the buffer's, at that offset
        and of that size, and no segment is below the size it says.

        A resumed client sends again every bind no reply confirmed, not
        knowing which the daemon read before it restarted, or the daemon it
        took over from before the handover (``client/recovery.py``).
        """
        if not offsets or len(sizes) != buffer.num_segments or len(offsets) != len(chunk_sizes):
            return False
        # A new bind grows some segment: it is told apart here, before the chunks are looked at.
        if any(held < wanted for held, wanted in zip(buffer.segment_sizes, sizes)):
            return False
        held = {(chunk.offset, chunk.size) for chunk in buffer.chunks}
        if not held.issuperset(zip(offsets, chunk_sizes)):
            return False
        log.debug("session %d sent again a bind of buffer %d it had taken: nothing to do", session.session_id,
                  buffer.buffer_id)
        return True

    def credit_returned(self, session: Session) -> int:
        """The client gave back all the credit it held: whatever the daemon records as unspent goes (the client's
        binds were read before its return). Returns the bytes."""
        returned, session.credit = session.credit, 0
        session.credit_asked_back = False
        self._account(session, -returned)
        return returned

    @staticmethod
    def check_segments(buffer_id: int, sizes: list[int]) -> None:
        """Refuse a placement or bind of more than :data:`MAX_PLACED_SEGMENTS` segment sizes before any growth is
        worked out from them (``InvalidRequest``)."""
        if len(sizes) > MAX_PLACED_SEGMENTS:
            raise InvalidRequest(
                f"buffer {buffer_id}: a placement or bind carries at most {MAX_PLACED_SEGMENTS} segment sizes, got "
                f"{len(sizes)}",
                buffer_id=buffer_id,
            )

    def check_placement(self, session: Session, buffer: Buffer[Any, Any], sizes: list[int], chunk_ids: list[int],
                        offsets: list[int]) -> None:
        """Refuse, before the growth is worked out, a placement no client sends: into a shareable buffer or one of more
        than :data:`MAX_PLACED_SEGMENTS` segments, of more than :data:`MAX_PLACED_GRANULES` granules, or of chunks not
        leased to the session. Each check costs next to nothing, whatever the peer sent (``InvalidRequest``)."""
        buffer_id = buffer.buffer_id
        if buffer.shareable:
            raise InvalidRequest(
                f"buffer {buffer_id} is shareable: leased granules are plain ones", buffer_id=buffer_id
            )
        self.check_segments(buffer_id, sizes)
        if len(chunk_ids) > MAX_PLACED_GRANULES or len(offsets) != len(chunk_ids):
            raise InvalidRequest(
                f"buffer {buffer_id}: a placement is of at most {MAX_PLACED_GRANULES} granules, each with its offset; "
                f"got {len(chunk_ids)} chunks and {len(offsets)} offsets",
                buffer_id=buffer_id,
            )
        if len(set(chunk_ids)) != len(chunk_ids) or not all(c in session.lease for c in chunk_ids):
            raise InvalidRequest(f"buffer {buffer_id}: chunks {chunk_ids} are not all leased to this session")

    def take(self, session: Session, buffer: Buffer[Any, Any], runs: list[tuple[int, int]], chunk_ids: list[int],
             offsets: list[int]) -> list[Chunk[C]]:
        """Take the leased ``chunk_ids`` out of the session's lease to back ``runs`` of ``buffer`` at ``offsets``.

        The placement passed :meth:`check_placement`; the chunks must be
        exactly the granules the runs need, otherwise ``InvalidRequest`` and
        nothing changes.
        """
        buffer_id = buffer.buffer_id
        granule = self.backend.granularity
        # Counted before any list of granules is made: a peer's sizes may claim a petabyte.
        needed_bytes = sum(end - start for start, end in runs)
        if needed_bytes != len(chunk_ids) * granule:
            raise InvalidRequest(
                f"buffer {buffer_id}: the growth needs {needed_bytes // granule} granules, "
                f"{len(chunk_ids)} were placed",
                buffer_id=buffer_id,
            )
        needed = [start for begin, end in runs for start in range(begin, end, granule)]
        if sorted(offsets) != needed:
            raise InvalidRequest(
                f"buffer {buffer_id}: the growth needs granules at {needed[:8]}, got {sorted(offsets)[:8]}",
                buffer_id=buffer_id,
            )
        placed = []
        for chunk_id, offset in zip(chunk_ids, offsets):
            chunk = session.lease.pop(chunk_id)
            chunk.offset = offset
            placed.append(chunk)
        session.revoking.difference_update(chunk_ids)
        self._account(session, -len(placed) * granule)
        if placed:
            session.lease_used_at = self.clock.monotonic()
            self.due[session.session_id] = None
        return placed

    def given_back(self, session: Session, chunk_ids: list[int]) -> list[int]:
        """The client gave these leased chunks up; those still in its lease are released (others are ignored)."""
        return self.drop(session, [c for c in dict.fromkeys(chunk_ids) if c in session.lease])

    def drop(self, session: Session, chunk_ids: list[int] | None = None) -> list[int]:
        """Release leased chunks (all by default); returns their ids."""
        chunk_ids = list(session.lease) if chunk_ids is None else chunk_ids
        for chunk_id in chunk_ids:
            self.chunks.release(session.lease.pop(chunk_id), self.leased_arena)
        session.revoking.difference_update(chunk_ids)
        self._account(session, -len(chunk_ids) * self.backend.granularity)
        return chunk_ids

    def end_session(self, session: Session) -> None:
        self.drop(session)
        self.credit_returned(session)
        self.due.pop(session.session_id, None)

    def hold_off(self, session: Session) -> None:
        """Lease the session nothing more until it commits again (it is giving back what it holds)."""
        session.lease_target = 0
        session.credit_target = 0
        self.due.pop(session.session_id, None)

    def ask_back(self, session: Session) -> None:
        """Ask the session for its unplaced granules and its credit, and lease it none until it commits again."""
        session.lease_target = 0
        session.credit_target = 0
        asked = [c for c in session.lease if c not in session.revoking]
        credit = session.credit > 0 and not session.credit_asked_back
        if (asked or credit) and not self._asked_back(session):
            session.revoking_since = self.clock.monotonic()
        if asked:
            session.revoking.update(asked)
            self.revokes_due.append((session, asked))
        if credit:
            session.credit_asked_back = True
            self.credit_revokes_due.append(session)

    @staticmethod
    def _asked_back(session: Session) -> bool:
        return bool(session.revoking) or session.credit_asked_back

    def withheld_bytes(self, sessions: list[Session], now: float) -> int:
        """Leased bytes asked back more than :data:`LEASE_RETURN_PATIENCE_S` ago and not given back yet: theirs until
        their sessions read the request, or end."""
        late = [s for s in sessions if self._asked_back(s) and now - s.revoking_since > LEASE_RETURN_PATIENCE_S]
        return sum(self.backend.granularity * len(s.revoking) + s.credit * s.credit_asked_back for s in late)

    def ask_back_idle(self, sessions: Iterable[Session], now: float) -> None:
        """Ask back the leases their sessions have not drawn on for :attr:`idle_s`: demand went elsewhere."""
        for session in sessions:
            if ((session.lease or session.credit) and not self._asked_back(session)
                    and now - session.lease_used_at > self.idle_s):
                self.ask_back(session)

    def adopt(self, session: Session, chunks: list[Chunk[C]], credit: int) -> None:
        """Granules journaled as leased to ``session`` before a restart, adopted into :attr:`arena` by the caller, and
        the credit it held."""
        for chunk in chunks:
            session.lease[chunk.chunk_id] = chunk
        session.credit = credit
        self._account(session, sum(c.size for c in chunks) + credit)
        self.chunks.adopted(chunks)

    def adopted_arena(self) -> A:
        """The arena leased granules live in, to adopt journaled ones into after a restart."""
        if self.arena is None:
            self.arena = parkable(self.backend).adopt_arena(self.backend.granularity, False)
        return self.arena

    @property
    def leased_arena(self) -> A:
        """The arena of the granules leased, made with the first of them."""
        assert self.arena is not None, "no granule was leased yet"
        return self.arena

    def export(self, chunk: Chunk[C]) -> int:
        """A new FD for a leased granule."""
        assert chunk.handle is not None, "a leased granule is the daemon's own"
        return self.backend.export(self.leased_arena, chunk.handle)
