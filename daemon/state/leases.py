"""Leases: granules made ahead of need, which a session's client places itself.

A session that asks for them is leased granules created before any commit
needs them (:meth:`Leases.top_up`), charged to its tenant at once. Its
client places them in its buffers itself and says so (:meth:`Leases.place`),
so a commit that fits the lease costs no round trip. The lease grows when a
commit found it short, stays empty while the budget is tight, and is taken
back first under pressure: unplaced granules are asked back (a client may be
placing them at that moment, so only it can give them up); a client whose own
commit does not fit gives its whole lease back and retries.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Generic

from hbmd.proto import MAX_PLACED_GRANULES, MAX_PLACED_SEGMENTS
from hbmd.proto.errors import HbmdError, InvalidRequest

from ..backends import A, Backend, C
from .chunks import Chunks
from .records import Buffer, Chunk, Session
from .tenants import Tenants

log = logging.getLogger("hbmd.state")

DEFAULT_LEASE_BYTES = 64 << 20
"""The most one session is leased (``--lease``): 32 granules of 2 MiB."""
LEASE_IDLE_S = 30.0
"""A lease the session has not drawn on for this long is asked back; it grows again with the next demand."""
LEASE_RETURN_PATIENCE_S = 2.0
"""A client's listener gives asked-back granules back within milliseconds; one that has not after this is not reading
its socket (stopped, hung), and a commit refused for want of them is no longer told that a retry will find them."""


class Leases(Generic[A, C]):
    """Every session's leased granules; they live in one arena of their own until placed."""

    def __init__(self, backend: Backend[A, C], chunks: Chunks[A, C], tenants: Tenants, lease_bytes: int,
                 idle_s: float) -> None:
        """``lease_bytes``: the most one session is leased (0: no leases); ``idle_s``: see :data:`LEASE_IDLE_S`."""
        self.backend = backend
        self.chunks = chunks
        self.tenants = tenants
        self.granules = max(0, lease_bytes) // backend.granularity
        self.idle_s = idle_s
        self.arena: A | None = None
        self.due: set[int] = set()
        """Sessions (by id) whose lease may need topping up, for the server to serve."""
        self.revokes_due: list[tuple[Session, list[int]]] = []
        """Leased chunks asked back, for the server to send."""

    def take_due(self) -> set[int]:
        """The sessions whose lease may need topping up since this was last asked; the server serves them."""
        due, self.due = self.due, set()
        return due

    def bytes_for(self, session: Session) -> int:
        """The most ``session`` may be leased: 0 unless it asked for leases."""
        return self.granules * self.backend.granularity if session.wants_lease else 0

    def _account(self, session: Session, leased: int) -> None:
        session.leased_bytes += leased
        self.tenants.charge(session.tenant, leased=leased)

    def note_demand(self, session: Session, created: list[Chunk[C]]) -> None:
        """A commit that made ``created`` came through the daemon: where a lease could have served it, the lease was
        short, so it grows (up to the most allowed).

        A lease serves commits of runs of one granule, :data:`MAX_PLACED_GRANULES` at most.
        """
        granule = self.backend.granularity
        count = len(created)
        if session.wants_lease and 0 < count <= min(self.granules, MAX_PLACED_GRANULES) and all(
            c.size == granule for c in created
        ):
            session.lease_target = min(self.granules, max(2 * session.lease_target, 2 * count))
            session.lease_used_at = time.monotonic()
            self.due.add(session.session_id)

    def top_up(self, session: Session) -> list[Chunk[C]]:
        """Create granules to bring the session's lease up to its target; the server sends them.

        As many as :meth:`Tenants.lease_room` allows, none while some are
        being asked back, fewer where the device is short.
        """
        granule = self.backend.granularity
        count = min(session.lease_target - len(session.lease), self.tenants.lease_room(session.tenant) // granule)
        if count <= 0 or session.revoking:
            return []
        if self.arena is None:
            self.arena = self.backend.open_arena(granule, False)
        created: list[Chunk[C]] = []
        for _ in range(count):
            try:
                chunk = self.chunks.make(self.arena, 0, granule)
            except (HbmdError, OSError) as exc:
                log.debug("lease for session %d stopped at %d granules: %s", session.session_id, len(created), exc)
                break
            session.lease[chunk.chunk_id] = chunk
            created.append(chunk)
        self._account(session, len(created) * granule)
        return created

    def check_placement(self, session: Session, buffer: Buffer[Any, Any], sizes: list[int], chunk_ids: list[int],
                        offsets: list[int]) -> None:
        """Refuse, before the growth is worked out, a placement no client sends: into a shareable buffer or one of more
        than :data:`MAX_PLACED_SEGMENTS` segments, of more than :data:`MAX_PLACED_GRANULES` granules, or of chunks not
        leased to the session. Each check costs next to nothing, whatever the peer sent (``InvalidRequest``)."""
        buffer_id = buffer.buffer_id
        if buffer.shareable:
            raise InvalidRequest(f"buffer {buffer_id} is shareable: leased granules are plain ones", buffer_id=buffer_id)
        if len(sizes) > MAX_PLACED_SEGMENTS:
            raise InvalidRequest(
                f"buffer {buffer_id}: a placement carries at most {MAX_PLACED_SEGMENTS} segment sizes, got {len(sizes)}",
                buffer_id=buffer_id,
            )
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
                f"buffer {buffer_id}: the growth needs {needed_bytes // granule} granules, {len(chunk_ids)} were placed",
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
            session.lease_used_at = time.monotonic()
            self.due.add(session.session_id)
        return placed

    def given_back(self, session: Session, chunk_ids: list[int]) -> list[int]:
        """The client gave these leased chunks up; those still in its lease are released (others are ignored)."""
        return self.drop(session, [c for c in dict.fromkeys(chunk_ids) if c in session.lease])

    def drop(self, session: Session, chunk_ids: list[int] | None = None) -> list[int]:
        """Release leased chunks (all by default); returns their ids."""
        chunk_ids = list(session.lease) if chunk_ids is None else chunk_ids
        for chunk_id in chunk_ids:
            self.chunks.release(session.lease.pop(chunk_id), self.arena)
        session.revoking.difference_update(chunk_ids)
        self._account(session, -len(chunk_ids) * self.backend.granularity)
        return chunk_ids

    def end_session(self, session: Session) -> None:
        self.drop(session)
        self.due.discard(session.session_id)

    def hold_off(self, session: Session) -> None:
        """Lease the session nothing more until it commits again (it is giving back what it holds)."""
        session.lease_target = 0
        self.due.discard(session.session_id)

    def ask_back(self, session: Session) -> None:
        """Ask the session for its unplaced granules, and lease it none until it commits again."""
        session.lease_target = 0
        asked = [c for c in session.lease if c not in session.revoking]
        if asked:
            if not session.revoking:
                session.revoking_since = time.monotonic()
            session.revoking.update(asked)
            self.revokes_due.append((session, asked))

    def withheld_bytes(self, sessions: list[Session], now: float) -> int:
        """Leased bytes asked back more than :data:`LEASE_RETURN_PATIENCE_S` ago and not given back yet: theirs until
        their sessions read the request, or end."""
        late = (s for s in sessions if s.revoking and now - s.revoking_since > LEASE_RETURN_PATIENCE_S)
        return self.backend.granularity * sum(len(s.revoking) for s in late)

    def ask_back_idle(self, sessions: list[Session], now: float) -> None:
        """Ask back the leases their sessions have not drawn on for :attr:`idle_s`: demand went elsewhere."""
        for session in sessions:
            if session.lease and not session.revoking and now - session.lease_used_at > self.idle_s:
                self.ask_back(session)

    def adopt(self, session: Session, chunks: list[Chunk[C]]) -> None:
        """Granules journaled as leased to ``session`` before a restart, adopted into :attr:`arena` by the caller."""
        for chunk in chunks:
            session.lease[chunk.chunk_id] = chunk
        self._account(session, sum(c.size for c in chunks))
        self.chunks.adopted(chunks)

    def adopted_arena(self) -> A:
        """The arena leased granules live in, to adopt journaled ones into after a restart."""
        if self.arena is None:
            self.arena = self.backend.adopt_arena(self.backend.granularity, False)
        return self.arena

    def export(self, chunk: Chunk[C]) -> int:
        """A new FD for a leased granule."""
        return self.backend.export(self.arena, chunk.handle)
