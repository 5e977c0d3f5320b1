"""Whether the state's invariants hold: the checker the tests and ``--check-invariants`` run."""

from __future__ import annotations

from typing import Any

from hbmd.proto import TIER_HOST
from hbmd.proto.runs import merge_runs

from .buffers import Buffers
from .records import Buffer, Chunk, Session
from .sessions import Sessions
from .tenants import Tenants


def require(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def check_invariants(sessions: Sessions, buffers: Buffers[Any, Any], tenants: Tenants) -> None:
    """Raise ``AssertionError`` naming the first thing that does not add up.

    Committed bytes equal the sum of chunk sizes, leased bytes the sum of
    the sessions' leased granules and credit, and both the sum of tenant usage; each
    buffer's chunks lie inside it, on granule boundaries, never back a
    granule twice and back exactly its committed prefixes (a preserving
    defragment's or a move's pending chunks likewise, on their own, and add
    up to the pending total); a
    buffer's mapped chunks are all in one tier, its pending ones too, and
    host-tier bytes add up to the host total and to the tenants'; every buffer and
    session points at the other, readers included, and only an orphan is
    due to be freed, looked for when it is due; only a persistent
    buffer is sealed, only a sealed one has readers, and every unsealed
    persistent one says since when it held its name so; every tenant has
    the limits the config in force gives it and is kept while held, and the
    running total of unmet guarantees is the config's tenants' sum.
    """
    chunk_ids: set[int] = set()
    total = host = pending = 0
    for buffer in buffers.by_id.values():
        total += _check_buffer(sessions, buffers, buffer, chunk_ids)
        host += buffer.host_bytes
        pending += buffer.pending_bytes
    require(buffers.pending_bytes == pending,
            f"pending {buffers.pending_bytes} != {pending} in buffers' pending chunks")
    require(tenants.host_bytes == host, f"host tier {tenants.host_bytes} != {host} in buffers' host chunks")
    require(sum(t.host_bytes for t in tenants.by_name.values()) == host, f"tenants' host bytes do not add up to {host}")
    require(len(buffers.persistent) == sum(b.persistent for b in buffers.by_id.values()), "stale persistent names")
    reserved = sum(b.reserved for b in buffers.by_id.values())
    require(buffers.reserved_bytes == reserved, f"reserved {buffers.reserved_bytes} != {reserved} in buffers")
    segments = sum(b.num_segments for b in buffers.by_id.values())
    require(buffers.num_segments == segments, f"{buffers.num_segments} segments counted, {segments} in buffers")
    chunks = sum(len(b.chunks) for b in buffers.by_id.values())
    require(buffers.num_chunks == chunks, f"{buffers.num_chunks} chunks counted, {chunks} in buffers")
    for uid, held in buffers.of_uid.items():
        require(bool(held) and all(b.owner_uid == uid and buffers.by_id.get(i) is b for i, b in held.items()),
                f"the buffers of uid {uid} do not match the buffers")
    require(sum(map(len, buffers.of_uid.values())) == len(buffers.by_id), "a buffer missing from its uid's")
    _check_session_counts(sessions)
    for session in sessions.by_id.values():
        for buffer in session.buffers.values():
            require(buffers.by_id.get(buffer.buffer_id) is buffer,
                    f"session {session.session_id} holds a dropped buffer")
        for buffer in session.reading.values():
            require(buffers.by_id.get(buffer.buffer_id) is buffer,
                    f"session {session.session_id} reads a dropped buffer")
            require(session.session_id in buffer.readers,
                    f"session {session.session_id} reads {buffer.buffer_id} unrecorded")
    require(tenants.committed_bytes == total, f"committed {tenants.committed_bytes} != {total} in chunks")
    leased = _check_leases(sessions, buffers.backend.granularity, chunk_ids)
    require(tenants.leased_bytes == leased, f"leased {tenants.leased_bytes} != {leased} in sessions' leases")
    _check_tenants(sessions, buffers, tenants)


def _check_session_counts(table: Sessions) -> None:
    for uid, held in table.of_uid.items():
        require(bool(held) and all(s.uid == uid and table.by_id.get(i) is s for i, s in held.items()),
                f"the sessions of uid {uid} do not match the sessions")
    require(sum(map(len, table.of_uid.values())) == len(table.by_id), "a session missing from its uid's")
    workers: dict[str, int] = {}
    for session in table.workers:
        workers[session.tenant.name] = workers.get(session.tenant.name, 0) + 1
    require(table.workers_of == workers, f"workers per tenant counted {table.workers_of}, {workers} connected")


def _check_buffer(sessions: Sessions, buffers: Buffers[Any, Any], buffer: Buffer[Any, Any], chunk_ids: set[int]) -> int:
    """Check one buffer's chunks and links; returns its device bytes (mapped and pending)."""
    granule = buffers.backend.granularity
    wanted = buffer.backed_runs(buffer.segment_sizes, granule)
    for label, chunks, accounted in (
        ("chunks", buffer.chunks, buffer.physical_bytes),
        ("pending chunks", buffer.pending, buffer.pending_bytes),
    ):
        where = f"buffer {buffer.buffer_id} {label}"
        require(sum(c.size for c in chunks) == accounted, f"{where}: sizes do not add up to {accounted}")
        require(len({c.tier for c in chunks}) <= 1, f"{where} lie in more than one tier")
        check_chunk_layout(where, chunks, buffer.reserved, granule, chunk_ids)
        if chunks or label == "chunks":
            covered = merge_runs((c.offset, c.offset + c.size) for c in chunks)
            require(covered == wanted, f"{where} cover {covered}, not the committed prefixes {wanted}")
    if buffer.owner is not None:
        require(buffer.owner.buffers.get(buffer.buffer_id) is buffer, f"buffer {buffer.buffer_id}: owner lost it")
        require(sessions.by_id.get(buffer.owner.session_id) is buffer.owner, f"buffer {buffer.buffer_id}: owner ended")
        require(not buffer.expires_at, f"buffer {buffer.buffer_id} is held, yet due to be freed as an orphan")
    else:
        require(buffer.persistent, f"anonymous buffer {buffer.buffer_id} has no owner")
        due = buffers.deadlines.get(buffer.buffer_id, 0.0)
        require(due == buffer.expires_at,
                f"orphan {buffer.buffer_id} is due at {buffer.expires_at}, looked for at {due}")
    if buffer.persistent:
        named = buffers.persistent.get((buffer.owner_uid, buffer.name))
        require(named is buffer, f"persistent buffer {buffer.buffer_id} is not found by its name")
    require(buffer.persistent or not buffer.sealed, f"anonymous buffer {buffer.buffer_id} is sealed")
    require((buffer.unsealed_since > 0) == (buffer.persistent and not buffer.sealed),
            f"buffer {buffer.buffer_id} says it holds its name unsealed since {buffer.unsealed_since}")
    require(buffer.sealed or not buffer.readers, f"unsealed buffer {buffer.buffer_id} has readers")
    require(not (buffer.sealed and buffer.pending), f"sealed buffer {buffer.buffer_id} is mid-defragment")
    held = [c.handle is None for c in buffer.chunks]
    require(held == sorted(held, reverse=True) and all(c.handle is not None for c in buffer.pending),
            f"buffer {buffer.buffer_id}: its chunks held only by their mappers are not a prefix of its chunks")
    require(buffer.owner is not None or bool(buffer.readers) or not buffer.held_elsewhere,
            f"orphan {buffer.buffer_id} is held only by processes that no longer map it")
    for session_id, claims in buffer.readers.items():
        reader = sessions.by_id.get(session_id)
        require(claims > 0, f"buffer {buffer.buffer_id}: session {session_id} holds {claims} read claims")
        if reader is None:
            raise AssertionError(f"buffer {buffer.buffer_id}: reader session {session_id} ended")
        require(reader.reading.get(buffer.buffer_id) is buffer,
                f"buffer {buffer.buffer_id}: reader {session_id} lost it")
    host = sum(c.size for c in (*buffer.chunks, *buffer.pending) if c.tier == TIER_HOST)
    require(buffer.host_bytes == host, f"buffer {buffer.buffer_id}: host bytes {buffer.host_bytes} != {host} in chunks")
    return buffer.physical_bytes + buffer.pending_bytes - host


def check_chunk_layout(where: str, chunks: list[Chunk[Any]], reserved: int, granule: int, chunk_ids: set[int]) -> None:
    """Chunks of whole granules, inside ``reserved``, backing no granule twice, their ids not in ``chunk_ids`` (which
    takes them); a journaled buffer is held to it before it is restored."""
    end = 0
    for chunk in sorted(chunks, key=lambda c: c.offset):
        require(chunk.chunk_id not in chunk_ids, f"{where}: chunk id {chunk.chunk_id} used twice")
        chunk_ids.add(chunk.chunk_id)
        require(chunk.size > 0 and chunk.offset % granule == 0 and chunk.size % granule == 0,
                f"{where}: chunk {chunk.chunk_id} is not whole granules")
        require(chunk.offset >= end, f"{where}: chunk {chunk.chunk_id} backs a granule twice")
        require(chunk.offset + chunk.size <= reserved, f"{where}: chunk {chunk.chunk_id} lies outside")
        end = chunk.offset + chunk.size


def _check_leases(sessions: Sessions, granule: int, chunk_ids: set[int]) -> int:
    """Check every session's lease; returns the bytes leased in all."""
    leased = 0
    for session in sessions.by_id.values():
        where = f"session {session.session_id} lease"
        for chunk_id, chunk in session.lease.items():
            require(chunk_id == chunk.chunk_id and chunk_id not in chunk_ids, f"{where}: chunk {chunk_id} used twice")
            chunk_ids.add(chunk_id)
            require(chunk.live and chunk.size == granule, f"{where}: chunk {chunk_id} is not a live granule")
        require(session.credit >= 0 and session.credit % granule == 0, f"{where}: a credit of {session.credit} bytes")
        require(session.leased_bytes == granule * len(session.lease) + session.credit,
                f"{where}: {session.leased_bytes} bytes")
        require(session.revoking <= set(session.lease), f"{where}: asked back for chunks it does not hold")
        require(session.wants_lease or not session.lease, f"{where}: leased without asking")
        require(session.wants_credit or not session.credit, f"{where}: credit without asking")
        leased += session.leased_bytes
    return leased


def _check_tenants(sessions: Sessions, buffers: Buffers[Any, Any], table: Tenants) -> None:
    tenants = table.by_name
    used = sum(t.used_bytes for t in tenants.values())
    require(table.committed_bytes + table.leased_bytes == used,
            f"committed {table.committed_bytes} + leased {table.leased_bytes} != {used} used by tenants")
    holders: dict[str, int] = {}
    leased: dict[str, int] = {}
    holding: list[Session | Buffer[Any, Any]] = [*sessions.by_id.values(), *buffers.by_id.values()]
    for holder in holding:
        require(tenants.get(holder.tenant.name) is holder.tenant, f"tenant {holder.tenant.name!r} was forgotten")
        holders[holder.tenant.name] = holders.get(holder.tenant.name, 0) + 1
    for session in sessions.by_id.values():
        leased[session.tenant.name] = leased.get(session.tenant.name, 0) + session.leased_bytes
    # A configured tenant nobody uses is owed its whole guarantee.
    unmet = sum(max(0, limits.guaranteed_bytes - (tenants[limits.name].used_bytes if limits.name in tenants else 0))
                for limits in table.config.tenants)
    require(table.unmet_guarantees == unmet,
            f"unmet guarantees counted {table.unmet_guarantees}, {unmet} in the config's tenants")
    for tenant in tenants.values():
        limits = table.limits(tenant.name)
        require(tenant.holders == holders.get(tenant.name, 0), f"tenant {tenant.name!r}: {tenant.holders} holders")
        require(tenant.holders > 0, f"tenant {tenant.name!r} is kept for nobody")
        require(tenant.leased_bytes == leased.get(tenant.name, 0),
                f"tenant {tenant.name!r}: {tenant.leased_bytes} leased")
        require(
            (tenant.max_bytes, tenant.guaranteed_bytes)
            == ((limits.max_bytes, limits.guaranteed_bytes) if limits else (None, 0)),
            f"tenant {tenant.name!r} has limits {tenant.max_bytes}/{tenant.guaranteed_bytes}, not the config's",
        )
