"""Orphans: persistent buffers no session holds, and what becomes of them besides an attach or a delete.

A *graft* gives an orphan's chunks, with their data, to a session's own
empty buffer of the same layout, at the same offsets: how a restarted engine
adopts what its predecessor left, at the address its own buffer already has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic

from hbmd.proto.errors import InvalidRequest
from hbmd.proto.units import format_bytes

from ..backends import A, C
from .records import Buffer, Session
from .tenants import Tenants

if TYPE_CHECKING:
    from .buffers import Buffers


class Orphans(Generic[A, C]):
    """Grafts, over the instance's :class:`~.buffers.Buffers` and the budget."""

    def __init__(self, buffers: Buffers[A, C], tenants: Tenants) -> None:
        self.buffers = buffers
        self.tenants = tenants

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
        _check_same_layout(target, donor)
        moved = donor.physical_bytes
        self.tenants.admit_transfer(donor.tenant, target.tenant, moved, f"grafting orphan {name!r}")
        self.buffers.account(donor, mapped=-moved)
        self.buffers.account(target, mapped=moved)
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


def _check_same_layout(target: Buffer[Any, Any], donor: Buffer[Any, Any]) -> None:
    """Refuse buffers whose chunks would not lie at the same offsets of the same segments in both."""
    if (target.capacity, target.segment_capacities, target.shareable) != (
            donor.capacity, donor.segment_capacities, donor.shareable):
        raise InvalidRequest(
            f"orphan {donor.name!r} has another layout than buffer {target.buffer_id}: {_layout(donor)}, not "
            f"{_layout(target)}",
            buffer_id=target.buffer_id, field="layout",
        )
