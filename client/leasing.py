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
import weakref
from typing import TYPE_CHECKING, Any

from hbmd.proto import MAX_PLACED_GRANULES, LeasePlace, Message, OwnChunks
from hbmd.proto.errors import SessionLost

from .lease import Credit, Lease, LeasedGranule, Spare

if TYPE_CHECKING:
    from .session import Client


class Leasing:
    """The session's lease and credit, as commits use them; either may be off (None).

    It holds its client weakly, as the lease and the credit do: a client
    dropped unclosed is collected, and its session ends with its socket.
    """

    def __init__(self, client: Client) -> None:
        self._client = weakref.proxy(client)
        me = weakref.ref(client)

        def alive() -> Client:
            found = me()
            if found is None:
                raise ReferenceError("the hbmd client is gone")
            return found

        def send(msg: Message) -> None:
            alive()._handles.send(msg)

        welcome = client.welcome
        self.lease: Lease | None = None
        if welcome.lease_bytes > 0:
            self.lease = Lease(client.granularity, lambda: alive().mapper, send)
            weakref.finalize(client, self.lease.close)
        self.credit: Credit | None = None
        if welcome.credit_bytes > 0:
            self.credit = Credit(send, lambda: alive().mapper)
            weakref.finalize(client, self.credit.close)

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
        client = self._client
        client._check_not_forked()
        if self.lease is None or count > min(MAX_PLACED_GRANULES, client.welcome.lease_bytes // client.granularity):
            return None
        taken = self.lease.take(count)
        if taken is None:
            # Grants the listener has not read yet may be waiting.
            inbox = client._handles.inbox
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
        client = self._client
        placement = LeasePlace(buffer_id, list(sizes), [g.chunk_id for g in taken], list(offsets))
        try:
            client._handles.send(placement)
        except SessionLost:
            self.lease.put_back(taken)
            client._recovery.resume(time.monotonic() + client.resume_timeout)
            return False
        except BaseException:
            self.lease.put_back(taken)
            raise
        self.lease.placed(taken)
        client._recovery.unconfirmed_sent(placement, [])
        return True

    def discard(self, taken: list[LeasedGranule]) -> None:
        """Let go of placed granules' imports: the mappings made from them hold the memory."""
        for granule in taken:
            self._client.mapper.discard(granule.prepared)

    def credit_covers(self, amount: int) -> bool:
        """Whether the credit holds ``amount`` bytes now (grants that came are read first)."""
        if self.credit is None:
            return False
        if self.credit.bytes < amount:
            inbox = self._client._handles.inbox
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
        client = self._client
        for i, prepared in enumerate(made):
            if fds[i] < 0:
                fds[i] = client.mapper.export(prepared)
        bind = OwnChunks(buffer_id, list(sizes), [offset for offset, _ in runs], [size for _, size in runs])
        ahead = bind.chunk_sizes[0] if len(runs) == 1 else 0
        handles = client._handles
        try:
            sent = self.credit.spend(sum(bind.chunk_sizes), lambda: handles.send(bind, fds), ahead)
        except SessionLost:
            client._recovery.resume(time.monotonic() + client.resume_timeout)
            return False
        if sent:
            # Kept until the daemon is known to have read the bind: a daemon that went before may need it again.
            client._recovery.unconfirmed_sent(bind, fds)
        return sent

    # the listener's side

    def serve(self) -> None:
        """Take in the grants, revokes and credit that came, and make the next chunk on credit ahead."""
        inbox = self._client._handles.inbox
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
        inbox = self._client._handles.inbox
        inbox.drain()
        given = False
        if self.lease is not None:
            self.lease.serve(inbox.grants, inbox.revokes)
            given = self.lease.give_back() > 0
        if self.credit is not None:
            self.credit.serve(inbox.credits)
            given = self.credit.give_back() > 0 or given
        return given

    def resumed(self, still_leased: set[int]) -> None:
        """The session was taken back: keep the granules the daemon still records as leased (``still_leased``), and
        give all the credit back."""
        if self.lease is not None:
            self.lease.resumed(still_leased)
        if self.credit is not None:
            self._client._handles.inbox.credits.clear()
            self.credit.give_back()

    def close(self) -> None:
        if self.lease is not None:
            self.lease.close()
        if self.credit is not None:
            self.credit.close()
