"""Resume credentials: what a session's process holds to take the session back after a restart, or, where the new
daemon kept nothing of it, to start it over.

A daemon that kept nothing (a cold restart) cannot look a credential up,
yet only a process that held a session may declare again what it maps
(SECURITY.md, "Declaring again after a cold restart"). So a credential
carries its own proof: the run of the daemon that issued it, a nonce, and a
MAC of both with the uid and the session id under the instance's key, which
lives in the instance directory (``rundir.resume_key``) and outlasts the
daemon. A pid could not stand in for it: a daemon in its own pid namespace
sees every peer as pid 0.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets

KEY_BYTES = 32
RUN_HEX = 16
NONCE_HEX = 32
MAC_HEX = 32
CREDENTIAL_HEX = RUN_HEX + NONCE_HEX + MAC_HEX
MAX_STARTED_OVER = 4096
"""Credentials remembered as spent on a start-over; the oldest are forgotten first (only their holders have them)."""


class Credentials:
    """Issues the credentials of this run of the daemon and checks those of earlier runs."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.run = secrets.token_hex(RUN_HEX // 2)
        """This run of the daemon, which its credentials name: ids start at 1 again after a cold restart, so a session
        id alone does not say whether the session is one this run knows."""
        self._spent: collections.OrderedDict[str, None] = collections.OrderedDict()

    def use_key(self, key: bytes) -> None:
        """Issue and check credentials under ``key`` from now on; the run stays this one (a daemon that binds again,
        its successor having failed, still knows its sessions)."""
        self._key = key

    def issue(self, uid: int, session_id: int) -> str:
        """A new credential for session ``session_id`` of ``uid``."""
        nonce = secrets.token_hex(NONCE_HEX // 2)
        return self.run + nonce + self._mac(self.run, nonce, uid, session_id)

    def issued_here(self, credential: str) -> bool:
        """Whether this run of the daemon issued ``credential`` (if anyone did)."""
        return credential[:RUN_HEX] == self.run

    def start_over(self, uid: int, session_id: int, credential: str) -> bool:
        """Whether ``credential`` lets a process of ``uid`` start session ``session_id`` over: one a daemon of this
        instance issued to that session, not :meth:`spent <spend>` on a start-over already."""
        if len(credential) != CREDENTIAL_HEX or not all(c in "0123456789abcdef" for c in credential):
            return False
        run, nonce, mac = credential[:RUN_HEX], credential[RUN_HEX:-MAC_HEX], credential[-MAC_HEX:]
        if credential in self._spent:
            return False
        return hmac.compare_digest(mac, self._mac(run, nonce, uid, session_id))

    def spend(self, credential: str) -> None:
        """A session was started over on ``credential``: it starts no other."""
        while len(self._spent) >= MAX_STARTED_OVER:
            self._spent.popitem(last=False)
        self._spent[credential] = None

    def _mac(self, run: str, nonce: str, uid: int, session_id: int) -> str:
        message = f"{run}:{nonce}:{uid}:{session_id}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:MAC_HEX]
