"""The host pool: host-tier chunks made ahead of demotes, and given back after promotes, by a thread of its own.

Pinned host memory is slow to make and to give back (SPEC.md, "host-NUMA
VMM memory"): a demote that made its chunks then would wait on
that, not on its copy, and so would a promote's finish that released them.
So each backend keeps pieces of :data:`HOST_PIECE` bytes made ahead of need
(a demote is cut into such pieces, ``Chunks.make_runs``), and the host-tier
chunks a promote or a free lets go of are released later (past the pool's
size of them, at once). The pool lives
inside the host budget: it is filled only into the room the demoted buffers
leave, and a piece is given back once that room shrinks below it. A piece
is used once: a chunk that a client mapped goes back to the system, never
to the pool, since a copy of its FD kept by that client would reach whoever
got it next.

All of that runs on the pool's thread, never in the daemon's loop, and only
while no move is in flight: pinning memory holds up the driver's other calls
in every process (an 8 GiB demote's exports waited 1.5 s behind the pieces
being made beside them on the H200), and a request that came while the loop
made a piece waited for it whole. The loop tells the thread the room and
whether a move is in flight after each quiet turn; the thread starts
:data:`QUIET_S` after the last move, may make one piece more than a room
that shrank since, and gives it back at the next.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic

from hbmd.proto.errors import HbmdError

from ..clock import Clock
from . import C

log = logging.getLogger("hbmd.pool")

HOST_PIECE = 256 << 20
"""Bytes of one pooled piece: a 64 GiB demote maps 256 of them, and a run's last, shorter piece is made on demand
(at most 255 MiB)."""

QUIET_S = 2.0
"""How long after the last move the thread waits before it works: an engine going to sleep moves its buffers one after
another, and each would find the pool pinning memory beside it."""

RETRY_S = 1.0
"""How long the thread waits after a piece could not be made (memory, descriptors) before it tries again."""


class HostPool(Generic[C]):
    """Host-tier pieces of ``piece`` bytes made ahead, up to ``target`` bytes, and host-tier chunks released late, by
    a thread started at the first :meth:`idle`."""

    def __init__(self, piece: int, target: int, make: Callable[[int], C], release: Callable[[C], None],
                 quiet_s: float = QUIET_S, retry_s: float = RETRY_S, clock: Clock | None = None) -> None:
        """``quiet_s``, ``retry_s``: see :data:`QUIET_S` and :data:`RETRY_S` (a test's are short); ``clock``: the
        daemon's, whose monotonic time the quiet after a move is kept by (the system's where None)."""
        self.clock = clock or Clock()
        self.piece = piece
        self.quiet_s = quiet_s
        self.retry_s = retry_s
        self.target = target
        self._make = make
        self._release = release
        self._pieces: list[C] = []
        self._unwanted: list[tuple[C, int]] = []
        """Chunks to release: their bytes have left the budget already."""
        self._unwanted_bytes = 0
        self._room = 0
        self._moving = False
        self._moved_at = -quiet_s
        """When the thread was last told of a move in flight (:attr:`clock`'s monotonic time)."""
        self._closing = False
        self._settled = False
        """The thread waits for a change with nothing to do: :attr:`settled`."""
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def bytes(self) -> int:
        with self._changed:
            return len(self._pieces) * self.piece

    @property
    def settled(self) -> bool:
        """Whether the thread has done all it was told and waits for the next :meth:`idle` or :meth:`give_back`:
        what the pool holds stays as it is until then (a move in flight holds it so, however long)."""
        with self._changed:
            return self._settled

    def take(self, size: int) -> C:
        """A chunk of ``size`` host-tier bytes: a pooled piece where it is one, else made now."""
        if size == self.piece:
            with self._changed:
                if self._pieces:
                    return self._pieces.pop()
        return self._make(size)

    def give_back(self, chunk: C, size: int) -> None:
        """Release a host-tier chunk of ``size`` bytes on the thread (the caller's budget counts it gone already), at
        once where there is none."""
        with self._changed:
            if self._thread is not None and not self._closing:
                self._unwanted.append((chunk, size))
                self._unwanted_bytes += size
                self._settled = False
                self._changed.notify()
                return
        self._release(chunk)

    def idle(self, room: int, moving: bool) -> None:
        """Tell the thread the room the host tier leaves, to fill or trim the pool to, and whether a move is in flight
        (it then waits)."""
        with self._changed:
            if self._closing:
                return
            if self._thread is None:
                if not self.target:
                    return
                self._thread = threading.Thread(target=self._run, name="hbmd-host-pool", daemon=True)
                self._thread.start()
            if moving:
                self._moved_at = self.clock.monotonic()
            if (room, moving) != (self._room, self._moving):
                self._room, self._moving = room, moving
                self._settled = False
                self._changed.notify()

    def _next(self) -> C | None:
        """Wait for work while no move is in flight or just ended: a chunk to release, or None for a piece to make.
        Where more than ``target`` bytes wait to be released, one goes at once, move or not: moves one after another
        would otherwise keep ever more memory pinned past the host budget."""
        with self._changed:
            while not self._closing:
                self._settled = False
                if self._unwanted_bytes > self.target:
                    return self._pop_unwanted()
                quiet_in = self._moved_at + self.quiet_s - self.clock.monotonic()
                if quiet_in > 0 or self._moving:
                    self._settled = quiet_in <= 0  # a move in flight: nothing until the next idle()
                    self._changed.wait(quiet_in if quiet_in > 0 else None)
                    continue
                if self._unwanted:
                    return self._pop_unwanted()
                held = len(self._pieces) * self.piece
                if held > self._room:
                    return self._pieces.pop()
                if held + self.piece <= min(self.target, self._room):
                    return None
                self._settled = True
                self._changed.wait()
            raise _Closing

    def _pop_unwanted(self) -> C:
        chunk, size = self._unwanted.pop()
        self._unwanted_bytes -= size
        return chunk

    def _run(self) -> None:
        while True:
            try:
                unwanted = self._next()
            except _Closing:
                return
            if unwanted is not None:
                self._release(unwanted)
                continue
            try:
                made = self._make(self.piece)
            except (HbmdError, OSError) as exc:
                # Out of memory or descriptors: demotes still make their chunks themselves.
                log.debug("host pool paused: %s", exc)
                with self._changed:
                    self._changed.wait(self.retry_s)
                continue
            with self._changed:
                self._pieces.append(made)

    def close(self) -> None:
        """Stop the thread (after the chunk it is making or releasing) and release every chunk it held."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        for chunk in [chunk for chunk, _ in self._unwanted] + self._pieces:
            self._release(chunk)
        self._unwanted, self._pieces, self._unwanted_bytes = [], [], 0


class _Closing(Exception):
    """The pool is closing: its thread ends."""
