"""Re-backing a tensor's buffer with other chunks at the same addresses: defragment, demote, promote and graft.

The daemon brings the new chunks; the data is copied into them and they are
mapped in place of the old ones, and only then is the daemon told to drop
the old ones (:class:`~hbmd.proto.FinishDefragment`), so a worker killed
mid-way loses nothing. A graft brings another buffer's chunks, data and
all, into a tensor with none: nothing to copy. Views, ``base_ptr`` and CUDA
graphs captured over the buffer stay valid throughout.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from hbmd.proto import TIER_DEVICE, TIER_HOST, ChunkInfo
from hbmd.proto.errors import InvalidRequest
from hbmd.proto.undo import Undo

from .delivery import Delivery
from .transaction import Transactions


class Moves(Transactions):
    """A part of the tensor class (see :class:`Transactions`): the moves of its bytes between chunks."""

    _sizes_before_release: list[int] | None

    def defragment(self, preserve: bool = True) -> Moves:
        """Re-back each segment's committed prefix with one chunk, at the same addresses.

        ``preserve``: each new chunk is mapped at a temporary address, the data
        copied into it, then mapped in place of the old chunks; the daemon
        drops the old chunks only once told the remap is done, so a worker
        killed mid-way loses nothing (this needs budget for both at once).
        Otherwise the old chunks go first and the contents are undefined:
        what an engine does right after warm-up, before RDMA registration.
        """
        self._check_writable("defragment")
        if not preserve:
            # The old chunks are unmapped before the daemon drops them; a refusal maps them back.
            self._transaction(
                lambda: self._client.defragment(self._info.buffer_id, False), before=self._reservation.unmap_all
            )
            return self
        self._reback(lambda: self._client.defragment(self._info.buffer_id, True))
        return self

    def demote(self) -> Moves:
        """Move the committed bytes to the daemon's host tier, at the same addresses; the device pages go back at once.

        Views, ``base_ptr`` and CUDA graphs captured over the buffer stay
        valid (kernels then read host memory over the bus); the data is
        copied as :meth:`defragment` copies it, so a worker killed midway
        loses nothing. Growing or defragmenting a demoted buffer is refused
        (``Conflict``) until :meth:`promote`. Already there, or with nothing
        committed: a no-op. Raises ``OutOfBudget`` where the host budget is
        short or the daemon has no host tier (``hbmd --host-budget``),
        ``InvalidRequest`` for a sealed buffer (its readers map it too).
        """
        self._check_writable("demote")
        self._reback(lambda: self._client.move(self._info.buffer_id, TIER_HOST), TIER_HOST)
        return self

    def promote(self) -> Moves:
        """Move a demoted buffer's bytes back to device memory, at the same addresses (see :meth:`demote`).

        Raises ``OutOfBudget`` where the device budget cannot hold them now
        (the buffer stays in the host tier, whole); a no-op on the device.
        """
        self._check_writable("promote")
        self._reback(lambda: self._client.move(self._info.buffer_id, TIER_DEVICE), TIER_DEVICE)
        return self

    def graft(self, name: str) -> Moves:
        """Take the memory of this user's orphaned persistent buffer ``name``, data and all, into this tensor, each
        chunk at the same offset of its segment and without a copy; its segments' committed sizes become the
        orphan's.

        How a restarted engine adopts the KV cache its predecessor left: it
        makes its own tensor of as many segments first (the address its CUDA
        graphs capture), lets go of every page (:meth:`release_physical`),
        then grafts. ``base_ptr``, views and captured graphs stay valid. The
        orphan's record and name are gone afterwards; its bytes are charged to
        this session's tenant, and the tensor grows on as any other.

        Raises, with this tensor as it was: ``InvalidRequest`` where the
        layouts differ (the number of segments, ``shareable``; where segment
        capacities differ, an orphan's chunk that would not fit its segment
        here, or segments not on granules), this
        tensor has bytes committed or is sealed, or the orphan is sealed,
        demoted or mid-defragment; ``NotFound`` for no orphan ``name`` of this
        user; ``Conflict`` while a live session holds it; ``OutOfBudget``
        past this session's tenant's maximum; ``VersionMismatch`` from a
        daemon older than protocol 1.11. A mapping that fails midway is
        repaired from the daemon's record, as a commit's is.
        """
        self._check_writable("graft")
        self._transaction(lambda: self._client.graft(self._info.buffer_id, name))
        self._sizes_before_release = None  # the orphan's sizes are the ones to come back to now
        return self

    _demoted_under_pressure = False
    """Demoted by the client for the daemon, not by the engine: promoted back by the client once there is room."""

    _idle = False

    def set_idle(self, idle: bool = True) -> Moves:
        """Say whether the engine leaves this buffer alone, so that its client may move it for the daemon.

        Under pressure the daemon asks the clients of a ``demote =`` tenant for
        room (README, "Demotion instead of refusal"); a client moves only the
        buffers its engine declared idle: no thread reads or writes them and no
        kernel that does is queued (declaring waits for the device). A move
        under a writer would lose what it writes during the copy, and on a GPU
        the remap would leave its kernels an unmapped address.

        ``set_idle(False)`` takes the buffer back before the engine touches it
        again: one demoted meanwhile is promoted first, and where the device
        has no room yet that raises ``OutOfBudget`` with the buffer still idle
        in the host tier (its bytes intact; try again later).
        """
        if idle:
            self._client.mapper.synchronize()
            self._idle = True
            return self
        with self._client.exclusive:  # the listener moves buffers under this lock: no move is half done here
            if self._demoted_under_pressure and self._info.tier == TIER_HOST and not self._freed:
                self.promote()
            self._demoted_under_pressure = False
            self._idle = False
        return self

    @property
    def idle(self) -> bool:
        """Whether the engine declared this buffer idle (:meth:`set_idle`)."""
        return self._idle

    def _demote_under_pressure(self) -> int:
        """Demote this buffer where its owner may (the client serving the daemon's request); returns the bytes."""
        if (
            not self._idle
            or self._freed
            or self._readonly
            or self._info.sealed
            or self._info.tier == TIER_HOST
            or self._unusable is not None
        ):
            return 0
        physical = self._physical_bytes
        self.demote()
        self._demoted_under_pressure = self._info.tier == TIER_HOST
        return physical if self._demoted_under_pressure else 0

    def _promote_after_pressure(self) -> int:
        """Promote this buffer back if the client demoted it for the daemon and it is still there; returns the bytes."""
        if (
            not self._demoted_under_pressure
            or self._freed
            or self._unusable is not None
            or self._info.tier != TIER_HOST
        ):
            self._demoted_under_pressure = False
            return 0
        self.promote()
        self._demoted_under_pressure = False
        return self._physical_bytes

    def _reback(self, ask: Callable[[], Delivery], to_tier: str | None = None) -> None:
        """Re-back the buffer with the chunks ``ask`` brings (a preserving defragment's, or a move's to ``to_tier``):
        copied into, then mapped in place of the old ones (to the host tier: mapped in place, then copied into, since
        host-tier chunks are slow to map). None brought: nothing to do."""
        fresh: list[tuple[ChunkInfo, int]] = []
        started_over = self._client.started_over
        try:
            try:
                delivering = ask()
            except BaseException as exc:
                self._gave_up(exc, self._drop_pending)
                raise
            with delivering as delivery:
                for chunk, fd in delivery:
                    fresh.append((chunk, os.dup(fd)))  # mapped once every new chunk is in
            if fresh:
                self._move_into(fresh, started_over, to_tier)
        finally:
            _close_all(fresh)

    def _drop_pending(self) -> None:
        """Have the daemon drop the new chunks of a defragment or move given up on, where it made them: this process
        maps the old ones. Where it did not, it never will now (the session has spoken since)."""
        try:
            self._set_info(self._client.finish_defragment(self._info.buffer_id, False).buffer)
        except InvalidRequest:
            pass  # nothing in progress

    def _move_into(self, fresh: list[tuple[ChunkInfo, int]], started_over: int, to_tier: str | None) -> None:
        """Copy the data into the new chunks, map them in place of the old, and confirm.

        The FDs are closed before the daemon hears the outcome: once it has,
        its host pool may pin memory again, which holds up the driver's
        closing of an FD in every process.
        """
        with Undo() as undo:
            # Until the data is copied, the way back is the daemon's: it drops the new chunks and keeps the old.
            undo.push(self._finish_defragment, False, started_over)
            undo.push(_close_all, fresh)
            map_once = to_tier == TIER_HOST
            if map_once:
                self._reservation.move_into(fresh)  # mapped in place already
            else:
                self._reservation.copy_into(fresh)
        # From here the new chunks hold the data: the daemon keeps them whatever happens next.
        try:
            if not map_once:
                self._reservation.unmap_all()
                for chunk, fd in fresh:
                    self._reservation.map(chunk, fd, self._maps_readonly)
            self._moved_to = to_tier
        finally:
            _close_all(fresh)
            try:
                self._finish_defragment(True, started_over)
            finally:
                self._moved_to = None

    def _finish_defragment(self, keep_new: bool, started_over: int) -> None:
        """Tell the daemon which chunks back the buffer now. Where the session started over meanwhile (its daemon
        restarted with nothing kept), the defragment went with the old daemon and the buffer was declared again as
        it is mapped here: there is nothing left to tell."""
        try:
            self._set_info(self._client.finish_defragment(self._info.buffer_id, keep_new).buffer)
        except InvalidRequest:
            if self._client.started_over == started_over:
                raise


def _close_all(fds: list[tuple[ChunkInfo, int]]) -> None:
    """Close each chunk's FD and empty the list (closing twice is a no-op)."""
    while fds:
        os.close(fds.pop()[1])
