"""Sealed buffers: a persistent buffer made immutable, read by any session of its user beside its owner.

A reader maps the buffer's chunks but is never charged for them; its claims
(one per attach) keep the buffer from being dropped, since its mappings
would hold the pages outside the budget. They go with a detach or with the
reading session.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic

from hbmd.proto.errors import Conflict, InvalidRequest, NotFound, VersionMismatch

from ..backends import A, C
from .records import Buffer, Session, check_observer

if TYPE_CHECKING:
    from .buffers import Buffers

UNSEALED_NAME_KEPT_S = 60.0
"""How long a name dropped unsealed keeps its age for a persistent buffer made again under it: far longer than an
engine waiting for a seal takes to look again (``integrations/vllm_weights.py``, 0.2 s), so a holder that deletes the
name and makes it again at once does not look new to it."""


class Sealed(Generic[A, C]):
    """Seals and read claims, over the instance's :class:`~.buffers.Buffers`."""

    def __init__(self, buffers: Buffers[A, C]) -> None:
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

    def attach_reader(self, session: Session, name: str, uneven_ok: bool) -> Buffer[A, C]:
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


def add_read_claim(session: Session, buffer: Buffer[Any, Any]) -> None:
    buffer.readers[session.session_id] = buffer.readers.get(session.session_id, 0) + 1
    session.reading[buffer.buffer_id] = buffer


def check_readable_layout(buffer: Buffer[Any, Any], uneven_ok: bool) -> None:
    """Refuse a client that cannot read uneven segments (``uneven_ok`` False) a buffer that has them, rather than
    hand it a layout it would misread."""
    if not (uneven_ok or buffer.uniform):
        raise VersionMismatch(
            f"persistent buffer {buffer.name!r} has uneven segments: attaching it needs an hbmd client of protocol "
            "1.1 or later"
        )


class UnsealedNames:
    """How long each user's names dropped unsealed lately had been held unsealed (:attr:`Buffer.unsealed_since`).

    An engine waits for another's seal of a weights name only while the name
    has been unsealed for less than it waits (``wait_s``), which a holder
    could reset by handing the name to each new session it opens; the age
    is the buffer's, so an attach keeps it, and a name deleted and made
    again within :data:`UNSEALED_NAME_KEPT_S` keeps it too. Each user's
    names are kept up to ``per_uid``, the youngest claim forgotten first:
    forgetting an old one takes as many names held unsealed longer. Not
    journaled: a restart within the minute forgets them.
    """

    def __init__(self, per_uid: int) -> None:
        self.per_uid = per_uid
        self.dropped: dict[int, dict[str, tuple[float, float]]] = {}
        """By uid, then name: since when it had been unsealed and when it was dropped (Unix times)."""

    def since(self, uid: int, name: str, now: float) -> float:
        """Since when a persistent buffer ``name`` of ``uid`` made at ``now`` holds its name unsealed."""
        self.forget_older(now)
        names = self.dropped.get(uid)
        kept = names.pop(name, None) if names is not None else None
        if names is not None and not names:
            del self.dropped[uid]
        return kept[0] if kept is not None else now

    def dropped_unsealed(self, buffer: Buffer[Any, Any], now: float) -> None:
        """The persistent buffer was dropped, its name unsealed: a buffer made under it soon keeps its age."""
        names = self.dropped.setdefault(buffer.owner_uid, {})
        names[buffer.name] = (buffer.unsealed_since, now)
        if len(names) > self.per_uid:
            del names[max(names, key=lambda name: names[name][0])]

    def forget_older(self, now: float) -> None:
        """Forget the names dropped more than :data:`UNSEALED_NAME_KEPT_S` before ``now``."""
        for uid, names in list(self.dropped.items()):
            for name in [n for n, (_, dropped_at) in names.items() if now - dropped_at > UNSEALED_NAME_KEPT_S]:
                del names[name]
            if not names:
                del self.dropped[uid]
