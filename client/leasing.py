"""Commits served in this process, without a round trip: from the session's lease and on its credit.

The daemon leases granules ahead of need and grants credit (protocol 1.8):
a small commit maps a leased granule and tells the daemon where it went
(:class:`~hbmd.proto.LeasePlace`), or makes a chunk here and binds it to the
buffer (:class:`~hbmd.proto.OwnChunks`). Both are datagrams on the handle
socket, kept in the client's unconfirmed log until an answer shows the
daemon read them (:class:`~hbmd.client.recovery.Recovery`). The tensor's
commit path calls :class:`Leasing` through ``client.leasing``; the listener
thread serves what the daemon sends for it.
"""

from __future__ import annotations

import time
from typing import Any

from hbmd.proto import MAX_PLACED_GRANULES, LeasePlace, OwnChunks
from hbmd.proto.errors import SessionLost

from .core import SessionCore
from .lease import Credit, Lease, LeasedGranule, Spare
from .recovery import Recovery


def granted(core: SessionCore) -> tuple[Lease | None, Credit | None]:
    """The lease and the credit the session's welcome grants, None for either it does not; they send on the
    session's handle channel, whichever it is when they do, and map with its mapper."""
    welcome = core.welcome
    lease = Lease(core.granularity, lambda: core.mapper, core.send) if welcome.lease_bytes > 0 else None
    credit = Credit(core.send, lambda: core.mapper) if welcome.credit_bytes > 0 else None
    return lease, credit


class Leasing:
    """The session's lease and credit, as commits use them; either may be off (None).

    A placement or a bind goes into ``recovery``'s unconfirmed log, and one
    that finds the daemon gone takes the session back through it.
    """

    def __init__(self, core: SessionCore, recovery: Recovery, lease: Lease | None, credit: Credit | None) -> None:
        self._core = core
        self._recovery = recovery
        self.lease = lease
        self.credit = credit

    @property
    def on(self) -> bool:
        """Whether the daemon leases or credits this session anything."""
        return self.lease is not None or self.credit is not None

    @property
    def granules(self) -> int:
        """Leased granules ready in this process."""
        return 0 if self.lease is None else len(self.lease)

    def take(self, count: int) -> list[LeasedGranule] | None:
        """``count`` leased granules, imported and ready to map; None where the lease holds fewer, is off, or the
        commit is one the daemon serves faster (more than :data:`MAX_PLACED_GRANULES`). Raises
        :class:`~hbmd.client.ForkedClient` in a forked child: the lease is the parent's, its handle socket closed
        there."""
        core = self._core
        core.check_not_forked()
        if self.lease is None or count > min(MAX_PLACED_GRANULES, core.welcome.lease_bytes // core.granularity):
            return None
        taken = self.lease.take(count)
        if taken is None:
            # Grants the listener has not read yet may be waiting.
            inbox = core.handles.inbox
            inbox.drain()
            self.lease.serve(inbox.grants, inbox.revokes)
            taken = self.lease.take(count)
        return taken

    def place(self, buffer_id: int, sizes: list[int], taken: list[LeasedGranule], offsets: list[int]) -> bool:
        """Tell the daemon the ``taken`` granules back ``buffer_id`` at ``offsets``, its segments grown to ``sizes``.

        Call it before mapping them: once it returns True the daemon will
        record the placement before anything else this session asks, or its
        end. False: the daemon had gone away and the session is resumed now;
        nothing was placed and the granules are back in the lease (commit
        through the daemon instead). Where it raises, nothing was sent and the
        granules are back in the lease.
        """
        assert self.lease is not None, "granules are placed only once taken from the lease"
        placement = LeasePlace(buffer_id, list(sizes), [g.chunk_id for g in taken], list(offsets))
        try:
            self._core.handles.send(placement)
        except SessionLost:
            self.lease.put_back(taken)
            self._recovery.resume(time.monotonic() + self._core.resume_timeout)
            return False
        except BaseException:
            self.lease.put_back(taken)
            raise
        self.lease.placed(taken)
        self._recovery.unconfirmed_sent(placement, [])
        return True

    def discard(self, taken: list[LeasedGranule]) -> None:
        """Let go of placed granules' imports: the mappings made from them hold the memory."""
        for granule in taken:
            self._core.mapper.discard(granule.prepared)

    def credit_covers(self, amount: int) -> bool:
        """Whether the credit holds ``amount`` bytes now (grants that came are read first)."""
        if self.credit is None:
            return False
        if self.credit.bytes < amount:
            inbox = self._core.handles.inbox
            inbox.drain()
            self.credit.serve(inbox.credits)
        return self.credit.bytes >= amount

    def take_spare(self, size: int) -> Spare | None:
        """The chunk of ``size`` bytes the listener made ahead on credit, if there is one (see :class:`Credit`)."""
        return None if self.credit is None else self.credit.take_spare(size)

    def bind(self, buffer_id: int, sizes: list[int], runs: list[tuple[int, int]], made: list[Any],
             fds: list[int]) -> bool:
        """Tell the daemon that the chunks ``made`` here (:meth:`Mapper.make`) back ``buffer_id``, one per
        ``(offset, size)`` of ``runs``, its segments grown to ``sizes``, paid from the credit.

        ``fds`` holds each chunk's FD where it was exported already (a
        spare's) and -1 where it is exported here, in its place. Call it once
        they are mapped, before the commit returns: once it returns True the
        daemon will record them (or, for chunks that are not what they
        claim, refuse them) before anything else this session asks, or its
        end, and keeps them past this process; the FDs are then this client's.
        False: the credit is short, or the daemon had gone away and the
        session is resumed now; nothing was bound (unmap them, close the FDs
        and commit through the daemon instead).
        """
        assert self.credit is not None, "chunks are bound only where the credit covered them"
        core = self._core
        for i, prepared in enumerate(made):
            if fds[i] < 0:
                fds[i] = core.mapper.export(prepared)
        bind = OwnChunks(buffer_id, list(sizes), [offset for offset, _ in runs], [size for _, size in runs])
        ahead = bind.chunk_sizes[0] if len(runs) == 1 else 0
        handles = core.handles
        try:
            sent = self.credit.spend(sum(bind.chunk_sizes), lambda: handles.send(bind, fds), ahead)
        except SessionLost:
            self._recovery.resume(time.monotonic() + core.resume_timeout)
            return False
        if sent:
            # Kept until the daemon is known to have read the bind: a daemon that went before may need it again.
            self._recovery.unconfirmed_sent(bind, fds)
        return sent

    # the listener's side

    def serve(self) -> None:
        """Take in the grants, revokes and credit that came, and make the next chunk on credit ahead."""
        inbox = self._core.handles.inbox
        if self.lease is not None:
            self.lease.serve(inbox.grants, inbox.revokes)
        if self.credit is not None:
            self.credit.serve(inbox.credits)
            self.credit.make_spare()

    def give_back(self) -> bool:
        """Give every leased granule back, those granted and not imported yet too, and all the credit; whether any
        of either went.

        A call that waits for a reply riding with FDs reads the handle socket
        itself and files the grants that come meanwhile for the listener to
        import: left there, they would come into the lease after it was given
        back, and stay leased to a session that was just refused for want of
        room.
        """
        inbox = self._core.handles.inbox
        inbox.drain()
        given = False
        if self.lease is not None:
            self.lease.serve(inbox.grants, inbox.revokes)
            given = self.lease.give_back() > 0
        if self.credit is not None:
            self.credit.serve(inbox.credits)
            given = self.credit.give_back() > 0 or given
        return given

    def close(self) -> None:
        if self.lease is not None:
            self.lease.close()
        if self.credit is not None:
            self.credit.close()
