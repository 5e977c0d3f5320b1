"""Changes of a buffer's chunks that hold in the daemon and in this process alike.

A growth is served from the lease (leased granules, placed with the daemon
before they are mapped; or chunks made here on credit, bound with the daemon
once mapped, before the commit returns) or through the daemon (the request,
then its delivery mapped);
a defragment goes through the daemon too. Either way a failure part way is
repaired from the daemon's record (:class:`Remap`), so this process never
maps what the daemon does not record, nor misses what it does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from hbmd.proto import MAX_OWN_CHUNKS, MAX_PLACED_SEGMENTS, TIER_HOST, BufferInfo, ChunkInfo, Redeclare
from hbmd.proto.errors import DaemonUnavailable, HbmdError, InvalidRequest, SessionLost, TensorUnusable
from hbmd.proto.runs import new_runs, prefix_offsets

from .delivery import Delivery
from .reservation import Reservation
from .session import Client

log = logging.getLogger("hbmd.client")


class Transactions:
    """The daemon's record of an :class:`~hbmd.client.tensor.ExtensibleTensor`'s buffer, and the changes of its
    chunks that keep the tensor's :class:`Reservation` in step with it.

    A part of the tensor class: the tensor sets ``_client``,
    ``_reservation``, ``_readonly``, ``_freed``, ``_recorded`` and ``_unusable``; the record
    (``_info`` and what follows from it) is set here, by :meth:`_set_info`.
    """

    _client: Client
    _reservation: Reservation
    _readonly: bool
    _freed: bool
    _recorded: bool
    _unusable: TensorUnusable | None
    _moved_to: str | None = None
    """The tier of what this process maps while a move's remap is done and its finish not heard yet: what a daemon
    that restarted meanwhile, with nothing kept, is told the buffer is in."""
    _name_proof = ""
    """The proof, from the daemon's last reply that carried one, that this session holds the buffer's name: what a
    declaration of it after a cold restart shows (:attr:`Redeclare.name_proof`)."""
    _unsettled: Callable[[], None] | None = None
    """A change of the buffer timed out (:meth:`_gave_up`): how to settle it with the daemon's record before the next
    step. The daemon may still do it (it was stalled, not gone), but none of the session's requests older than one it
    answered: the next answer settles it."""

    def _check_live(self) -> None:
        if self._freed:
            raise ValueError("this ExtensibleTensor was freed")
        if self._unusable is not None:
            raise self._unusable
        if self._unsettled is not None:
            self._settle()

    def _gave_up(self, error: BaseException, settle: Callable[[], None]) -> bool:
        """Whether ``error`` is a call of this buffer's given up on with the daemon still there (a timeout, not a
        session lost): then ``settle`` is to run before the next step, and the tensor stays as it maps now.

        Its next commit would grow from this process's record while the
        daemon's answer grows from its own, which may hold the change given
        up on: the tensor said 16 MiB with 6 of them unmapped, and a write
        there faulted (issue #61, ``tests/test_timed_out_calls.py``).
        """
        if not isinstance(error, DaemonUnavailable) or isinstance(error, SessionLost):
            return False
        self._unsettled = settle
        return True

    def _settle(self) -> None:
        """Settle the change given up on (:attr:`_unsettled`); one that times out again stays to settle, raising."""
        settle = self._unsettled
        assert settle is not None
        settle()
        self._unsettled = None

    def _map_as_recorded(self) -> None:
        """Map the buffer as the daemon records it now; raises with nothing changed where the daemon does not answer."""
        if self._map_again():
            log.warning("buffer %d: the daemon did a change this process had given up on; mapped again as it records "
                        "it", self._info.buffer_id)

    def _check_writable(self, what: str) -> None:
        """Refuse a change here rather than at the daemon: release and defragment unmap before they ask."""
        self._check_live()
        if self._readonly:
            raise ValueError(
                f"{what} needs the buffer's owner: this ExtensibleTensor is a read-only attach of a sealed buffer"
            )
        if self._info.sealed and what != "seal":
            raise InvalidRequest(
                f"buffer {self._info.buffer_id} ({self._info.name!r}) is sealed: it is immutable, {what} is refused",
                buffer_id=self._info.buffer_id,
            )

    def _set_info(self, info: BufferInfo) -> None:
        """Take the daemon's view of the buffer (a daemon of protocol 1.0 sends no per-segment lists)."""
        self._info = info
        self._name_proof = info.name_proof or self._name_proof
        self._physical_bytes = info.physical_bytes
        self._num_chunks = info.num_chunks
        self._capacities = list(info.segment_capacities) or [info.segment_capacity_bytes] * info.num_segments
        self._sizes = list(info.segment_sizes) or [info.bytes_per_segment] * info.num_segments
        self._offsets = prefix_offsets(self._capacities)

    def _grow_from_lease(self, sizes: list[int], zero: Callable[[list[int]], None] | None) -> bool:
        """Grow without a round trip, onto leased granules or in chunks made here on credit, and queue ``zero(sizes
        grown to)`` once they are mapped; False (nothing done, nothing queued) where neither covers the growth or the
        buffer has more segments than a placement carries (:data:`MAX_PLACED_SEGMENTS`).

        A leased granule or a chunk made on credit is a chunk as the daemon
        would have made it: the buffer's chunks are the same whichever way it
        grew.

        A placement goes to the daemon before the mapping, so however this
        process dies the daemon's record holds every granule mapped here; a
        mapping that fails midway is repaired as any commit's (:meth:`_resync`).
        A growth on credit binds its chunks after mapping them
        (:meth:`_make_on_credit`).
        """
        if self._info.shareable or self._info.tier == TIER_HOST or len(self._sizes) > MAX_PLACED_SEGMENTS:
            return False  # the daemon refuses a demoted buffer's growth: it says so in its answer
        runs = new_runs(self._offsets, self._sizes, sizes, self._client.granularity)
        with self._client.exclusive:  # no other thread's request on this session between the placement and the mapping
            if self._place_leased(sizes, runs):
                if zero is not None:
                    zero(self._sizes)
                return True
            return self._make_on_credit(sizes, runs, zero)

    def _place_leased(self, sizes: list[int], runs: list[tuple[int, int]]) -> bool:
        granule = self._client.granularity
        if any(end - start != granule for start, end in runs):
            # The daemon backs a run of several granules with one chunk (what defragmenting by release and
            # regrowth relies on): a lease, one chunk per granule, serves only runs of one.
            return False
        offsets = [start for start, _ in runs]
        taken = self._client.leasing.take(len(offsets))
        if taken is None:
            return False
        if not self._client.leasing.place(self._info.buffer_id, sizes, taken, offsets):
            return False
        try:
            self._reservation.map_leased(taken, offsets)
        except BaseException as exc:
            if not self._resync(exc):
                raise
            return True
        finally:
            self._client.leasing.discard(taken)
        # What the daemon now records too: the placement went before the mapping.
        self._sizes = list(sizes)
        self._physical_bytes += len(offsets) * self._client.granularity
        self._num_chunks += len(offsets)
        return True

    def _make_on_credit(self, sizes: list[int], new: list[tuple[int, int]],
                        zero: Callable[[list[int]], None] | None) -> bool:
        """Grow in chunks made here, one per run as the daemon would make them, paid from the session's credit; False
        (nothing done) where the credit is short, the growth has more than :data:`MAX_OWN_CHUNKS` runs, or making or
        mapping a chunk failed (the daemon then says why, or finds room).

        The chunks are mapped first and bound after (the bind carries their
        FDs), with their zeroing queued in between, so that the device
        zeroes while this process exports and sends. The commit returns
        only once the bind is on the daemon's socket, so the chunks are the
        daemon's, however this process dies, before anything is written to
        them.
        """
        runs = [(start, end - start) for start, end in new]
        if not runs or len(runs) > MAX_OWN_CHUNKS or not self._client.leasing.credit_covers(sum(n for _, n in runs)):
            return False
        mapper = self._reservation.mapper
        made: list[Any] = []
        fds: list[int] = []
        bound = False
        try:
            for _, size in runs:
                spare = self._client.leasing.take_spare(size)
                made.append(mapper.make(size) if spare is None else spare.prepared)
                fds.append(-1 if spare is None else spare.fd)
            self._reservation.map_made(made, runs)
            if zero is not None:
                zero(sizes)
            bound = self._client.leasing.bind(self._info.buffer_id, sizes, runs, made, fds)
        except (HbmdError, OSError) as exc:
            log.debug("buffer %d: a growth on credit failed (%s); asking the daemon", self._info.buffer_id, exc)
        finally:
            if not bound:
                self._reservation.unmap_runs(runs)
                for fd in fds:
                    if fd >= 0:
                        os.close(fd)
            for prepared in made:
                mapper.discard(prepared)
        if bound:
            self._sizes = list(sizes)
            self._physical_bytes += sum(n for _, n in runs)
            self._num_chunks += len(runs)
        return bound

    def _grow_through_daemon(self, sizes: list[int]) -> None:
        if len(set(sizes)) == 1:
            self._transaction(lambda: self._client.commit(self._info.buffer_id, sizes[0]))
        else:
            self._transaction(lambda: self._client.commit_segments(self._info.buffer_id, sizes))

    def _map_all(self, delivery: Delivery) -> None:
        self._reservation.map_all(delivery, self._maps_readonly)

    @property
    def _maps_readonly(self) -> bool:
        # A sealed buffer is mapped read-only everywhere, in its owner's process too.
        return self._readonly or self._info.sealed

    def _transaction(self, request: Callable[[], Delivery], before: Callable[[], None] | None = None) -> None:
        """Run a request that maps chunks so that it completes, or leaves the tensor as the daemon records it.

        ``request()`` sends it and returns its :class:`Delivery`. A refusal
        that came before anything was mapped or unmapped changes nothing.
        Any other failure (a map that failed midway, a refusal after
        ``before`` unmapped) is repaired by mapping every chunk the daemon
        records again (:class:`Remap`): if the daemon had done the request,
        it is then complete here too and returns; otherwise the error is
        raised with the tensor as before. When the repair fails as well,
        :class:`TensorUnusable`.
        """
        answered = False
        changes_before = self._reservation.changes
        try:
            if before is not None:
                before()
            with request() as delivery:
                answered = True
                self._map_all(delivery)
        except BaseException as exc:
            if not answered and self._reservation.changes == changes_before:
                self._gave_up(exc, self._map_as_recorded)
                raise
            if not self._resync(exc):
                raise
            return
        self._set_info(delivery.reply.buffer)

    def _resync(self, error: BaseException) -> bool:
        """Map the buffer as the daemon records it; True when the failed request had been done there."""
        if self._unusable is not None:
            raise self._unusable from error  # the daemon refused to count it again after a restart: nothing to map
        changes_before = self._reservation.changes
        try:
            done = self._map_again()
        except BaseException as exc:
            # The daemon did not answer the remap, and what is mapped still holds every byte the tensor says it has
            # (a map that failed midway maps more): the next step tries again.
            covered = sum(size for _, size in self._reservation.mapped) >= self._physical_bytes
            if self._reservation.changes == changes_before and covered and self._gave_up(exc, self._map_as_recorded):
                raise
            self._unusable = TensorUnusable(
                f"buffer {self._info.buffer_id}: {error} and mapping it again failed ({exc}); "
                "free it and create or attach it anew",
                buffer_id=self._info.buffer_id,
            )
            raise self._unusable from error
        if done:
            log.warning(
                "buffer %d: %s while mapping; mapped again as the daemon records it", self._info.buffer_id, error
            )
        return done and isinstance(error, (HbmdError, OSError))

    def _map_again(self) -> bool:
        """Unmap the buffer and map every chunk the daemon records, once they have come (so a daemon that does not
        answer leaves the mapping as it was); whether its record differs from this process's."""
        with self._client.remap(self._info.buffer_id) as delivery:
            self._reservation.unmap_all()
            self._map_all(delivery)
        reply = delivery.reply
        done = reply.buffer.segment_sizes != self._sizes or reply.buffer.num_chunks != self._num_chunks
        self._set_info(reply.buffer)
        return done

    # after a restart of the daemon that kept nothing

    def _declaration(self) -> Redeclare | None:
        """The buffer as this process maps it, to declare on the session started over; None once freed."""
        if self._freed:
            return None
        mapped = self._reservation.mapped
        return Redeclare(
            capacity=self._info.capacity_bytes,
            segment_capacities=list(self._capacities),
            # Released by a request the old daemon took with it: nothing mapped, nothing committed.
            segment_sizes=list(self._sizes) if mapped else [0] * len(self._capacities),
            chunks=[ChunkInfo(0, offset, size) for offset, size in mapped],
            buffer_id=self._info.buffer_id,
            name=self._info.name,
            persistent=self._info.persistent,
            shareable=self._info.shareable,
            sealed=self._info.sealed,
            readonly=self._readonly,
            tier=self._moved_to or self._info.tier,
            name_proof=self._name_proof,
        )

    def _declared(self, buffer: BufferInfo | None, refusal: HbmdError | None) -> None:
        """The new daemon counts the buffer again (``buffer``, under its id where that was free), or refused to
        (``refusal``): memory no daemon counts is not kept, so the pages go at once, as a ``release_physical()``'s
        do (the address range stays reserved while views of it remain), and the tensor goes no further."""
        if buffer is not None:
            self._set_info(buffer)
            return
        self._recorded = False
        self._reservation.unmap_all()
        self._unusable = TensorUnusable(
            f"buffer {self._info.buffer_id}: hbmd restarted with nothing to keep its memory and refused to count it "
            f"again ({refusal}); its pages are gone: free it and create or attach it anew",
            buffer_id=self._info.buffer_id,
        )
