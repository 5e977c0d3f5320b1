"""Resume credentials: what a session's process holds to take the session back after a restart, or, where the new
daemon kept nothing of it, to start it over.

A daemon that kept nothing (a cold restart) cannot look a credential up,
yet only a process that held a session may declare again what it maps
(SECURITY.md, "Declaring again after a cold restart"). So a credential
carries its own proof: the line of daemons that issued it, a nonce, and a
MAC of both with the uid, the session id and the pid the daemon saw under
the instance's key, which lives in the instance directory
(``rundir.resume_key``) and outlasts the daemon.

A *line* is the daemons that kept one state: made at a cold start, it goes
on through every restart that restores the journal and every takeover. A
daemon of the line that issued a credential knows every session of it, or
ended it: such a credential resumes its session, and starts none over (a
session ended while its process was stopped started over into memory the
daemon had freed or given to another, issue #61), except one the daemon
lost restoring a damaged journal. A credential of the line before the last
cold start (the instance directory says which, ``rundir.last_line``) starts
its session over once: the starts over are journaled, so neither a restart
that kept the state nor another cold start lets it start one again; the
line before that is gone for good. The pid binds it to its process where the
daemon sees one: another process of the uid that read it is refused (a
daemon in a pid namespace of its own sees pid 0 for every peer, and there
the credential alone tells them apart).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import json
import secrets
from typing import Any

KEY_BYTES = 32
LINE_HEX = 16
NONCE_HEX = 32
MAC_HEX = 32
CREDENTIAL_HEX = LINE_HEX + NONCE_HEX + MAC_HEX
MAX_STARTED_OVER = 4096
"""Starts over remembered, the oldest forgotten first: as many sessions as a line may have had, with room to spare
(a uid has 128 at most)."""
MAX_LOST = 4096
"""Sessions of its own line a daemon lost restoring its journal and lets start over, the oldest forgotten first."""


class Credentials:
    """Issues the credentials of this line of daemons and checks those of the line before."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.line = secrets.token_hex(LINE_HEX // 2)
        """This line of daemons, which its credentials name: ids start at 1 again after a cold restart, so a session
        id alone does not say whether the session is one this line knows."""
        self.previous = ""
        """The line before the last cold start, whose credentials may start their sessions over; empty where the
        instance directory did not say (a daemon older than this one ran before): any other line's then."""
        self.kept = False
        """The line was taken from a journal or a daemon taken over (:meth:`restored`), not made at this start."""
        self._named = False
        self._started_over: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self._lost: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.changed = False
        """What :meth:`record` says has changed since it was last journaled."""

    def use_key(self, key: bytes, last_line: str = "") -> None:
        """Issue and check credentials under ``key`` from now on. ``last_line``: the line of the daemon that ran
        before this one (the instance directory's), the line before a cold start, whose credentials start over; the
        first call decides it, the line stays this one (a daemon that binds again, its successor having failed,
        still knows its sessions)."""
        self._key = key
        if not self._named:
            self._named = True
            if not self.kept and last_line != self.line:
                self.previous = last_line
                self.changed = True

    def issue(self, uid: int, session_id: int, pid: int) -> str:
        """A new credential for session ``session_id`` of ``uid``, whose process the daemon sees as ``pid``."""
        nonce = secrets.token_hex(NONCE_HEX // 2)
        return self.line + nonce + self._mac(self.line, nonce, uid, session_id, pid)

    def start_over(self, uid: int, session_id: int, pid: int, credential: str) -> bool:
        """Whether ``credential`` lets the process ``pid`` of ``uid`` start session ``session_id`` over: one issued to
        that session and process by the line before the last cold start (or a session of this line its journal lost),
        not spent on a start-over already."""
        if len(credential) != CREDENTIAL_HEX or not all(c in "0123456789abcdef" for c in credential):
            return False
        line, nonce, mac = credential[:LINE_HEX], credential[LINE_HEX:-MAC_HEX], credential[-MAC_HEX:]
        if (line, session_id) in self._started_over:
            return False
        if not hmac.compare_digest(mac, self._mac(line, nonce, uid, session_id, pid)):
            return False
        if line == self.line:
            return session_id in self._lost
        return not self.previous or line == self.previous

    def spend(self, session_id: int, credential: str) -> None:
        """Session ``session_id`` was started over on ``credential``: it starts over no more, in this line."""
        while len(self._started_over) >= MAX_STARTED_OVER:
            self._started_over.popitem(last=False)
        self._started_over[credential[:LINE_HEX], session_id] = None
        self._lost.pop(session_id, None)
        self.changed = True

    def lost(self, session_id: int) -> None:
        """A session of this line that a restore lost: its client starts it over and declares what it maps."""
        while len(self._lost) >= MAX_LOST:
            self._lost.popitem(last=False)
        self._lost[session_id] = None
        self.changed = True

    def record(self) -> dict[str, Any]:
        """What the journal keeps of the credentials (its ``meta``), which :meth:`restored` takes back."""
        self.changed = False
        return {"line": self.line, "previous_line": self.previous,
                "started_over": [[line, session_id] for line, session_id in self._started_over],
                "lost_sessions": list(self._lost)}

    def restored(self, meta: dict[str, Any]) -> None:
        """Go on with the line of a journal or a daemon taken over (its ``meta``, as :meth:`record` wrote it); a meta
        that does not say (an older daemon's) leaves this line a new one."""
        line, previous = meta.get("line"), meta.get("previous_line", "")
        if not (_is_line(line) and (previous == "" or _is_line(previous))):
            return
        self.line, self.previous, self.kept = str(line), str(previous), True
        for entry in meta.get("started_over", ())[-MAX_STARTED_OVER:]:
            if isinstance(entry, list) and len(entry) == 2 and _is_line(entry[0]) and type(entry[1]) is int:
                self._started_over[entry[0], entry[1]] = None
        for session_id in meta.get("lost_sessions", ())[-MAX_LOST:]:
            if type(session_id) is int:
                self._lost[session_id] = None

    def name_proof(self, uid: int, session_id: int, pid: int, name: str) -> str:
        """The proof that session ``session_id`` of ``uid``, whose process the daemon sees as ``pid``, holds the
        persistent buffer ``name``: for it to declare the buffer again under that name after a cold restart."""
        return self.line + self._mac(self.line, "name", uid, session_id, pid, name)

    def proves_name(self, replaced: tuple[str, int], uid: int, pid: int, name: str, proof: str) -> bool:
        """Whether ``proof`` shows that the session a start-over replaced (``replaced``: its line and id) held
        ``name``, its process ``pid`` of ``uid``."""
        line, session_id = replaced
        if len(proof) != LINE_HEX + MAC_HEX or proof[:LINE_HEX] != line or not line:
            return False
        return hmac.compare_digest(proof[LINE_HEX:], self._mac(line, "name", uid, session_id, pid, name))

    def _mac(self, line: str, nonce: str, uid: int, session_id: int, pid: int, name: str = "") -> str:
        # A name is JSON-quoted: whatever it holds, it cannot pass for the fields before it.
        message = f"{line}:{nonce}:{uid}:{session_id}:{pid}{':' + json.dumps(name) if name else ''}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()[:MAC_HEX]


def _is_line(value: Any) -> bool:
    return isinstance(value, str) and len(value) == LINE_HEX and all(c in "0123456789abcdef" for c in value)
