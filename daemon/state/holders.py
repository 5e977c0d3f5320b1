"""Who holds a buffer: its owner, its readers, the process watched while it may still write an orphan, and when an
orphan's grace period ends.

The record-level steps that :mod:`.buffers`, :mod:`.orphans` and
:mod:`.sealed` each take on a buffer's holders, kept apart so that none of
those three imports another.
"""

from __future__ import annotations

import math
from typing import Any

from hbmd.proto.errors import Conflict, InvalidRequest, VersionMismatch

from .records import Buffer, Session

MAX_KEEP_ORPHAN_S = 366 * 86400.0
"""The longest grace period: a year. Longer is what 0 (kept until deleted) says."""


def check_keep(keep_orphan_s: float, persistent: bool) -> None:
    """Refuse a grace period that is not a number of seconds in ``[0, MAX_KEEP_ORPHAN_S]``, or one given to a buffer
    that never becomes an orphan (an anonymous one ends with its session)."""
    if not (math.isfinite(keep_orphan_s) and 0 <= keep_orphan_s <= MAX_KEEP_ORPHAN_S):
        raise InvalidRequest(f"keep_orphan_s {keep_orphan_s} is out of range [0, {MAX_KEEP_ORPHAN_S:.0f}]",
                             field="keep_orphan_s")
    if keep_orphan_s and not persistent:
        raise InvalidRequest("keep_orphan_s is for a persistent buffer: an anonymous one ends with its session",
                             field="keep_orphan_s")


def left_by(buffer: Buffer[Any, Any], session: Session, now: float) -> None:
    """``session`` let go of the buffer, an orphan from Unix time ``now``: its grace period starts."""
    buffer.last_holder = (session.client_name, session.pid)
    buffer.orphaned_at = now
    buffer.expires_at = now + buffer.keep_orphan_s if buffer.keep_orphan_s else 0.0


def taken(buffer: Buffer[Any, Any]) -> None:
    """A session holds the buffer again: it is no orphan, and nothing is due."""
    buffer.orphaned_at = buffer.expires_at = 0.0


def give_to(session: Session, buffer: Buffer[Any, Any]) -> None:
    """Make the session the owner of an orphan."""
    taken(buffer)
    let_go_of_writer(buffer)
    buffer.owner = session
    session.buffers[buffer.buffer_id] = buffer


def let_go_of_writer(buffer: Buffer[Any, Any]) -> None:
    """Stop watching the process that may still write the buffer (:mod:`.writers`): it is taken, or gone."""
    if buffer.writer is not None:
        buffer.writer.close()
        buffer.writer = None


def check_no_other_writer(buffer: Buffer[Any, Any], session: Session) -> None:
    """Refuse, retryably, to hand an orphan's pages to the process of ``session`` while its last holder, another
    process whose session ended while it lived, may still map and write them (issue #61): two processes would write
    the same pages."""
    writer = buffer.writer
    if writer is None:
        return
    if writer.gone():
        let_go_of_writer(buffer)
        return
    if writer.pid and writer.pid == session.pid:
        return  # its own process: what it maps there is its own business
    holder = buffer.last_holder[0] or "a client"
    raise Conflict(
        f"orphan {buffer.name!r}: its last holder, {holder} (pid {writer.pid}), lives on and may still map and write "
        "it (its session ended without a detach): retry once that process has exited",
        buffer_id=buffer.buffer_id, pid=writer.pid,
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
