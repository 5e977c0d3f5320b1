"""What waits in a connection's outbox: a request's batch of chunk FDs, or granules leased to its session (sent by
:mod:`.outbox`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Generic

from hbmd.proto import Committed, FdBatch, LeaseGrant

from ..backends import A, C
from ..state import Buffer, Chunk, Session, State


@dataclasses.dataclass
class ChunkDelivery(Generic[A, C]):
    """One batch of the chunk FDs a request asked for (commit, attach, defragment, remap), all of one buffer."""

    request_id: int
    buffer: Buffer[A, C]
    chunks: list[Chunk[C]]
    batch: int
    batches: int
    reply: Committed | None = None
    """The request's reply, riding with the FDs (see :meth:`Outbox.reply_with_fds`)."""

    @property
    def purpose(self) -> str:
        """What the FDs are for, in a log line."""
        return f"request {self.request_id}"

    def prune(self) -> bool:
        """True: a request's batch goes out whole, or its header says why it could not."""
        return True

    def header(self) -> FdBatch:
        """The datagram the FDs ride on: the i-th FD is ``chunk_ids[i]`` of batch ``batch`` of the request."""
        return FdBatch(self.request_id, [c.chunk_id for c in self.chunks], self.batch, self.batches, reply=self.reply)

    def export(self, state: State[A, C], chunk: Chunk[C]) -> int:
        """A new FD for ``chunk`` of the buffer."""
        return state.buffers.export(self.buffer, chunk)

    def failed(self, state: State[A, C], session: Session, error: str) -> FdBatch:
        """The header to send instead when the chunks could not be exported: no FDs, and why."""
        return dataclasses.replace(self.header(), error=error)


@dataclasses.dataclass
class LeaseDelivery(Generic[C]):
    """Granules leased to a session, sent unasked: its client places them in its buffers itself."""

    chunks: list[Chunk[C]]
    granule: int
    purpose = "leased granules"
    """What the FDs are for, in a log line."""

    def prune(self) -> bool:
        """Drop the granules the client gave back before they were sent (it cannot have known them); False if none
        is left."""
        self.chunks = [c for c in self.chunks if c.live]
        return bool(self.chunks)

    def header(self) -> LeaseGrant:
        """The datagram the FDs ride on: one granule per FD."""
        return LeaseGrant([c.chunk_id for c in self.chunks], self.granule)

    def export(self, state: State[Any, C], chunk: Chunk[C]) -> int:
        """A new FD for the leased granule ``chunk``."""
        return state.leases.export(chunk)

    def failed(self, state: State[Any, C], session: Session, error: str) -> None:
        """Never sent, so never placed: the granules go back to the state, and nothing is sent."""
        state.leases.given_back(session, [c.chunk_id for c in self.chunks])


Delivery = ChunkDelivery[A, C] | LeaseDelivery[C]
