"""A state rebuilt from its records and its chunks' descriptors: after a restart (the journal and the FD store) or in a
takeover (what the daemon taken over sent).

Every record is read whole (:mod:`.journaled`) before anything of it is
taken. One that cannot be read, or whose chunks did not all come back, is
lost alone, logged at WARNING with what it held and why; so is what cannot
go on without it: a session that owns or reads a buffer lost is not resumed
(its process maps memory the daemon would no longer count: its client starts
over and declares it, as after a cold restart), and a session lost takes its
anonymous buffers with it, as a session's end does. A restore never fails
over one record, which under ``Restart=on-failure`` would loop forever.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hbmd.proto.undo import Undo
from hbmd.proto.units import format_bytes, round_up

from ..backends import A, C, parkable
from ..state import Buffer, Chunk, Session, State
from .journal import Image
from .journaled import JournaledBuffer, JournaledSession, buffer_of, session_of

log = logging.getLogger("hbmd.persist")

JOURNAL_VERSION = 7
"""7: records framed one by one and checksummed, a session's record naming the buffers it holds, a growth how many
chunks it follows; 6: a buffer's chunks in the host tier (``host``: their ids), which an older daemon would count as
device memory; 5: a buffer that only grew is journaled by its new chunks (``b+``); 4: every session and buffer, msgpack
records; 3 (JSON, persistent buffers only) recorded a chunk as ``[id, offset, size]``; 2, each segment's capacity and
size, and a fourth field of a chunk, always 0; 1, equal segments, that fourth field 0 on CUDA (the host backend's
offsets into an arena parked whole are refused: no later daemon adopts an arena). A buffer's grace period as an orphan
(``orphan``) needs no new version: a daemon that does not know it keeps the orphan until deleted."""


class NewerState(ValueError):
    """A journal or handover written by a newer daemon: this one does not know what it may hold."""


def chunk_name(chunk_id: int) -> str:
    """The FD-store name of a chunk, whether it backs a buffer, waits in a defragment or is leased: ``c`` and its id
    in base 36 (short: see ``persist.MAX_PARKED``)."""
    digits = ""
    while True:
        chunk_id, digit = divmod(chunk_id, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[digit] + digits
        if not chunk_id:
            return "c" + digits


def legacy_chunk_name(buffer_id: int, chunk_id: int) -> str:
    """The name a daemon of journal version 3 or older parked a persistent buffer's chunk under."""
    return f"hbmd-c{buffer_id}-{chunk_id}"


def restore(state: State[Any, Any], image: Image, fds: dict[str, int], resume_window_s: float) -> tuple[int, int]:
    """Rebuild the state of ``image`` from the chunks' descriptors in ``fds`` (taken out of it as they are adopted;
    the caller closes what is left); returns how many sessions and buffers came back.

    Sessions come back resuming, until ``resume_window_s`` from now.
    Raises :class:`NewerState`, with nothing restored, for an image of a
    later version than this daemon's.
    """
    version = _version(image)
    meta = image.get("meta")
    if isinstance(meta, dict):
        state.sessions.credentials.restored(meta)
    for session_id in image.get("lost_sessions", ()):
        state.sessions.credentials.lost(session_id)  # lost with its record: its client starts over
    state.sessions.continue_from(_next_session(image))
    buffers, refused = _buffers_that_come_back(state, _table(image, "buffers"), fds, version)
    resume_by = state.clock.monotonic() + resume_window_s
    taken = {c.chunk_id for b in buffers.values() for c in (*b.chunks, *b.pending)}
    sessions = 0
    for key, record in _table(image, "sessions").items():
        try:
            session = session_of(record, state.backend.granularity, state.tenants.budget_bytes)
            if session.session_id != key or session.session_id in state.sessions.by_id:
                raise ValueError(f"its id {session.session_id} is not its own")
        except ValueError as exc:
            log.warning("session %s is lost: %s; its client starts over", key, exc)
            if type(key) is int:
                state.sessions.credentials.lost(key)
            continue
        if key in refused or (session.holds is not None and not session.holds <= buffers.keys()):
            # Resumed, it would go on mapping memory the daemon no longer counts: refused its resume, its client starts
            # over and declares what it maps, as after a cold restart.
            log.warning("session %s is not restored: a buffer of it did not come back whole; its client starts over",
                        key)
            state.sessions.credentials.lost(key)
            continue
        if any(chunk_name(c) not in fds and c not in taken for c in session.lease):
            # Its client may have placed the granule in a buffer without a round trip, a placement this daemon never
            # read: resumed, it would map what no record holds, and its next commit would map fresh pages over it.
            log.warning("session %s is not restored: a granule leased to it did not come back; its client starts over",
                        key)
            state.sessions.credentials.lost(key)
            continue
        try:
            _restore_session(state, session, fds, taken, resume_by)
            sessions += 1
        except Exception as exc:  # whatever the backend raised: lose this session, not the daemon
            log.warning("session %s is lost: %s", key, exc)
    restored = 0
    for buffer in buffers.values():
        try:
            _restore_buffer(state, buffer, fds, version)
            restored += 1
        except Exception as exc:  # likewise
            log.warning("buffer %d %r (%s) is lost: %s", buffer.buffer_id, buffer.name, _size(buffer), exc)
    return sessions, restored


def _next_session(image: Image) -> int:
    """The id after every session id of the image's line of daemons: its sessions, those its journal lost or ended
    since it was last rewritten (``last_session``), and those ended before (the meta's ``next_session``)."""
    meta = image.get("meta")
    named = [image.get("last_session"), *_table(image, "sessions"), *image.get("lost_sessions", ())]
    after = meta.get("next_session", 1) if isinstance(meta, dict) else 1
    ids = [n for n in named if type(n) is int]
    return max(after if type(after) is int else 1, max(ids, default=0) + 1)


def _version(image: Image) -> int:
    meta = image.get("meta")
    version = meta.get("version") if isinstance(meta, dict) else None
    if type(version) is not int or version < 1:
        return JOURNAL_VERSION  # a header lost: read as this version's, whose reading accepts every earlier one's
    if version > JOURNAL_VERSION:
        raise NewerState(f"it is of version {version}, newer than this daemon's {JOURNAL_VERSION}: run the newer hbmd")
    return version


def _table(image: Image, key: str) -> dict[Any, Any]:
    table = image.get(key, {})
    if not isinstance(table, dict):
        log.warning("the state's %s are not a map: none is restored", key)
        return {}
    return table


def _buffers_that_come_back(
    state: State[Any, Any], records: dict[Any, Any], fds: dict[str, int], version: int
) -> tuple[dict[int, JournaledBuffer], set[Any]]:
    """The buffers that can come back whole, by id, and the sessions that cannot resume without one that cannot: a
    record that cannot be read, claims what another holds, or whose descriptors were not all passed back (a service
    manager that dropped its store)."""
    buffers: dict[int, JournaledBuffer] = {}
    refused: set[Any] = set()
    chunk_ids: set[int] = set()
    names: set[tuple[int, str]] = set()
    for key, record in records.items():
        try:
            buffer = buffer_of(record, state.backend.granularity)
            ids = {c.chunk_id for c in (*buffer.chunks, *buffer.pending)}
            if buffer.buffer_id != key or ids & chunk_ids or (buffer.uid, buffer.name) in names:
                raise ValueError("it claims an id, a chunk or a name another buffer holds")
            needed = _needed(buffer, version)
            missing = [name for name in needed if name not in fds]
            if missing:
                raise ValueError(f"{len(missing)} of its {len(needed)} parked descriptors did not come back "
                                 f"({', '.join(missing[:4])})")
        except ValueError as exc:
            log.warning("buffer %s %r (%s) is lost: %s", key, _field(record, "name"), _journaled_size(record), exc)
            refused |= _sessions_of(record)
            continue
        buffers[buffer.buffer_id] = buffer
        chunk_ids |= ids
        if buffer.persistent:
            names.add((buffer.uid, buffer.name))
    return buffers, refused


def _field(record: Any, key: str) -> Any:
    return record.get(key) if isinstance(record, dict) else None


def _sessions_of(record: Any) -> set[Any]:
    """The sessions a buffer record that cannot be read names, as far as it can be read."""
    sessions = {_field(record, "owner")}
    readers = _field(record, "readers")
    if isinstance(readers, list):
        sessions |= {reader[0] for reader in readers if isinstance(reader, list) and reader}
    return sessions - {0, None}


def _journaled_size(record: Any) -> str:
    """The bytes a record says its buffer held, for the log line that reports it lost."""
    try:
        return format_bytes(sum(int(chunk[2]) for chunk in record["chunks"]))
    except (KeyError, TypeError, ValueError, IndexError):
        return "size unknown"


def _size(buffer: JournaledBuffer) -> str:
    return format_bytes(sum(c.size for c in buffer.chunks))


def _needed(buffer: JournaledBuffer, version: int) -> list[str]:
    """The names its chunks were parked under, in order, but for those held only by the processes that map them."""
    def named(chunk_id: int) -> str:
        return legacy_chunk_name(buffer.buffer_id, chunk_id) if version < 4 else chunk_name(chunk_id)

    return [named(c.chunk_id) for c in (*buffer.chunks, *buffer.pending) if c.chunk_id not in buffer.held]


def _restore_session(state: State[Any, Any], record: JournaledSession, fds: dict[str, int], taken: set[int],
                     resume_by: float) -> None:
    granule = state.backend.granularity
    lease: list[Chunk[Any]] = []
    with Undo() as undo:
        arena = state.leases.adopted_arena()
        claimed = []
        for chunk_id in record.lease:
            name = chunk_name(chunk_id)
            if name not in fds or chunk_id in taken:
                continue  # placed in a buffer, whose record the journal kept
            handle = parkable(state.backend).adopt(arena, 0, granule, fds[name])
            undo.push(state.backend.release, arena, handle)
            lease.append(Chunk(chunk_id, 0, granule, handle))
            claimed.append(name)
            taken.add(chunk_id)
        session = Session(
            session_id=record.session_id, token=os.urandom(16).hex(), pid=record.pid, uid=record.uid,
            gid=record.gid, client_name=record.name, tenant=state.tenants.named(record.tenant), admin=record.admin,
            wants_lease=record.wants_lease, wants_credit=record.wants_credit, credential_hash=record.credential,
            previous_credential_hash=record.previous_credential,
            # Its client promotes what it demoted for the daemon once told there is room: the successor tells it.
            demoted_under_pressure=record.demoted, answer=record.answer,
        )
        state.sessions.restore(session, resume_by)
        session.grown_at = state.clock.monotonic()
        state.tenants.hold(session.tenant)
        state.leases.adopt(session, lease, record.credit)
    _claimed(fds, claimed)


def _claimed(fds: dict[str, int], names: list[str]) -> None:
    """The chunks parked under ``names`` are adopted (the backend holds copies): close the descriptors passed in.

    Until then they stay in ``fds``, so that those of a session that is not
    restored are closed and unparked with the unclaimed ones.
    """
    for name in names:
        os.close(fds.pop(name))


def rebuild_buffer(
    state: State[A, C], record: JournaledBuffer, owner: Session | None, arena: A, chunks: list[Chunk[C]],
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
        owner=owner, owner_uid=record.uid, tenant=state.tenants.named(record.tenant), capacity=record.capacity,
        reserved=round_up(record.capacity, state.backend.granularity), segment_capacities=record.capacities,
        arena=arena, segment_sizes=record.sizes, chunks=chunks, pending=pending, sealed=record.sealed,
        unsealed_since=(record.unsealed_since or state.clock.unix()) if unsealed else 0.0,
    )
    state.buffers.adopt(buffer)
    if owner is not None:
        owner.buffers[buffer.buffer_id] = buffer
    for session_id, claims in record.readers.items():
        reader = state.sessions.by_id.get(session_id)
        if reader is not None:
            buffer.readers[session_id] = claims
            reader.reading[buffer.buffer_id] = buffer
    state.orphans.restored(buffer, *record.orphan)
    return buffer


def _restore_buffer(state: State[Any, Any], record: JournaledBuffer, fds: dict[str, int], version: int) -> None:
    """Adopt one journaled buffer, taking its FDs out of ``fds``; raises, taking none, where it cannot be adopted
    whole."""
    backend = parkable(state.backend)
    owner = state.sessions.by_id.get(record.owner) if record.owner else None
    if record.owner and owner is None and not record.persistent:
        # As when a session ends: its anonymous buffers go with it, its persistent ones stay, orphans.
        raise ValueError(f"its session {record.owner} did not come back")
    if owner is None and not record.readers.keys() & state.sessions.by_id.keys() and record.held:
        raise ValueError("no session that maps it came back, and only they hold its memory")
    if record.persistent and (record.uid, record.name) in state.buffers.persistent:
        raise ValueError("a persistent buffer of its name is restored already")
    arena = backend.adopt_arena(round_up(record.capacity, backend.granularity), record.shareable)
    adopted: dict[str, list[Chunk[Any]]] = {"chunks": [], "pending": []}
    with Undo() as undo:
        undo.push(backend.close_arena, arena)
        names = iter(_needed(record, version))
        for part, chunks in (("chunks", record.chunks), ("pending", record.pending)):
            for chunk in chunks:
                handle = None
                if chunk.chunk_id not in record.held:
                    name = next(names)
                    handle = backend.adopt(arena, chunk.offset, chunk.size, fds[name])
                    undo.push(backend.release, arena, handle)
                    # The backend holds its own copy: one descriptor a chunk, not two, at any moment of a restore of
                    # thousands. Should a later chunk fail, the name is unparked with those of buffers not restored.
                    os.close(fds.pop(name))
                adopted[part].append(Chunk(chunk.chunk_id, chunk.offset, chunk.size, handle, tier=chunk.tier))
        rebuild_buffer(state, record, owner, arena, adopted["chunks"], adopted["pending"])
    log.info("restored buffer %d %r: %s in %d chunks", record.buffer_id, record.name, _size(record),
             len(adopted["chunks"]))
