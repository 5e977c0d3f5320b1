"""The granules a daemon leased to this session, imported ahead of use.

The daemon creates and exports granules before they are needed and sends
them on the handle socket (:class:`LeaseGrant`); the client's listener thread
imports each as it arrives. A commit whose new granules the lease covers
takes them from here, tells the daemon where they go (:class:`LeasePlace`,
sent before they are mapped) and maps them: no round trip. Granules the
daemon asks back (:class:`LeaseRevoke`) and has not seen placed are given
back (:class:`LeaseReturn`), as is the whole lease when a commit through the
daemon does not fit without it.

A revoke always wins over a granule this process has in hand: one asked back
while it is being imported, or while a commit holds it and then puts it back
unplaced, is returned the moment it would have gone into the lease. Only a
placement the daemon was told of keeps it (the daemon reads the placement and
forgets the revoke).

The session's credit (:class:`Credit`) is the lease in bytes: a commit it
covers makes its chunks in this process and sends them to the daemon.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from hbmd.proto import (
    MAX_SEGMENTS,
    CreditGrant,
    CreditReturn,
    CreditRevoke,
    LeaseGrant,
    LeaseReturn,
    LeaseRevoke,
    Message,
)

from .mapper import Mapper

log = logging.getLogger("hbmd.client")

T = TypeVar("T")

MAX_UNWANTED = 4096
"""Chunk ids remembered as not wanted before their grant arrives; the oldest are forgotten past this."""

IMPORT_WAIT_S = 0.05
"""The longest a commit short of granules waits for those the listener is importing (an import takes far less) before
it goes to the daemon instead."""


@dataclasses.dataclass(frozen=True)
class LeasedGranule:
    """One leased granule: its chunk id, and its import (:meth:`Mapper.prepare`) to map wherever it is placed."""

    chunk_id: int
    prepared: Any


class Lease:
    """Leased granules by chunk id, each imported and ready to map.

    Safe to use from two threads at once (the listener serving grants and
    revokes, a commit taking granules): every change of which granules are
    here, in hand or asked back happens under one lock.
    """

    def __init__(self, granule: int, mapper: Callable[[], Mapper], send: Callable[[Message], None]) -> None:
        """``mapper`` gives the session's mapper (asked once, at the first grant); ``send`` sends a datagram."""
        self.granule = granule
        self._get_mapper = mapper
        self._mapper_now: Mapper | None = None
        self._send = send
        self._lock = threading.Lock()
        self._ready: dict[int, LeasedGranule] = {}
        self._in_hand: set[int] = set()
        """Chunk ids out of ``_ready`` for a while but still this session's: being imported, or taken for a
        placement."""
        self._asked_back: set[int] = set()
        """Those of ``_in_hand`` the daemon asked back meanwhile: they go back instead of into ``_ready``."""
        self._unwanted: set[int] = set()
        """Chunk ids to give back when their grant arrives (asked back, or released, before it was read)."""
        self._importing = 0
        """Granules of ``_in_hand`` being imported now."""
        self._imported = threading.Condition(self._lock)

    def _mapper(self) -> Mapper:
        if self._mapper_now is None:
            self._mapper_now = self._get_mapper()
        return self._mapper_now

    def __len__(self) -> int:
        return len(self._ready)

    def granted(self, grant: LeaseGrant, fds: list[int]) -> None:
        """Import the granted granules, closing their FDs.

        Those asked back, before or while they are imported, go back.
        """
        back: list[int] = []
        for chunk_id, fd in zip(grant.chunk_ids, fds):
            try:
                if grant.size == self.granule and self._arriving(chunk_id):
                    back.extend(self._import(chunk_id, fd))
                else:
                    back.append(chunk_id)
            finally:
                os.close(fd)
        self._return(back)

    def _arriving(self, chunk_id: int) -> bool:
        """Whether a granted chunk is still wanted; if so it is in hand from here until :meth:`_settle`."""
        with self._lock:
            if chunk_id in self._unwanted:
                self._unwanted.discard(chunk_id)
                return False
            self._in_hand.add(chunk_id)
            self._importing += 1
            return True

    def _import(self, chunk_id: int, fd: int) -> list[int]:
        """Import a chunk in hand into the lease; the ids to give back (it, where it failed or was asked back)."""
        try:
            prepared = self._mapper().prepare(fd)
        except Exception as exc:
            log.warning("importing leased chunk %d failed (%s); giving it back", chunk_id, exc)
            self._out_of_hand([chunk_id])  # it goes back now, asked back or not
            return [chunk_id]
        else:
            return self._settle([LeasedGranule(chunk_id, prepared)])
        finally:
            with self._lock:
                self._importing -= 1
                self._imported.notify_all()

    def _settle(self, granules: list[LeasedGranule]) -> list[int]:
        """Put granules in hand into the lease, except those asked back meanwhile: those are let go of; their ids.

        The check and the insertion share one hold of the lock, so a revoke
        either finds a granule here or marks it asked back first.
        """
        with self._lock:
            asked = [g for g in granules if g.chunk_id in self._asked_back]
            self._ready.update((g.chunk_id, g) for g in granules if g.chunk_id not in self._asked_back)
            for granule in granules:
                self._in_hand.discard(granule.chunk_id)
                self._asked_back.discard(granule.chunk_id)
        self._discard(asked)
        return [g.chunk_id for g in asked]

    def serve(
        self, grants: collections.deque[tuple[LeaseGrant, list[int]]], revokes: collections.deque[LeaseRevoke]
    ) -> None:
        """Import what was granted and give back what was asked back, as the handle socket filed them.

        Either thread may serve: each datagram is taken off its queue once.
        """
        if not grants and not revokes:
            return
        with self._mapper().beside_capture():
            _drain(grants, lambda grant: self.granted(*grant))
            _drain(revokes, self.revoked)

    def revoked(self, revoke: LeaseRevoke) -> None:
        """Give back the granules asked for that are here; mark those in hand, remember the others for their grant."""
        given: list[LeasedGranule] = []
        with self._lock:
            for chunk_id in revoke.chunk_ids:
                if chunk_id in self._ready:
                    given.append(self._ready.pop(chunk_id))
                elif chunk_id in self._in_hand:
                    self._asked_back.add(chunk_id)
                else:
                    self._unwanted.add(chunk_id)
            while len(self._unwanted) > MAX_UNWANTED:
                self._unwanted.discard(min(self._unwanted))
        self._discard(given)
        self._return([g.chunk_id for g in given])

    def give_back(self) -> int:
        """Return every granule here to the daemon (it releases them), those the listener is importing once imported
        (:data:`IMPORT_WAIT_S` at most); how many there were."""
        with self._lock:
            self._imported.wait_for(lambda: not self._importing, IMPORT_WAIT_S)
            given, self._ready = list(self._ready.values()), {}
        self._discard(given)
        self._return([g.chunk_id for g in given])
        return len(given)

    def take(self, count: int) -> list[LeasedGranule] | None:
        """``count`` granules to place, or None when fewer are here (nothing is taken then).

        They are in hand until :meth:`placed` or :meth:`put_back` says what became of them.
        """
        with self._lock:
            # Granules the listener is importing are a moment away: without them the commit would go to the
            # daemon and grow the session past what its lease was sized for (test_leases.py's tight budget).
            self._imported.wait_for(lambda: len(self._ready) >= count or not self._importing, IMPORT_WAIT_S)
            if len(self._ready) < count:
                return None
            taken = [self._ready.popitem()[1] for _ in range(count)]
            self._in_hand.update(g.chunk_id for g in taken)
            return taken

    def placed(self, taken: list[LeasedGranule]) -> None:
        """The daemon was told where the ``taken`` granules go: they are a buffer's now, asked back or not."""
        self._out_of_hand([g.chunk_id for g in taken])

    def _out_of_hand(self, chunk_ids: list[int]) -> None:
        with self._lock:
            self._in_hand.difference_update(chunk_ids)
            self._asked_back.difference_update(chunk_ids)

    def put_back(self, taken: list[LeasedGranule]) -> None:
        """Granules taken but not placed (the placement could not be sent); those asked back meanwhile go back."""
        self._return(self._settle(taken))

    def _return(self, chunk_ids: list[int]) -> None:
        # A daemon decodes no list longer than a buffer's segments: a large lease goes back in several datagrams.
        for start in range(0, len(chunk_ids), MAX_SEGMENTS):
            self._send(LeaseReturn(chunk_ids[start : start + MAX_SEGMENTS]))

    def _discard(self, granules: list[LeasedGranule]) -> None:
        """Let go of imports; a failure is logged, never raised, so that their return is still sent."""
        for granule in granules:
            try:
                self._mapper().discard(granule.prepared)
            except Exception as exc:
                log.debug("discarding leased chunk %d failed: %s", granule.chunk_id, exc)

    def resumed(self, leased: set[int]) -> None:
        """The session was resumed on a restarted daemon, which records ``leased`` as this session's unplaced granules:
        let go of those it does not record (it does not count them), give back those it records and this process lacks
        (their grants were lost with the daemon that went)."""
        with self._lock:
            stale = [g for chunk_id, g in self._ready.items() if chunk_id not in leased]
            for granule in stale:
                del self._ready[granule.chunk_id]
            missing = sorted(leased - self._ready.keys() - self._in_hand)
        self._discard(stale)
        self._return(missing)

    def close(self) -> None:
        """Let go of every imported granule; the daemon releases them when the session ends."""
        with self._lock:
            ready, self._ready = list(self._ready.values()), {}
        self._discard(ready)


SPARE_MAX_BYTES = 1 << 30
"""The largest chunk the listener makes ahead on credit (:meth:`Credit.make_spare`): it holds device memory nobody maps
until the next commit of its size, within the credit the daemon already charges for."""


@dataclasses.dataclass(frozen=True)
class Spare:
    """A chunk made ahead on credit (:meth:`Mapper.make`) and its FD for the daemon (:meth:`Mapper.export`)."""

    size: int
    prepared: Any
    fd: int


class Credit:
    """The session's credit: bytes it may commit in chunks it makes itself (:class:`CreditGrant`).

    Safe to use from two threads at once. A spend and the datagram that
    tells the daemon of it are one step under one lock, and so is a return:
    the daemon reads every bind paid from the credit before the return that
    gives the rest back, in the order this process spent it.

    After a commit of one chunk the listener makes the next of the same size
    ahead (:meth:`make_spare`), so that a worker growing in steps of one size
    skips making and exporting it on its commit. The spare is kept only
    within the unspent credit: it goes before the credit is returned, and
    when a spend leaves less credit than it holds. (A commit that makes its
    own chunk while the listener makes one may, for that moment, hold one
    chunk more than its credit covers; the listener lets its own go as the
    spend shows it.)
    """

    def __init__(self, send: Callable[[Message], None], mapper: Callable[[], Mapper]) -> None:
        """``send`` sends a datagram; ``mapper`` gives the session's mapper (asked once, when the first spare is
        made)."""
        self._send = send
        self._get_mapper = mapper
        self._mapper_now: Mapper | None = None
        self._lock = threading.Lock()
        self._made = threading.Condition(self._lock)
        self.bytes = 0
        self._spare: Spare | None = None
        self._spare_wanted = 0
        """The size of the chunk to make ahead: the last commit's, where it made one chunk; 0 for none."""
        self._making = False

    def serve(self, credits: collections.deque[CreditGrant | CreditRevoke]) -> None:
        """Take what was granted and give back all when asked, in the order the handle socket filed them."""
        while True:
            try:
                msg = credits.popleft()
            except IndexError:
                break
            if isinstance(msg, CreditGrant):
                with self._lock:
                    self.bytes += max(0, msg.bytes)
            else:
                self.give_back()

    def take_spare(self, size: int) -> Spare | None:
        """The chunk made ahead, where it is of ``size`` bytes.

        The caller pays it with :meth:`spend` and lets go of it.
        """
        with self._lock:
            spare = self._spare
            if spare is None or spare.size != size:
                return None
            self._spare, self._spare_wanted = None, 0  # the next is made once this one is paid
            return spare

    def spend(self, amount: int, send: Callable[[], None], ahead: int = 0) -> bool:
        """Pay ``amount`` bytes and ``send()`` the bind they pay for; False (nothing sent) where the credit is short.
        Where ``send`` raises, nothing is paid. ``ahead``: the size of a chunk to make ahead for the next commit (0:
        none)."""
        with self._lock:
            if amount > self.bytes:
                return False
            send()
            self.bytes -= amount
            self._spare_wanted = ahead if 0 < ahead <= SPARE_MAX_BYTES else 0
            spare = self._spare
            if spare is None or spare.size <= self.bytes:
                return True
            self._spare = None
        self._let_go(spare)
        return True

    def make_spare(self) -> None:
        """On the listener thread: make the chunk :meth:`spend` asked for ahead, where the unspent credit covers it and
        none is made yet; one of another size goes. A failure is logged: the commit makes its own."""
        with self._lock:
            if self._making:
                return
            size, stale = self._spare_wanted, self._spare
            if stale is not None and stale.size != size:
                self._spare = None  # of a size the commits left behind
            else:
                stale = None
            wanted = size > 0 and self._spare is None and self.bytes >= size
            self._making = wanted
        if stale is not None:
            self._let_go(stale)
        if not wanted:
            return
        spare = None
        try:
            mapper = self._mapper()
            with mapper.beside_capture():
                prepared = mapper.make(size)
                try:
                    spare = Spare(size, prepared, mapper.export(prepared))
                except BaseException:
                    mapper.discard(prepared)
                    raise
        except Exception as exc:
            log.debug("making a %d-byte chunk ahead on credit failed (%s)", size, exc)
        finally:
            with self._lock:
                self._making = False
                self._made.notify_all()
                if spare is not None and self._spare is None and self.bytes >= size:
                    self._spare, spare = spare, None
        if spare is not None:
            self._let_go(spare)

    def _drop_spare(self) -> None:
        """Let go of the spare, once one being made is; the caller holds the lock."""
        while self._making:
            self._made.wait()
        spare, self._spare, self._spare_wanted = self._spare, None, 0
        if spare is not None:
            self._let_go(spare)

    def _mapper(self) -> Mapper:
        if self._mapper_now is None:
            self._mapper_now = self._get_mapper()
        return self._mapper_now

    def _let_go(self, spare: Spare) -> None:
        os.close(spare.fd)
        mapper = self._mapper()
        with mapper.beside_capture():
            mapper.discard(spare.prepared)

    def give_back(self) -> int:
        """Return all the credit (the daemon drops whatever it records as unspent); the bytes this process had. The
        chunk made ahead goes first: the daemon may lend its memory to another the moment it reads the return."""
        with self._lock:
            self._drop_spare()
            given, self.bytes = self.bytes, 0
            self._send(CreditReturn(given))
        return given

    def close(self) -> None:
        """Let go of the chunk made ahead; the daemon drops the credit when the session ends."""
        with self._lock:
            self._drop_spare()


def _drain(queue: collections.deque[T], serve: Callable[[T], None]) -> None:
    """``serve`` each item of ``queue`` in order; another thread draining it too takes each item off it once."""
    while True:
        try:
            item = queue.popleft()
        except IndexError:
            return
        serve(item)
