"""Sealed buffers: a persistent buffer made immutable, read by any session of its user beside its owner.

A reader maps the buffer's chunks but is never charged for them; its claims
(one per attach) keep the buffer from being dropped, since its mappings
would hold the pages outside the budget. They go with a detach or with the
reading session.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol

from hbmd.proto.errors import Conflict, InvalidRequest, NotFound

from ..backends import A, C
from .holders import add_read_claim, check_readable_layout
from .records import Buffer, Session, check_observer


class SealedBuffers(Protocol[A, C]):
    """What :class:`Sealed` needs of the instance's buffers (:class:`~.buffers.Buffers`)."""

    def of(self, session: Session, buffer_id: int) -> Buffer[A, C]: ...
    def named(self, uid: int, name: str) -> Buffer[A, C]: ...
    def check_handed_out(self, buffer: Buffer[A, C]) -> None: ...
    def mark_changed(self, buffer: Buffer[A, C]) -> None: ...
    def forget_unheld(self, buffer: Buffer[A, C]) -> int: ...


class Sealed(Generic[A, C]):
    """Seals and read claims, over the instance's buffers."""

    def __init__(self, buffers: SealedBuffers[A, C]) -> None:
        self.buffers = buffers

    def seal(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        """Make the session's persistent buffer immutable, so that any session of its user may read it at once.

        Sealing a sealed buffer changes nothing. An anonymous buffer ends with
        its session, so there is nothing for others to read: refused; so is a
        buffer mid-defragment or mid-move, whose chunks are about to change,
        and a demoted one, which would stay in the host tier for good.
        """
        buffer = self.buffers.of(session, buffer_id)
        if buffer.sealed:
            return buffer
        if not buffer.persistent:
            raise InvalidRequest(
                f"buffer {buffer_id} is anonymous: only a persistent buffer can be sealed and read by others",
                buffer_id=buffer_id,
            )
        if buffer.pending:
            raise Conflict(f"buffer {buffer_id} is being defragmented or moved", buffer_id=buffer_id)
        if buffer.demoted:
            # A sealed buffer never moves (its readers map it too): sealed in the host tier, it would stay there.
            raise Conflict(f"buffer {buffer_id} is demoted to the host tier: promote it before sealing it",
                           buffer_id=buffer_id)
        buffer.sealed = True
        buffer.unsealed_since = 0.0
        self.buffers.mark_changed(buffer)
        return buffer

    def attach_reader(self, session: Session, name: str, uneven_ok: bool = True) -> Buffer[A, C]:
        """Add a read claim of the session on its user's sealed buffer ``name``, beside its owner and other readers.

        An unsealed buffer can change under a reader: refused. The claim is
        dropped by :meth:`detach_reader` or when the session ends; readers
        are never charged for the buffer's memory.
        """
        check_observer(session)
        buffer = self.buffers.named(session.uid, name)
        if not buffer.sealed:
            raise InvalidRequest(
                f"persistent buffer {name!r} is not sealed: only a sealed buffer can be attached read-only",
                buffer_id=buffer.buffer_id,
            )
        check_readable_layout(buffer, uneven_ok)
        self.buffers.check_handed_out(buffer)
        add_read_claim(session, buffer)
        self.buffers.mark_changed(buffer)
        return buffer

    def detach_reader(self, session: Session, buffer_id: int) -> Buffer[A, C]:
        """Drop one read claim of the session on sealed buffer ``buffer_id``."""
        buffer = session.reading.get(buffer_id)
        if buffer is None:
            raise NotFound(f"this session does not read buffer {buffer_id}", buffer_id=buffer_id)
        claims = buffer.readers[session.session_id] - 1
        if claims:
            buffer.readers[session.session_id] = claims
        else:
            del buffer.readers[session.session_id]
            del session.reading[buffer_id]
        self.buffers.mark_changed(buffer)
        self.buffers.forget_unheld(buffer)
        return buffer


def check_unread(buffer: Buffer[Any, Any], pids: dict[int, int]) -> None:
    """Refuse to drop a sealed buffer that sessions still read (``pids``: each session id's pid, to name them).

    Their mappings would keep the pages alive outside the budget (and
    the daemon's accounting), so the buffer goes only once its readers have
    let go: they detach or end.
    """
    if not buffer.readers:
        return
    readers = sorted(buffer.readers)
    named = ", ".join(f"{s} (pid {pids[s]})" if s in pids else str(s) for s in readers)
    raise Conflict(
        f"sealed buffer {buffer.name!r} is read by session{'s' if len(readers) > 1 else ''} {named}; "
        "it can be deleted once they detach or end",
        buffer_id=buffer.buffer_id,
        session_id=readers[0],
        readers=",".join(map(str, readers)),
    )
