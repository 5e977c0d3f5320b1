"""Handle-plane connections that have not said hello yet: bounded per uid and in all, shared fairly, timed out.

Each such connection holds two descriptors (its socket and its peer's
pidfd) and says nothing the daemon can check yet. An honest client says
hello at once, so a connection that waits is a flood's, or a client about
to; the bound per uid kept one uid from using them up, but uids' bounds add
up, and every local user in the group can connect. So there is a bound in
all too, shared between uids as the control plane's are (``daemon/shares.py``): a
newcomer past its uid's share closes that uid's oldest, and one that finds
the bound in all reached closes the oldest of the uid holding the most. A
flood of one uid, or of several, closes only its own connections while an
honest client's hello comes through.
"""

from __future__ import annotations

from typing import Any

from ..shares import Shares
from .connection import HandleConnection

HELLO_TIMEOUT_S = 5.0
"""How long a connection has to say hello (and a control connection to finish its ZMTP greeting and READY)."""
MAX_PENDING_HELLOS_PER_UID = 64
"""Connections of one uid that have not sent their hello yet; a newer one closes the oldest."""
MAX_PENDING_HELLOS = 256
"""The same for all uids together, shared fairly; a uid may always have :data:`MIN_PENDING_HELLOS_PER_UID`, and a
newcomer past the bound in all closes the oldest of the uid holding the most."""
MIN_PENDING_HELLOS_PER_UID = 8
"""A few clients of one uid connecting at once (the workers of an engine)."""


class Hellos:
    """The connections waiting for their hello, by uid in the order they were accepted."""

    def __init__(self) -> None:
        self._by_uid: dict[int, dict[int, HandleConnection[Any, Any]]] = {}
        self._held = Shares(MAX_PENDING_HELLOS_PER_UID, MAX_PENDING_HELLOS, MIN_PENDING_HELLOS_PER_UID)

    def __len__(self) -> int:
        return self._held.in_all

    def held(self, uid: int) -> int:
        """How many connections of ``uid`` wait for their hello."""
        return self._held.held(uid)

    def to_close_for(self, uid: int) -> HandleConnection[Any, Any] | None:
        """The connection to close before one more of ``uid`` waits: its own oldest where it holds its share, else
        the oldest of the uid holding the most where the bound in all is reached; None while there is room."""
        if self._held.held(uid) >= self._held.share(uid):
            victim = uid
        elif self._held.in_all >= self._held.total:
            victim = max(self._by_uid, key=self._held.held)
        else:
            return None
        return next(iter(self._by_uid[victim].values()))

    def add(self, conn: HandleConnection[Any, Any]) -> None:
        """``conn`` was accepted and waits for its hello."""
        self._by_uid.setdefault(conn.uid, {})[conn.sock.fileno()] = conn
        self._held.add(conn.uid, 1)

    def remove(self, conn: HandleConnection[Any, Any], fd: int) -> None:
        """``conn`` (its socket ``fd``) said hello or is closed; nothing where it was not waiting."""
        waiting = self._by_uid.get(conn.uid)
        if waiting is None or waiting.pop(fd, None) is None:
            return
        self._held.add(conn.uid, -1)
        if not waiting:
            del self._by_uid[conn.uid]

    def overdue(self, now: float) -> list[HandleConnection[Any, Any]]:
        """The connections accepted more than :data:`HELLO_TIMEOUT_S` before ``now`` (monotonic)."""
        return [conn for waiting in self._by_uid.values() for conn in waiting.values()
                if now - conn.accepted_at > HELLO_TIMEOUT_S]
