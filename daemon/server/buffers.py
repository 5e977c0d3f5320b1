"""Buffer requests (``hbmd.proto.buffers``): create, commit, map again, share and drop buffers.

A request that hands chunks to the client (commit, remap, attach, graft,
defragment, move) is refused first while too many FD batches wait unread for the
session (``Outbox.check_reading``), so a refusal changes nothing; the new
chunks' FDs are then queued on its handle socket and described in the
:class:`Committed` reply.
"""

from __future__ import annotations

import logging

from hbmd.proto import (
    Attach,
    BufferCreated,
    Commit,
    CommitSegments,
    Committed,
    CreateBuffer,
    Defragment,
    Delete,
    Detach,
    Detached,
    FinishDefragment,
    Free,
    Freed,
    Graft,
    Move,
    Redeclare,
    Release,
    Released,
    Remap,
    Seal,
    Sealed,
)
from hbmd.proto.units import format_bytes

from ..backends import A, C
from ..state import Answer, Buffer, Chunk
from .connection import HandleConnection
from .registry import RequestHandlers, handles

log = logging.getLogger("hbmd.server.buffers")


class BufferRequests(RequestHandlers[A, C]):
    """A session's buffers: their life from create to free, and persistent ones shared across sessions."""

    @handles(CreateBuffer)
    def create_buffer(self, conn: HandleConnection[A, C], request_id: int, msg: CreateBuffer) -> BufferCreated:
        """Reserve a buffer; nothing is committed yet."""
        buffer = self.state.buffers.create(
            conn.opened_session, msg.capacity, msg.num_segments, msg.name, msg.persistent, msg.shareable,
            msg.segment_capacities, msg.keep_orphan_s,
        )
        return BufferCreated(self.state.sessions.info_for_holder(buffer, conn.opened_session))

    @handles(Commit, CommitSegments)
    def commit(self, conn: HandleConnection[A, C], request_id: int, msg: Commit | CommitSegments) -> Committed:
        """Grow the segments' committed prefixes, all to one size (``Commit``) or each to its own
        (``CommitSegments``)."""
        self.plane.outbox.check_reading(conn)
        sizes = msg.bytes_per_segment if isinstance(msg, Commit) else msg.sizes
        chunks = self.state.commit(conn.opened_session, msg.buffer_id, sizes)
        return self._deliver(conn, request_id, self.state.buffers.by_id[msg.buffer_id], chunks)

    @handles(Remap)
    def remap(self, conn: HandleConnection[A, C], request_id: int, msg: Remap) -> Committed:
        """Send every chunk of the buffer again, for a client whose mapping failed midway."""
        self.plane.outbox.check_reading(conn)
        buffer = self.state.buffers.remappable(conn.opened_session, msg.buffer_id)
        return self._deliver(conn, request_id, buffer, buffer.chunks)

    @handles(Attach)
    def attach(self, conn: HandleConnection[A, C], request_id: int, msg: Attach) -> Committed:
        """Take over an orphaned persistent buffer, or read a sealed one (``readonly``); all its chunks come to map."""
        self.plane.outbox.check_reading(conn)
        uneven_ok = conn.protocol_minor >= 1
        if msg.readonly:
            buffer = self.state.sealed.attach_reader(conn.opened_session, msg.name, uneven_ok=uneven_ok)
            log.info(
                "session %d reads sealed buffer %r (%d readers)",
                conn.opened_session.session_id, msg.name, len(buffer.readers),
            )
        else:
            buffer = self.plane.unless_holder_exited(
                lambda: self.state.orphans.attach(conn.opened_session, msg.name, uneven_ok=uneven_ok)
            )
            log.info(
                "session %d attached persistent buffer %r (%s)",
                conn.opened_session.session_id, msg.name, format_bytes(buffer.physical_bytes),
            )
        return self._deliver(conn, request_id, buffer, buffer.chunks)

    @handles(Graft)
    def graft(self, conn: HandleConnection[A, C], request_id: int, msg: Graft) -> Committed:
        """Give an orphan's chunks to the session's empty buffer of as many segments; all of them come to map there."""
        self.plane.outbox.check_reading(conn)
        session = conn.opened_session
        buffer = self.plane.unless_holder_exited(lambda: self.state.graft(session, msg.buffer_id, msg.name))
        log.info("session %d grafted orphan %r into buffer %d (%s in %d chunks)", session.session_id, msg.name,
                 buffer.buffer_id, format_bytes(buffer.physical_bytes), len(buffer.chunks))
        return self._deliver(conn, request_id, buffer, buffer.chunks)

    @handles(Redeclare)
    def redeclare(self, conn: HandleConnection[A, C], request_id: int, msg: Redeclare) -> BufferCreated:
        """Record a buffer the client still maps after a cold restart; its memory counts from now on."""
        buffer = self.state.redeclare(
            conn.opened_session, msg.buffer_id, msg.segment_capacities, msg.segment_sizes,
            [(c.offset, c.size) for c in msg.chunks],
            msg.name, msg.persistent, msg.shareable, msg.sealed, msg.readonly, msg.tier, msg.name_proof,
        )
        log.info("session %d declared again %s buffer %d%s: %d bytes its process still maps",
                 conn.opened_session.session_id, "a read claim on" if msg.readonly else "its",
                 buffer.buffer_id, f" {buffer.name!r}" if buffer.name else "", buffer.physical_bytes)
        return BufferCreated(self.state.sessions.info_for_holder(buffer, conn.opened_session))

    @handles(Defragment)
    def defragment(self, conn: HandleConnection[A, C], request_id: int, msg: Defragment) -> Committed:
        """Re-back each committed run with one new chunk; the old ones go at once or, preserving, at the finish."""
        self.plane.outbox.check_reading(conn)
        chunks = self.state.buffers.defragment(conn.opened_session, msg.buffer_id, msg.preserve)
        return self._deliver(conn, request_id, self.state.buffers.by_id[msg.buffer_id], chunks)

    @handles(FinishDefragment)
    def finish_defragment(self, conn: HandleConnection[A, C], request_id: int, msg: FinishDefragment) -> Released:
        """Drop the old chunks of a preserving defragment (or the new ones, if the client gave up)."""
        freed = self.state.buffers.finish_defragment(conn.opened_session, msg.buffer_id, msg.keep_new)
        return Released(self.state.buffers.by_id[msg.buffer_id].info(), freed)

    @handles(Move)
    def move(self, conn: HandleConnection[A, C], request_id: int, msg: Move) -> Committed:
        """Make the buffer's chunks in the other tier, beside the old ones; the finish drops the old ones."""
        self.plane.outbox.check_reading(conn)
        chunks = self.state.move(conn.opened_session, msg.buffer_id, msg.tier)
        buffer = self.state.buffers.by_id[msg.buffer_id]
        if chunks:
            log.info("session %d moves buffer %d (%s) to the %s tier", conn.opened_session.session_id, buffer.buffer_id,
                     format_bytes(buffer.pending_bytes), msg.tier)
        return self._deliver(conn, request_id, buffer, chunks)

    @handles(Release)
    def release(self, conn: HandleConnection[A, C], request_id: int, msg: Release) -> Released:
        """Drop every chunk of the buffer and keep its reservation."""
        freed = self.state.buffers.release(conn.opened_session, msg.buffer_id)
        return Released(self.state.buffers.by_id[msg.buffer_id].info(), freed)

    @handles(Free)
    def free(self, conn: HandleConnection[A, C], request_id: int, msg: Free) -> Freed:
        """Drop the buffer entirely."""
        freed = self.plane.unless_holder_exited(lambda: self.state.free(conn.opened_session, msg.buffer_id))
        return Freed(msg.buffer_id, freed)

    @handles(Seal)
    def seal(self, conn: HandleConnection[A, C], request_id: int, msg: Seal) -> Sealed:
        """Make a persistent buffer immutable, so sessions of its user may read it side by side."""
        buffer = self.state.sealed.seal(conn.opened_session, msg.buffer_id)
        log.info(
            "session %d sealed persistent buffer %r (%s)", conn.opened_session.session_id, buffer.name,
            format_bytes(buffer.physical_bytes),
        )
        return Sealed(buffer.info())

    @handles(Detach)
    def detach(self, conn: HandleConnection[A, C], request_id: int, msg: Detach) -> Detached:
        """Let go of a persistent buffer, which stays as an orphan, or drop one read claim (``readonly``)."""
        if msg.readonly:
            return Detached(self.state.sealed.detach_reader(conn.opened_session, msg.buffer_id).info(), 0)
        buffer = self.state.buffers.of(conn.opened_session, msg.buffer_id)
        freed = self.state.orphans.detach(conn.opened_session, msg.buffer_id)
        log.info(
            "session %d detached persistent buffer %r (%s)",
            conn.opened_session.session_id, buffer.name, format_bytes(buffer.physical_bytes),
        )
        return Detached(buffer.info(), freed)

    @handles(Delete)
    def delete(self, conn: HandleConnection[A, C], request_id: int, msg: Delete) -> Freed:
        """Free an orphaned persistent buffer by name: this user's, or for an admin anyone's."""
        buffer_id, freed = self.plane.unless_holder_exited(
            lambda: self.state.delete(conn.opened_session, msg.name, msg.owner_uid)
        )
        owner = conn.uid if msg.owner_uid == -1 else msg.owner_uid
        log.info(
            "session %d (uid %d) deleted persistent buffer %r of uid %d",
            conn.opened_session.session_id, conn.uid, msg.name, owner,
        )
        return Freed(buffer_id, freed)

    def deliver_again(self, conn: HandleConnection[A, C], request_id: int, answer: Answer) -> Committed:
        """The chunks of the session's answered request ``request_id`` once more, its reply having been lost with the
        daemon before a restart."""
        self.plane.outbox.check_reading(conn)
        buffer = self.state.buffers.of(conn.opened_session, answer.buffer_id)
        by_id = {c.chunk_id: c for c in (*buffer.chunks, *buffer.pending)}
        return self._deliver(conn, request_id, buffer, [by_id[c] for c in answer.chunk_ids if c in by_id])

    def _deliver(
        self, conn: HandleConnection[A, C], request_id: int, buffer: Buffer[A, C], chunks: list[Chunk[C]]
    ) -> Committed:
        """Queue the chunks' FDs on the session's handle socket and describe them in the reply."""
        batches = self.plane.outbox.deliver(conn, request_id, buffer, chunks)
        return Committed(self.state.sessions.info_for_holder(buffer, conn.opened_session),
                         [c.info() for c in chunks], batches)
