"""The host pool: host-tier chunks made ahead of demotes, by a thread of its own.

Pinned host memory is slow to make (a GiB of host-NUMA memory took 217-278 ms
on the H200, SPEC "host-NUMA VMM memory"): a demote that made its chunks
then would wait on that, not on its copy. So each backend keeps pieces of
:data:`HOST_PIECE` bytes made ahead of need, and a demote is cut into such
pieces (``Chunks.make_runs``). The pool lives inside the host budget: it is
filled only into the room the demoted buffers leave, and a piece is given
back once that room shrinks below it. A piece is used once: a chunk that a
client mapped goes back to the system, never to the pool, since a copy of
its FD kept by that client would reach whoever got it next.

Making and giving back pieces happens on the pool's thread, never in the
daemon's loop: a piece takes tens of milliseconds, and a request that came
while the loop made one would wait that long (a demote's finish did, which
held moves to a fifth of the copy's speed). The loop tells the thread the
room after every turn; between two turns the thread may make one piece more
than a room that just shrank holds, and gives it back at the next.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Generic

from hbmd.proto.errors import HbmdError

from . import C

log = logging.getLogger("hbmd.pool")

HOST_PIECE = 256 << 20
"""Bytes of one pooled piece: a 64 GiB demote maps 256 of them, and a run's last, shorter piece is made on demand
(at most 255 MiB, ~60 ms on the H200)."""

RETRY_S = 1.0
"""How long the thread waits after a piece could not be made (memory, descriptors) before it tries again."""


class HostPool(Generic[C]):
    """Host-tier pieces of ``piece`` bytes made ahead, up to ``target`` bytes, by a thread started at the first
    :meth:`idle`."""

    def __init__(self, piece: int, target: int, make: Callable[[int], C], release: Callable[[C], None]) -> None:
        self.piece = piece
        self.target = target
        self._make = make
        self._release = release
        self._pieces: list[C] = []
        self._room = 0
        self._closing = False
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def bytes(self) -> int:
        with self._changed:
            return len(self._pieces) * self.piece

    def take(self, size: int) -> C:
        """A chunk of ``size`` host-tier bytes: a pooled piece where it is one, else made now."""
        if size == self.piece:
            with self._changed:
                if self._pieces:
                    self._changed.notify()
                    return self._pieces.pop()
        return self._make(size)

    def idle(self, room: int) -> bool:
        """Tell the pool's thread the room the host tier leaves, for it to fill or trim the pool to; always False:
        nothing is left for the caller's loop to do."""
        if not self.target:
            return False
        with self._changed:
            if self._closing:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hbmd-host-pool", daemon=True)
                self._thread.start()
            if room != self._room:
                self._room = room
                self._changed.notify()
        return False

    def _next(self) -> C | None:
        """Wait until the pool is short of its room (None: make a piece) or over it (a piece to give back)."""
        with self._changed:
            while not self._closing:
                held = len(self._pieces) * self.piece
                if held > self._room:
                    return self._pieces.pop()
                if held + self.piece <= min(self.target, self._room):
                    return None
                self._changed.wait()
            raise _Closing

    def _run(self) -> None:
        while True:
            try:
                surplus = self._next()
            except _Closing:
                return
            if surplus is not None:
                self._release(surplus)
                continue
            try:
                made = self._make(self.piece)
            except (HbmdError, OSError) as exc:
                # Out of memory or descriptors: demotes still make their chunks themselves.
                log.debug("host pool paused: %s", exc)
                with self._changed:
                    self._changed.wait(RETRY_S)
                continue
            with self._changed:
                self._pieces.append(made)

    def close(self) -> None:
        """Stop the thread (after the piece it is making) and give every piece back."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        while self._pieces:
            self._release(self._pieces.pop())


class _Closing(Exception):
    """The pool is closing: its thread ends."""
