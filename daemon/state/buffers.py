"""Buffers: their layout, their chunks and persistent names (orphans in ``orphans.py``, seals and readers in
``sealed.py``).

A commit or defragment asks :class:`~.tenants.Tenants` to admit its bytes
first and makes all its chunks or none. When the budget refuses, or the
device is short of memory a guaranteed tenant was promised, the buffers
tell the :class:`~.pressure.Pressure`, which asks other sessions for
memory back.
"""

from __future__ import annotations

import itertools
from typing import Any, Generic

from hbmd.proto import MAX_SEGMENTS, TIER_DEVICE, TIER_HOST, TIERS
from hbmd.proto.buffers import MAX_NAME
from hbmd.proto.errors import (
    Conflict,
    InvalidRequest,
    NotFound,
    OutOfBudget,
    OutOfDeviceMemory,
)
from hbmd.proto.runs import merge_runs, new_runs
from hbmd.proto.units import exact_bytes, format_bytes, round_up

from ..backends import A, Backend, C
from ..clock import Clock
from ..shares import fair_share, fits
from .chunks import Chunks
from .holders import add_read_claim, check_keep, give_to, left_by, let_go_of_writer
from .pressure import Pressure
from .records import (
    MAX_CAPACITY,
    Buffer,
    Chunk,
    Limits,
    Session,
    Tenant,
    check_int,
    check_observer,
)
from .tenants import Tenants
from .unsealed import UnsealedNames
from .writers import Writer


def layout_segments(capacity: int, num_segments: int, capacities: list[int] | None) -> list[int]:
    """The segments of a new buffer: ``num_segments`` equal ones, or the uneven ``capacities`` summing to
    ``capacity``."""
    check_int("capacity", capacity, 1, MAX_CAPACITY)
    if capacities:
        check_int("len(segment_capacities)", len(capacities), 1, MAX_SEGMENTS)
        if min(capacities) <= 0 or sum(capacities) != capacity:
            raise InvalidRequest(
                f"segment_capacities must be positive and sum to the capacity {capacity}", field="segment_capacities"
            )
        return list(capacities)
    check_int("num_segments", num_segments, 1, min(MAX_SEGMENTS, capacity))
    if capacity % num_segments:
        raise InvalidRequest(
            f"capacity {capacity} is not divisible by num_segments {num_segments}", field="num_segments"
        )
    return [capacity // num_segments] * num_segments


class Buffers(Generic[A, C]):
    """Every buffer of the instance, by id and (persistent ones) by owner uid and name."""

    def __init__(self, backend: Backend[A, C], chunks: Chunks[A, C], tenants: Tenants, limits: Limits,
                 pressure: Pressure[A, C], clock: Clock) -> None:
        """``clock``: the state's, whose Unix time orphans are stamped with."""
        self.backend = backend
        self.chunks = chunks
        self.tenants = tenants
        self.limits = limits
        self.pressure = pressure
        self.by_id: dict[int, Buffer[A, C]] = {}
        self.persistent: dict[tuple[int, str], Buffer[A, C]] = {}
        self.of_uid: dict[int, dict[int, Buffer[A, C]]] = {}
        """Every buffer by its owner's uid, then id: a uid's limits, and what its sessions may see, cost no pass over
        every user's buffers."""
        self._next_id = 1
        self.pending_bytes = 0
        """Every buffer's pending chunks: above 0 while a preserving defragment or a move is in flight."""
        self.reserved_bytes = 0
        """Every buffer's reservation, kept as buffers come and go: a status must not cost a pass over them all."""
        self.num_chunks = 0
        """Every buffer's mapped chunks, kept as they change, for the same reason."""
        self.num_segments = 0
        """Every buffer's segments, kept as buffers come and go: the bound in all (:attr:`Limits.segments`)."""
        self.clock = clock
        self.deadlines: dict[int, float] = {}
        """When each orphan with a grace period is due to be freed (Unix time), by buffer id; an entry whose buffer was
        attached, grafted or deleted since is dropped when next looked at (``Orphans.expire``)."""
        self.unsealed_names = UnsealedNames(limits.persistent_buffers_per_uid)
        self.changed: set[int] | None = None
        """Buffers changed (chunks, owner, readers, seal; or dropped) since the persistence layer last journaled them
        (None: nobody is tracking, and nothing is recorded)."""

    # accounting

    def account(self, buffer: Buffer[A, C], mapped: int = 0, pending: int = 0, tier: str = TIER_DEVICE) -> None:
        """A buffer's mapped and pending chunks in ``tier`` changed by these bytes: its record, its tenant's, the
        totals (the device budget's, or the host tier's)."""
        buffer.physical_bytes += mapped
        buffer.pending_bytes += pending
        self.pending_bytes += pending
        if tier == TIER_HOST:
            buffer.host_bytes += mapped + pending
            self.tenants.charge(buffer.tenant, host=mapped + pending)
        else:
            self.tenants.charge(buffer.tenant, committed=mapped + pending)
        self.mark_changed(buffer)

    def recharge(self, buffer: Buffer[A, C], tenant: Tenant, purpose: str) -> None:
        """Charge the buffer's bytes, and what it grows from now on, to ``tenant`` instead of its own: within
        ``tenant``'s maximum and the others' guarantees (``OutOfBudget`` with nothing changed), the budget's total as
        it was."""
        old = buffer.tenant
        if old is tenant:
            return
        device = buffer.physical_bytes + buffer.pending_bytes - buffer.host_bytes
        self.tenants.admit_transfer(old, tenant, device, purpose)
        self.tenants.charge(old, committed=-device, host=-buffer.host_bytes)
        self.tenants.charge(tenant, committed=device, host=buffer.host_bytes)
        self.tenants.hold(tenant)
        buffer.tenant = tenant
        self.tenants.let_go(old)
        self.mark_changed(buffer)

    def mark_changed(self, buffer: Buffer[A, C]) -> None:
        if self.changed is not None:
            self.changed.add(buffer.buffer_id)

    # lookup

    def of(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        """The session's own buffer ``buffer_id``; another session's is answered as one that does not exist.

        So a stranger trying ids learns nothing of what others hold.
        """
        buffer = self.by_id.get(buffer_id)
        if buffer is None or buffer.owner is not session:
            raise NotFound(f"no buffer {buffer_id} in this session", buffer_id=buffer_id)
        return buffer

    def changeable(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        """The session's buffer, to change: refused while sealed or mid-defragment."""
        buffer = self.of(session, buffer_id)
        if buffer.sealed:
            raise InvalidRequest(
                f"buffer {buffer_id} ({buffer.name!r}) is sealed: it is immutable, no commit, release or defragment",
                buffer_id=buffer_id,
            )
        if buffer.pending:
            raise Conflict(f"buffer {buffer_id} is being defragmented or moved", buffer_id=buffer_id)
        return buffer

    def growable(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        """The session's buffer, to grow or defragment: refused, besides as :meth:`changeable` refuses, while
        demoted."""
        buffer = self.changeable(session, buffer_id)
        if buffer.demoted:
            raise Conflict(
                f"buffer {buffer_id} is demoted to the host tier: promote it before growing or defragmenting it",
                buffer_id=buffer_id,
            )
        return buffer

    def named(self, uid: int, name: str) -> Buffer[A, C]:
        if len(name) > MAX_NAME:
            raise InvalidRequest(f"buffer names have at most {MAX_NAME} characters", field="name")
        buffer = self.persistent.get((uid, name))
        if buffer is None:
            raise NotFound(f"no persistent buffer named {name!r} for uid {uid}", name=name)
        return buffer

    def orphan(self, uid: int, name: str) -> Buffer[A, C]:
        """The persistent buffer ``name`` of ``uid``, refused while a live session holds it."""
        buffer = self.named(uid, name)
        if buffer.owner is not None:
            raise Conflict(
                f"persistent buffer {name!r} is attached by session {buffer.owner.session_id} "
                f"(pid {buffer.owner.pid}); it is free once that session ends",
                session_id=buffer.owner.session_id,
            )
        return buffer

    # making and dropping

    def create(self, session: Session, capacity: int, num_segments: int, name: str = "", persistent: bool = False,
               shareable: bool = False, segment_capacities: list[int] | None = None, keep_orphan_s: float = 0.0,
               ) -> Buffer[A, C]:
        """A new buffer of the session: ``num_segments`` equal segments, or the uneven ``segment_capacities`` (summing
        to ``capacity``); a persistent one is freed ``keep_orphan_s`` after it becomes an orphan (0: never). Raises
        with nothing made."""
        check_observer(session)
        capacities = layout_segments(capacity, num_segments, segment_capacities)
        _check_name(name)
        check_keep(keep_orphan_s, persistent)
        self._check_room_of(session.uid, len(capacities))
        if persistent:
            self._check_new_name(session.uid, name)
        reserved = round_up(capacity, self.backend.granularity)
        buffer: Buffer[A, C] = Buffer(
            buffer_id=self._next_id, name=name, persistent=persistent, shareable=shareable, owner=session,
            owner_uid=session.uid, tenant=session.tenant, capacity=capacity, reserved=reserved,
            segment_capacities=capacities, arena=self.backend.open_arena(reserved, shareable),
            keep_orphan_s=keep_orphan_s,
            unsealed_since=self.unsealed_names.since(session.uid, name, self.clock.unix()) if persistent else 0.0,
        )
        self._next_id += 1
        self._add(buffer)
        session.buffers[buffer.buffer_id] = buffer
        self.mark_changed(buffer)
        return buffer

    def redeclare(self, session: Session, previous_id: int, capacities: list[int], sizes: list[int],
                  chunks: list[tuple[int, int]], name: str, persistent: bool, shareable: bool, sealed: bool,
                  readonly: bool, tier: str = TIER_DEVICE) -> Buffer[A, C]:
        """A buffer its client still maps, declared again after the daemon restarted cold.

        The chunks (``(offset, size)``) are recorded as held elsewhere, and
        their bytes admitted and charged as a commit of them would be. A
        reader's claim joins the sealed buffer already declared under its
        name, or declares it, an orphan its owner joins. What a client may
        claim is what it could have made: only in its own user's names,
        within its tenant's budget and the per-uid limits; nothing declared is
        ever handed to another process. A demoted buffer's chunks are declared
        in the host tier (``tier``) and admitted by the host budget. The
        buffer keeps ``previous_id``, the id it had, where no buffer has it
        now. Raises with nothing changed but the ids given from now on, which
        come after ``previous_id``.
        """
        check_observer(session)
        check_int("buffer_id", previous_id, 0, MAX_CAPACITY)
        _check_tier(tier)
        keep = previous_id if previous_id and previous_id not in self.by_id else 0
        self._next_id = max(self._next_id, previous_id + 1)
        capacity = sum(capacities)
        capacities = layout_segments(capacity, len(capacities), capacities)
        _check_name(name)
        if (readonly or sealed) and not (persistent and sealed):
            raise InvalidRequest("only a sealed persistent buffer is read or sealed", field="sealed")
        reserved = round_up(capacity, self.backend.granularity)
        record: Buffer[Any, C] = Buffer(  # no arena until the declaration passes its checks
            buffer_id=keep or self._next_id, name=name, persistent=persistent, shareable=shareable,
            owner=None if readonly else session, owner_uid=session.uid, tenant=session.tenant, capacity=capacity,
            reserved=reserved, segment_capacities=capacities, arena=None, sealed=sealed,
            unsealed_since=self.clock.unix() if persistent and not sealed else 0.0,
        )
        self.check_sizes(record, sizes)
        record.segment_sizes = list(sizes)
        self._check_tiling(record, chunks)
        existing = self.persistent.get((session.uid, name)) if persistent else None
        if existing is not None:
            return self._join(session, existing, record, chunks, readonly, tier)
        self._check_room_of(session.uid, len(capacities))
        if persistent:
            self._check_new_name(session.uid, name)
        held = sum(size for _, size in chunks)
        if tier == TIER_HOST:
            self.tenants.admit_host(held, "declaring again host memory it maps")
        else:
            self.tenants.admit(session.tenant, held, "declaring again memory it maps", in_use=True)
            if self.tenants.committed_bytes + self.tenants.leased_bytes + held > self.tenants.budget_bytes:
                self.pressure.refused(None)  # leases made before it was declared give way to it
        record.arena = self.backend.open_arena(reserved, shareable)
        record.chunks = [Chunk(self.chunks.take_id(), offset, size, None, tier=tier) for offset, size in chunks]
        self._next_id = max(self._next_id, record.buffer_id + 1)
        self._add(record)
        self.account(record, mapped=held, tier=tier)
        if readonly:
            add_read_claim(session, record)
        else:
            session.buffers[record.buffer_id] = record
        return record

    def _check_tiling(self, buffer: Buffer[A, C], chunks: list[tuple[int, int]]) -> None:
        """Refuse declared chunks that are not granules tiling exactly what the segments' sizes must back."""
        granule = self.backend.granularity
        if len(chunks) > buffer.reserved // granule:  # refused before sorting what could be a frame of them
            raise InvalidRequest(f"more chunks than the buffer has granules ({len(chunks)})", field="chunks")
        ordered = sorted(chunks)
        ragged = any(offset % granule or size <= 0 or size % granule for offset, size in ordered)
        overlapping = any(offset + size > after for (offset, size), (after, _) in itertools.pairwise(ordered))
        covered = merge_runs((offset, offset + size) for offset, size in ordered)
        if ragged or overlapping or covered != buffer.backed_runs(buffer.segment_sizes, granule):
            raise InvalidRequest(
                "the declared chunks must be whole granules, apart, backing exactly the segments' committed bytes",
                field="chunks",
            )

    def _join(self, session: Session, buffer: Buffer[A, C], declared: Buffer[A, C], chunks: list[tuple[int, int]],
              readonly: bool, tier: str) -> Buffer[A, C]:
        """A declared claim on the persistent buffer of the same name, declared already or kept by the daemon: a
        reader's read claim, or its owner taking back the orphan (one its readers declared, or one the daemon brought
        back when the owner's session could not be). Both must describe the same memory."""
        same = (
            buffer.sealed == declared.sealed and not buffer.pending
            and buffer.segment_capacities == declared.segment_capacities
            and buffer.segment_sizes == declared.segment_sizes
            and sorted((c.offset, c.size) for c in buffer.chunks) == sorted(chunks)
            and (buffer.tier == tier or not chunks)
        )
        if not same or not (readonly or buffer.owner is None):
            raise Conflict(
                f"a persistent buffer named {buffer.name!r} is declared already, with other memory or another owner",
                buffer_id=buffer.buffer_id,
            )
        if readonly:
            add_read_claim(session, buffer)
        else:
            give_to(session, buffer)
        self.mark_changed(buffer)
        return buffer

    def _check_room_of(self, uid: int, new_segments: int) -> None:
        """Refuse a buffer past the uid's :attr:`Limits.buffers_per_uid` or :attr:`Limits.segments_per_uid`, or past
        its fair share of :attr:`Limits.buffers` or :attr:`Limits.segments` (:mod:`hbmd.daemon.shares`)."""
        limits = self.limits
        held = self.of_uid.get(uid, {})
        segments = sum(b.num_segments for b in held.values())
        if len(held) >= limits.buffers_per_uid or segments + new_segments > limits.segments_per_uid:
            raise OutOfBudget(
                f"uid {uid} already holds {len(held)} buffers of {segments} segments; at most "
                f"{limits.buffers_per_uid} buffers (--max-buffers-per-uid) of {limits.segments_per_uid} "
                "segments in all: free one it no longer needs",
                uid=uid, limit=limits.buffers_per_uid,
            )
        others = len(self.of_uid) - (uid in self.of_uid)
        buffers = max(limits.buffers, limits.buffers_per_uid)
        all_segments = max(limits.segments, limits.segments_per_uid)
        if not (fits(len(held), 1, len(self.by_id), others, limits.buffers_per_uid, buffers, limits.buffers_floor)
                and fits(segments, new_segments, self.num_segments, others, limits.segments_per_uid, all_segments,
                         limits.segments_floor)):
            share = fair_share(limits.buffers_per_uid, buffers, limits.buffers_floor, others)
            segments_share = fair_share(limits.segments_per_uid, all_segments, limits.segments_floor, others)
            raise OutOfBudget(
                f"uid {uid} already holds {len(held)} buffers of {segments} segments, its share now of what all uids "
                f"may hold ({buffers} buffers, {all_segments} segments; {len(self.by_id)} and {self.num_segments} "
                f"held; {share} and {segments_share} each while {others + 1} uids hold some): free one it no longer "
                "needs, or retry once others do",
                uid=uid, limit=share,
            )

    def _check_new_name(self, uid: int, name: str) -> None:
        if not name:
            raise InvalidRequest("a persistent buffer needs a name", field="name")
        existing = self.persistent.get((uid, name))
        if existing is not None:
            raise Conflict(
                f"a persistent buffer named {name!r} already exists; attach to it or delete it",
                buffer_id=existing.buffer_id,
            )
        held = sum(b.persistent for b in self.of_uid.get(uid, {}).values())
        if held >= self.limits.persistent_buffers_per_uid:
            raise OutOfBudget(
                f"uid {uid} already has {held} persistent buffers, the most allowed "
                "(--max-persistent-per-uid); delete one it no longer needs",
                uid=uid, limit=self.limits.persistent_buffers_per_uid,
            )

    def _add(self, buffer: Buffer[A, C]) -> None:
        self.tenants.hold(buffer.tenant)
        self.by_id[buffer.buffer_id] = buffer
        self.of_uid.setdefault(buffer.owner_uid, {})[buffer.buffer_id] = buffer
        self.reserved_bytes += buffer.reserved
        self.num_segments += buffer.num_segments
        self.num_chunks += len(buffer.chunks)
        if buffer.persistent:
            self.persistent[(buffer.owner_uid, buffer.name)] = buffer

    def adopt(self, buffer: Buffer[A, C]) -> None:
        """Bring back a buffer after a restart, its chunks not counted yet; they count whatever the budget."""
        self._add(buffer)
        self.account(buffer, mapped=sum(c.size for c in buffer.chunks), tier=buffer.tier)
        self.account(buffer, pending=sum(c.size for c in buffer.pending), tier=buffer.pending_tier)
        self._next_id = max(self._next_id, buffer.buffer_id + 1)
        self.chunks.adopted(buffer.chunks + buffer.pending)

    def drop_mapped(self, buffer: Buffer[A, C]) -> int:
        """Release the buffer's (mapped) chunks; returns their bytes."""
        tier = buffer.tier
        freed = self.chunks.release_all(buffer.chunks, buffer.arena)
        self.num_chunks -= len(buffer.chunks)
        buffer.chunks = []
        self.account(buffer, mapped=-freed, tier=tier)
        return freed

    def drop_pending(self, buffer: Buffer[A, C]) -> int:
        """Release the chunks of an unfinished preserving defragment or move; returns their bytes."""
        tier = buffer.pending_tier
        freed = self.chunks.release_all(buffer.pending, buffer.arena)
        buffer.pending = []
        self.account(buffer, pending=-freed, tier=tier)
        return freed

    def release(self, session: Session, buffer_id: int) -> int:
        """Drop every chunk of the session's buffer, keep the reservation. Returns the bytes freed."""
        return self.release_all(self.changeable(session, buffer_id))

    def release_all(self, buffer: Buffer[A, C]) -> int:
        """Drop every chunk, keep the reservation. Returns the bytes freed."""
        freed = self.drop_mapped(buffer) + self.drop_pending(buffer)
        buffer.segment_sizes = [0] * buffer.num_segments
        return freed

    def drop(self, buffer: Buffer[A, C]) -> int:
        """Forget the buffer and free its memory; returns the bytes freed."""
        freed = self.release_all(buffer)
        self.backend.close_arena(buffer.arena)
        del self.by_id[buffer.buffer_id]
        held = self.of_uid[buffer.owner_uid]
        del held[buffer.buffer_id]
        if not held:
            del self.of_uid[buffer.owner_uid]
        self.reserved_bytes -= buffer.reserved
        self.num_segments -= buffer.num_segments
        if buffer.owner is not None:
            buffer.owner.buffers.pop(buffer.buffer_id, None)
        if buffer.persistent:
            self.persistent.pop((buffer.owner_uid, buffer.name), None)
            if not buffer.sealed:
                self.unsealed_names.dropped_unsealed(buffer, self.clock.unix())
        let_go_of_writer(buffer)
        self.tenants.let_go(buffer.tenant)
        self.mark_changed(buffer)
        return freed

    def disown(self, buffer: Buffer[A, C]) -> int:
        """Make a persistent buffer an orphan, attachable again by name.

        Mid-defragment the old chunks stay (they hold the data) and the
        unconfirmed new ones are dropped; returns their bytes.
        """
        freed = self.drop_pending(buffer)
        if buffer.owner is not None:
            buffer.owner.buffers.pop(buffer.buffer_id, None)
            left_by(buffer, buffer.owner, self.clock.unix())
            if buffer.expires_at:
                self.deadlines[buffer.buffer_id] = buffer.expires_at
        buffer.owner = None
        self.mark_changed(buffer)
        return freed + self.forget_unheld(buffer)

    def forget_unheld(self, buffer: Buffer[A, C]) -> int:
        """Drop an orphan whose memory was held only by processes that no longer map it (see :meth:`redeclare`): it
        is gone. Returns the bytes it had."""
        if (buffer.owner is not None or buffer.readers or not buffer.held_elsewhere
                or buffer.buffer_id not in self.by_id):
            return 0
        return self.drop(buffer)

    def remappable(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        """The session's buffer, to send all its chunks again: refused where some are held only by its mappers."""
        buffer = self.of(session, buffer_id)
        self.check_handed_out(buffer)
        return buffer

    def export(self, buffer: Buffer[A, C], chunk: Chunk[C]) -> int:
        """A new FD for a buffer's chunk."""
        assert chunk.handle is not None, "a chunk held only by its mappers is never handed out"
        return self.backend.export(buffer.arena, chunk.handle)

    @property
    def orphans(self) -> list[Buffer[A, C]]:
        """Persistent buffers no session holds: their memory stays committed until attached again or deleted."""
        return [b for b in self.by_id.values() if b.owner is None]

    def check_handed_out(self, buffer: Buffer[A, C]) -> None:
        """Refuse to hand a buffer's chunks to a process where some exist only in the mappings of others."""
        if buffer.held_elsewhere:
            raise Conflict(
                f"buffer {buffer.buffer_id} ({buffer.name!r}) was declared again by the processes that map it after "
                "hbmd restarted with nothing to keep its memory: the daemon cannot hand it to another process; "
                "its holders may copy it into a new buffer",
                buffer_id=buffer.buffer_id,
            )

    def end_session(self, session: Session, writer: Writer | None = None) -> int:
        """The session ended: its read claims go, its anonymous buffers are freed, its persistent ones orphaned, each
        watched for its process (a copy of ``writer``, the caller's) where that lives on and may still write them
        (:mod:`.writers`)."""
        read = list(session.reading.values())
        for buffer in read:
            buffer.readers.pop(session.session_id, None)
            self.mark_changed(buffer)
        session.reading.clear()
        freed = 0
        for buffer in list(session.buffers.values()):
            if not buffer.persistent:
                freed += self.drop(buffer)
                continue
            freed += self.disown(buffer)
            if writer is not None and buffer.buffer_id in self.by_id and not buffer.sealed:
                buffer.writer = writer.copy()
        return freed + sum(self.forget_unheld(buffer) for buffer in read)

    # growth

    def check_sizes(self, buffer: Buffer[A, C], sizes: list[int]) -> None:
        """Refuse segment sizes that are not one per segment, within capacity and grow-only."""
        if len(sizes) != buffer.num_segments:
            raise InvalidRequest(f"expected {buffer.num_segments} segment sizes, got {len(sizes)}", field="sizes")
        for index, (size, old, capacity) in enumerate(zip(sizes, buffer.segment_sizes, buffer.segment_capacities)):
            if size < 0:
                raise InvalidRequest(f"segment {index}: size {size} is negative", field="bytes_per_segment")
            if size > capacity:
                raise InvalidRequest(
                    f"segment {index}: {exact_bytes(size)} exceeds the segment capacity of {exact_bytes(capacity)}",
                    field="bytes_per_segment",
                )
            if size < old:
                raise InvalidRequest(
                    f"buffers are grow-only: segment {index} has {exact_bytes(old)} committed, asked for "
                    f"{exact_bytes(size)}",
                    field="bytes_per_segment",
                )

    def growth(self, buffer: Buffer[A, C], sizes: list[int]) -> list[tuple[int, int]]:
        """The granule runs that growing ``buffer``'s segments to ``sizes`` must back (checked first)."""
        self.check_sizes(buffer, sizes)
        granule = self.backend.granularity
        return new_runs(buffer.segment_offsets, buffer.segment_sizes, sizes, granule)

    def grow(self, buffer: Buffer[A, C], sizes: list[int], chunks: list[Chunk[C]]) -> None:
        """The segments now hold ``sizes`` bytes, ``chunks`` backing what they gained."""
        buffer.chunks.extend(chunks)
        self.num_chunks += len(chunks)
        buffer.segment_sizes = list(sizes)
        self.account(buffer, mapped=sum(c.size for c in chunks))

    def commit(self, session: Session, buffer_id: int, sizes: int | list[int]) -> list[Chunk[C]]:
        """Grow each segment's committed prefix to ``sizes[i]`` (an int: the same for all); returns the new chunks.

        One chunk per maximal run of uncommitted granules, in offset order.
        The whole growth fits the budget or nothing is allocated.
        """
        buffer = self.growable(session, buffer_id)
        if isinstance(sizes, int):
            sizes = [sizes] * buffer.num_segments
        created = self.make_runs(buffer, self.growth(buffer, sizes), "commit")
        self.grow(buffer, sizes, created)
        return created

    def make_runs(self, buffer: Buffer[A, C], runs: list[tuple[int, int]], purpose: str) -> list[Chunk[C]]:
        """One new chunk per run, admitted as a whole; none on any failure. The caller accounts for them."""
        requested = sum(end - start for start, end in runs)
        try:
            self.tenants.admit(buffer.tenant, requested, purpose, self.pressure.withheld_bytes())
        except OutOfBudget as exc:
            self.pressure.refused(buffer.owner)
            demoting = self.pressure.demote_for(buffer.tenant, requested)
            if not demoting:
                raise
            raise OutOfBudget(
                f"{exc.message}; {format_bytes(demoting)} of idle tenants' buffers are being demoted to the host "
                "tier: retry",
                **exc.details, demoting=demoting,
            ) from None
        try:
            return self.chunks.make_runs(buffer.arena, runs)
        except OutOfDeviceMemory:
            if self.tenants.short_of_guarantee(buffer.tenant, requested):
                self.pressure.short(buffer.tenant, requested)
            raise

    def defragment(self, session: Session, buffer_id: int, preserve: bool) -> list[Chunk[C]]:
        """Re-back each run of the committed prefixes with one chunk; returns the new chunks.

        ``preserve``: the new chunks are created beside the old ones (the
        budget must hold both) and stay pending until :meth:`finish_defragment`,
        so a client that dies mid-way loses nothing. Otherwise the old chunks
        are released first: the caller has unmapped them and drops the data;
        if the new ones cannot be made, the buffer is left released.
        Where every run already is one chunk nothing changes: a preserving
        defragment returns ``[]``, a discarding one the chunks as they are
        (the caller unmapped them and maps them again).
        """
        buffer = self.growable(session, buffer_id)
        runs = buffer.backed_runs(buffer.segment_sizes, self.backend.granularity)
        if len(buffer.chunks) == len(runs) and (preserve or not buffer.held_elsewhere):
            return [] if preserve else buffer.chunks
        if preserve:
            buffer.pending = self.make_runs(
                buffer, runs, "defragment (old and new chunks coexist until the copy is done)"
            )
            self.account(buffer, pending=sum(c.size for c in buffer.pending))
            return buffer.pending
        sizes = buffer.segment_sizes
        self.release_all(buffer)
        self.grow(buffer, sizes, self.make_runs(buffer, runs, "defragment"))
        return buffer.chunks

    def finish_defragment(self, session: Session, buffer_id: int, keep_new: bool) -> int:
        """Swap in the pending chunks of a defragment or a move (``keep_new``) or drop them; returns the bytes freed."""
        buffer = self.of(session, buffer_id)
        if not buffer.pending:
            raise InvalidRequest(f"buffer {buffer_id} has no defragment or move in progress", buffer_id=buffer_id)
        if not keep_new:
            return self.drop_pending(buffer)
        freed = self.drop_mapped(buffer)
        tier = buffer.pending_tier
        buffer.chunks, buffer.pending = buffer.pending, []
        self.num_chunks += len(buffer.chunks)
        self.account(buffer, mapped=buffer.pending_bytes, pending=-buffer.pending_bytes, tier=tier)
        return freed

    def move(self, session: Session, buffer_id: int, tier: str) -> list[Chunk[C]]:
        """Make chunks in ``tier`` for the buffer's committed bytes, pending beside the old ones; returns them.

        As a preserving defragment: both are charged until
        :meth:`finish_defragment` (the old tier's budget and the new one's),
        so a client that dies mid-way loses nothing. To the host tier the
        host budget admits them; back to the device, the device budget (and
        pressure on others where it refuses). A buffer already in ``tier``,
        or with nothing committed, returns ``[]``. A sealed buffer is mapped
        by its readers as well, whose mappings would keep the old chunks: it
        does not move.
        """
        _check_tier(tier)
        buffer = self.of(session, buffer_id)
        if buffer.sealed:
            raise InvalidRequest(
                f"buffer {buffer_id} ({buffer.name!r}) is sealed: its readers map its chunks too, so it stays where "
                "it is",
                buffer_id=buffer_id,
            )
        buffer = self.changeable(session, buffer_id)
        if buffer.tier == tier or not buffer.chunks:
            return []
        runs = buffer.backed_runs(buffer.segment_sizes, self.backend.granularity)
        if tier == TIER_HOST:
            self.tenants.admit_host(sum(end - start for start, end in runs), "demote")
            buffer.pending = self.chunks.make_runs(buffer.arena, runs, TIER_HOST)
        else:
            buffer.pending = self.make_runs(buffer, runs, "promote (the host copy stays until the move is done)")
        self.account(buffer, pending=sum(c.size for c in buffer.pending), tier=tier)
        return buffer.pending


def _check_tier(tier: str) -> None:
    if tier not in TIERS:
        raise InvalidRequest(f"tier {tier[:32]!r} is not one of {', '.join(TIERS)}", field="tier")


def _check_name(name: str) -> None:
    if len(name) > MAX_NAME or not name.isprintable():
        raise InvalidRequest(f"buffer name must be at most {MAX_NAME} printable characters", field="name")
