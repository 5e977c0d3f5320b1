"""Orphans: persistent buffers no session holds, how they come to be and what becomes of them besides a delete.

A session's *detach* (or its end) makes its persistent buffer an orphan,
and an *attach* by name gives the orphan to a session of the same user.
A *graft* gives an orphan's chunks, with their data, to a session's own
empty buffer of as many segments, each chunk at the same offset of its
segment: how a restarted engine adopts what its predecessor left, at the
address its own buffer already has.
A *grace period* (``keep_orphan_s``, chosen at the buffer's creation) frees
an orphan nobody attached or grafted within it.

Deadlines are Unix times, journaled as they are (``daemon/restart/persist.py``):
the time the daemon was down counts, as the orphan held its memory then
too, and a daemon that restarts over and over still frees it. A deadline
kept as seconds left would start over at every restart.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from typing import Any, Generic, Protocol

from hbmd.proto.errors import Conflict, InvalidRequest
from hbmd.proto.units import format_bytes

from ..backends import A, C
from ..clock import Clock
from .holders import check_no_other_writer, check_readable_layout, give_to
from .records import Buffer, Session, Tenant, check_observer
from .tenants import Tenants
from .unsealed import UnsealedNames

log = logging.getLogger("hbmd.state")

def _when(unix_time: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_time))


class OrphanBuffers(Protocol[A, C]):
    """What :class:`Orphans` needs of the instance's buffers (:class:`~.buffers.Buffers`): its lookups, its
    accounting, and the deadlines it stamps as a buffer becomes an orphan."""

    by_id: dict[int, Buffer[A, C]]
    deadlines: dict[int, float]
    unsealed_names: UnsealedNames

    def of(self, session: Session, buffer_id: int) -> Buffer[A, C]: ...
    def changeable(self, session: Session, buffer_id: int) -> Buffer[A, C]: ...
    def orphan(self, uid: int, name: str) -> Buffer[A, C]: ...
    def check_handed_out(self, buffer: Buffer[A, C]) -> None: ...
    def recharge(self, buffer: Buffer[A, C], tenant: Tenant, purpose: str) -> None: ...
    def account(self, buffer: Buffer[A, C], mapped: int = 0) -> None: ...
    def mark_changed(self, buffer: Buffer[A, C]) -> None: ...
    def disown(self, buffer: Buffer[A, C]) -> int: ...
    def drop(self, buffer: Buffer[A, C]) -> int: ...


class Orphans(Generic[A, C]):
    """Attaches, detaches, grafts and grace periods, over the instance's buffers and the budget."""

    def __init__(self, buffers: OrphanBuffers[A, C], tenants: Tenants, granularity: int,
                 clock: Clock) -> None:
        """``granularity``: the backend's, which a grafted chunk moves by; ``clock``: the state's, whose Unix time
        grace periods are kept by."""
        self.buffers = buffers
        self.tenants = tenants
        self.granularity = granularity
        self.clock = clock

    def attach(self, session: Session, name: str, uneven_ok: bool = True) -> Buffer[A, C]:
        """Give an orphaned persistent buffer of the session's user to the session.

        Names are per user: another user's buffer of the same name is not found.
        A client that cannot read uneven segments (``uneven_ok`` False) is
        refused such a buffer rather than handed a layout it would misread.
        """
        check_observer(session)
        buffer = self.buffers.orphan(session.uid, name)
        check_readable_layout(buffer, uneven_ok)
        self.buffers.check_handed_out(buffer)
        check_no_other_writer(buffer, session)
        # Its holder's tenant pays for it, as a graft's does: the uid may have left the orphan's tenant since.
        self.buffers.recharge(buffer, session.tenant, f"attaching orphan {name!r}")
        give_to(session, buffer)
        self.buffers.mark_changed(buffer)
        return buffer

    def detach(self, session: Session, buffer_id: int) -> int:
        """Let go of the session's persistent buffer: it stays, an orphan with its chunks, until attached by name.

        Returns the bytes of an unfinished defragment's new chunks, dropped.
        An anonymous buffer has no name to come back by: refused. So is one
        declared again whose memory only this process holds: unmapped here it
        would be gone, with nothing left to attach.
        """
        buffer = self.buffers.of(session, buffer_id)
        if not buffer.persistent:
            raise InvalidRequest(
                f"buffer {buffer_id} is anonymous: only a persistent buffer can be detached and attached again",
                buffer_id=buffer_id,
            )
        if buffer.held_elsewhere and not buffer.readers:
            raise Conflict(
                f"buffer {buffer_id} ({buffer.name!r}) was declared again after hbmd restarted with nothing to keep "
                "its memory: only this process holds it, so a detach would lose it; keep it mapped, or copy it into a "
                "new persistent buffer and detach that",
                buffer_id=buffer_id,
            )
        return self.buffers.disown(buffer)

    def graft(self, session: Session, buffer_id: int, name: str) -> Buffer[A, C]:
        """Give every chunk of orphan ``name`` of the session's user to its buffer ``buffer_id``; returns that buffer.

        See :class:`hbmd.proto.Graft` for what is refused. Nothing is made,
        copied or freed: the chunks change buffers, their ids, FD-store names
        and data with them, and the orphan's record goes. Raises with nothing
        changed.
        """
        target = self.buffers.changeable(session, buffer_id)
        if target.chunks:
            raise InvalidRequest(
                f"buffer {buffer_id} has {format_bytes(target.physical_bytes)} committed: a graft fills a buffer with "
                "nothing committed; release it first",
                buffer_id=buffer_id,
            )
        donor = self.buffers.orphan(session.uid, name)
        _check_graftable(donor)
        self.buffers.check_handed_out(donor)
        shifts = _segment_shifts(target, donor, self.granularity)
        check_no_other_writer(donor, session)
        moved = donor.physical_bytes
        self.tenants.admit_transfer(donor.tenant, target.tenant, moved, f"grafting orphan {name!r}")
        self.buffers.account(donor, mapped=-moved)
        self.buffers.account(target, mapped=moved)
        for chunk in donor.chunks:
            chunk.offset += shifts[_segment_of(donor, chunk.offset)]
        target.chunks, donor.chunks = donor.chunks, []
        target.segment_sizes, donor.segment_sizes = donor.segment_sizes, [0] * donor.num_segments
        # A chunk is made in its buffer's arena and exported and released through it (the Backend interface), so the
        # chunks go with the arena they were made in; the target's own holds no chunk and goes with the orphan's
        # record. Neither backend keeps memory in an arena (a host chunk is a memfd of its own, a CUDA chunk an
        # allocation of its own); the CUDA arena says whether new chunks are RDMA-capable, which the orphan's says
        # of the chunks it made, so the buffer grows on in the kind of chunks it has.
        target.arena, donor.arena = donor.arena, target.arena
        self.buffers.drop(donor)
        return target

    def expire(self) -> int:
        """Free each orphan whose grace period is over, logging it at WARNING; returns how many.

        One that sessions still read (a sealed one) waits for them to let go:
        their mappings would keep its pages alive outside the budget.
        """
        now = self.clock.unix()
        self.buffers.unsealed_names.forget_older(now)
        deadlines = self.buffers.deadlines
        if not deadlines:
            return 0
        if now < min(deadlines.values()):
            return 0
        expired = 0
        for buffer_id, due in sorted(deadlines.items()):
            buffer = self.buffers.by_id.get(buffer_id)
            if buffer is None or buffer.owner is not None or buffer.expires_at != due:
                del deadlines[buffer_id]  # attached, grafted or deleted meanwhile
            elif due <= now and not buffer.readers:
                del deadlines[buffer_id]
                self._free(buffer)
                expired += 1
        return expired

    def _free(self, buffer: Buffer[A, C]) -> None:
        holder, pid = buffer.last_holder
        by = f"{holder or 'a client'} (pid {pid})" if pid else "a session the daemon does not know"
        freed = self.buffers.drop(buffer)
        log.warning(
            "orphan %r of uid %d freed (%s): an orphan since %s, last held by %s, nobody attached or grafted it "
            "within its %gs grace period (keep_orphan_s)",
            buffer.name, buffer.owner_uid, format_bytes(freed), _when(buffer.orphaned_at), by, buffer.keep_orphan_s,
        )

    def restored(self, buffer: Buffer[A, C], keep_orphan_s: float, orphaned_at: float, expires_at: float,
                 last_holder: tuple[str, int]) -> None:
        """A buffer brought back after a restart, with its grace period as journaled.

        An orphan keeps its deadline; one journaled while held, whose session
        did not come back, is an orphan from now. A deadline further off than
        the grace period (the wall clock was set back since) is brought in to
        it.
        """
        buffer.keep_orphan_s, buffer.last_holder = keep_orphan_s, last_holder
        if buffer.owner is not None:
            return
        now = self.clock.unix()
        buffer.orphaned_at = orphaned_at or now
        if keep_orphan_s:
            buffer.expires_at = min(expires_at or math.inf, now + keep_orphan_s)
            self.buffers.deadlines[buffer.buffer_id] = buffer.expires_at


def _check_graftable(donor: Buffer[Any, Any]) -> None:
    """Refuse an orphan whose chunks cannot change buffers: sealed (read by others, or to be), demoted, or with a
    defragment's chunks beside its own."""
    why = ("it is sealed: its chunks are for reading beside others, attach it read-only" if donor.sealed
           else "it is demoted to the host tier: attach and promote it first" if donor.demoted
           else "it is being defragmented or moved" if donor.pending else "")
    if why:
        raise InvalidRequest(f"orphan {donor.name!r} cannot be grafted: {why}", buffer_id=donor.buffer_id)


def _layout(buffer: Buffer[Any, Any]) -> str:
    shown = ", ".join(map(str, buffer.segment_capacities[:8])) + (", ..." if buffer.num_segments > 8 else "")
    return (f"{buffer.capacity} bytes in {buffer.num_segments} segments of [{shown}] bytes"
            f"{', shareable' if buffer.shareable else ''}")


def _segment_of(buffer: Buffer[Any, Any], offset: int) -> int:
    return bisect.bisect_right(buffer.segment_offsets, offset) - 1


def _segment_shifts(target: Buffer[Any, Any], donor: Buffer[Any, Any], granule: int) -> list[int]:
    """How far each segment's chunks move from ``donor`` to ``target``: each chunk keeps its offset within its
    segment. Refuses buffers of other segment counts or chunk kinds, and, where the segments lie elsewhere, a chunk
    that is not within its segment or a move that is not whole granules, and a segment whose committed bytes the
    target's does not hold. Same capacities: nothing moves (a granule two segments share is grafted as it is).

    Segments of other capacities are what a restarted vLLM has where its profiled memory moved a little (CUDA graphs
    make it vary run to run): its reservation is a few blocks longer or shorter, its layers as they were."""
    if (target.num_segments, target.shareable) != (donor.num_segments, donor.shareable):
        raise InvalidRequest(
            f"orphan {donor.name!r} has another layout than buffer {target.buffer_id}: {_layout(donor)}, not "
            f"{_layout(target)}",
            buffer_id=target.buffer_id, field="layout",
        )
    if target.segment_capacities == donor.segment_capacities:
        return [0] * donor.num_segments
    shifts = [mine - theirs for mine, theirs in zip(target.segment_offsets, donor.segment_offsets)]
    why = ""
    if any(shift % granule for shift in shifts):
        why = "its segments do not start on granules, so its chunks cannot move"
    for chunk in donor.chunks:
        segment = _segment_of(donor, chunk.offset)
        end = chunk.offset - donor.segment_offsets[segment] + chunk.size
        if end > min(donor.segment_capacities[segment], target.segment_capacities[segment]):
            why = why or (f"its chunk at {chunk.offset} ends {end} bytes into segment {segment}, past the "
                          f"{target.segment_capacities[segment]} bytes of buffer {target.buffer_id}'s, or straddles "
                          "two segments")
    if why:
        raise InvalidRequest(
            f"orphan {donor.name!r} cannot be grafted into buffer {target.buffer_id}: {why} ({_layout(donor)}, "
            f"not {_layout(target)})",
            buffer_id=target.buffer_id, field="layout",
        )
    return shifts
