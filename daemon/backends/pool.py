"""The host pool: host-tier chunks made ahead of demotes, while the daemon is idle.

Pinned host memory is slow to make (a GiB of host-NUMA memory took 217-278 ms
on the H200, SPEC "host-NUMA VMM memory"): a demote that made its chunks
then would wait on that, not on its copy. So each backend keeps pieces of
:data:`HOST_PIECE` bytes made ahead of need, and a demote is cut into such
pieces (``Chunks.make_runs``). The pool lives inside the host budget: it is
filled only into the room the demoted buffers leave, and a piece is given
back once that room shrinks below it. A piece is used once: a chunk that a
client mapped goes back to the system, never to the pool, since a copy of
its FD kept by that client would reach whoever got it next.
"""

from __future__ import annotations

from typing import Callable, Generic

from . import C

HOST_PIECE = 256 << 20
"""Bytes of one pooled piece: a 64 GiB demote maps 256 of them, and a run's last, shorter piece is made on demand
(at most 255 MiB, ~60 ms on the H200)."""


class HostPool(Generic[C]):
    """Host-tier pieces of ``piece`` bytes made ahead, up to ``target`` bytes."""

    def __init__(self, piece: int, target: int, make: Callable[[int], C], release: Callable[[C], None]) -> None:
        self.piece = piece
        self.target = target
        self._make = make
        self._release = release
        self._pieces: list[C] = []

    @property
    def bytes(self) -> int:
        return len(self._pieces) * self.piece

    def take(self, size: int) -> C:
        """A chunk of ``size`` host-tier bytes: a pooled piece where it is one, else made now."""
        if size == self.piece and self._pieces:
            return self._pieces.pop()
        return self._make(size)

    def idle(self, room: int) -> bool:
        """Make one piece where the pool is short of its target and ``room`` holds it, or give one back where the pool
        no longer fits ``room``; True while there is more to do."""
        if self.bytes > room:
            self._release(self._pieces.pop())
            return self.bytes > room
        if self.bytes + self.piece > min(self.target, room):
            return False
        self._pieces.append(self._make(self.piece))
        return self.bytes + self.piece <= min(self.target, room)

    def close(self) -> None:
        while self._pieces:
            self._release(self._pieces.pop())
