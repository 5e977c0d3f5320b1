"""Pressure: what a commit that met a limit asks of the other sessions, and when demoted buffers may come back.

Nothing is taken by force. The budget refusing a commit asks every other
session for its unplaced granules (leases); a tenant refused may have idle
sessions of demotable tenants asked to demote buffers to the host tier; a
guaranteed tenant the device is short for has sessions of tenants above
their guarantee asked for memory back (reclaim). Each ask goes through the
session's client, with the reclaim patience as its deadline.
"""

from __future__ import annotations

from typing import Generic

from ..backends import A, C
from ..clock import Clock
from .leases import Leases
from .records import Reclaim, Session, Tenant
from .sessions import Sessions
from .tenants import Tenants

DEMOTE_IDLE_S = 2.0
"""By default (``--demote-idle``), a session that grew a buffer within this many seconds is busy: it is not asked to
demote its buffers."""
PROMOTE_ASK_EVERY_S = 1.0
"""How often a client that demoted buffers when asked is told again that the device has room for them."""
PROMOTE_QUIET_S = 2.0
"""No buffer is promoted back within this many seconds of a commit the budget refused: the room a demote made is the
refused commit's first, which its client is sending again."""


class Pressure(Generic[A, C]):
    """Asks of sessions for memory back, over the sessions, the budget and the leases."""

    def __init__(self, sessions: Sessions, tenants: Tenants, leases: Leases[A, C], demote_idle_s: float,
                 clock: Clock) -> None:
        self.sessions = sessions
        self.tenants = tenants
        self.leases = leases
        self.demote_idle_s = demote_idle_s
        self.clock = clock
        self.refused_at = float("-inf")
        """When the budget last refused a commit (monotonic)."""

    def ask_back_all_leases(self, but: Session | None = None) -> None:
        """Ask every session but ``but`` for its unplaced granules, and lease them none until they commit again."""
        for session in self.sessions.by_id.values():
            if session is not but:
                self.leases.ask_back(session)

    def refused(self, requester: Session | None) -> None:
        """The budget refused ``requester``'s commit: ask every other session for its unplaced granules, and lease them
        none until they commit again.

        The requester gives its own lease back and asks again (the client
        does so at once): it is leased nothing more meanwhile, or a top-up
        would take the room its retry needs.
        """
        self.ask_back_all_leases(but=requester)
        if requester is not None:
            self.leases.hold_off(requester)

    def withheld_bytes(self) -> int:
        """Leased bytes asked back long ago and still not given back: a retry will not find them."""
        return self.leases.withheld_bytes(list(self.sessions.by_id.values()), self.clock.monotonic())

    def demote_for(self, tenant: Tenant, needed: int) -> int:
        """Ask idle sessions of demotable tenants (the config's ``demote``, in its order; never ``tenant``'s own, never
        a guaranteed one) to demote ``needed`` bytes of their buffers to the host tier; returns the bytes asked for, and
        still being demoted from earlier asks, up to ``needed``.

        As reclaim, through each session's client and with its patience as
        deadline: nothing is taken by force. Not beyond the host tier's room,
        and not of a session that grew a buffer in the last ``demote_idle_s``
        (:data:`DEMOTE_IDLE_S`).
        """
        now = self.refused_at = self.clock.monotonic()
        needed = min(needed, self.tenants.host_room())
        asked = 0
        for other in self.tenants.demotable():
            if other is tenant:
                continue
            for session in sorted(self.sessions.by_id.values(), key=lambda s: s.session_id):
                held = session.committed_bytes
                busy = now - session.grown_at < self.demote_idle_s
                if asked >= needed or session.tenant is not other or held == 0 or busy:
                    continue
                reclaim = session.reclaim
                outcome = reclaim.outcome(now, self.sessions.reclaim_patience_s) if reclaim is not None else ""
                if reclaim is not None and reclaim.demote and outcome == "pending":
                    asked += reclaim.requested_bytes  # asked already: on its way
                    continue
                if (reclaim is not None and reclaim.demote and outcome == "answered" and not reclaim.told
                        and (reclaim.released_bytes or 0) < reclaim.requested_bytes):
                    # Its engine declared nothing more idle: the refusal after that answer is told so, once, and its
                    # client gives up rather than retry for its 10 s while a demote is asked for and answered with
                    # nothing, over and over (issue #61). A commit after that asks again.
                    reclaim.told = True
                    continue
                ask = min(held, needed - asked)
                self.request_reclaim(session, ask, f"tenant {tenant.name!r} needs device memory", demote=True)
                asked += ask
        return min(asked, needed)

    def short(self, tenant: Tenant, needed: int) -> None:
        """The device is short of ``needed`` bytes that ``tenant`` was guaranteed: ask sessions of tenants above their
        guarantee for them, leases first."""
        self.refused(None)
        for other, excess in self.tenants.over_guarantee():
            if other is tenant:
                continue
            for session in self.sessions.by_id.values():
                held = session.committed_bytes
                if session.tenant is not other or held == 0 or needed <= 0:
                    continue
                ask = min(excess, held, needed)
                self.request_reclaim(session, ask, f"tenant {tenant.name!r} needs its guaranteed minimum")
                needed -= ask
                excess -= ask

    def admissible_for(self, session: Session) -> int:
        """Budget left for ``session``: what a commit of it would be admitted for now; its own lease counts as room
        (it is given up for it)."""
        return self.tenants.admissible(session.tenant) + session.leased_bytes

    def promotes_due(self, now: float) -> list[tuple[Session, int]]:
        """Sessions whose clients demoted buffers when asked and whose tenant has device room for them again, with
        their demoted bytes; each is named again after :data:`PROMOTE_ASK_EVERY_S` while they stay demoted, none
        within :data:`PROMOTE_QUIET_S` of a refused commit."""
        due: list[tuple[Session, int]] = []
        if now - self.refused_at < PROMOTE_QUIET_S:
            return due
        for session in self.sessions.by_id.values():
            if not session.demoted_under_pressure:
                continue
            demoted = sum(b.physical_bytes for b in session.buffers.values() if b.demoted)
            if not demoted:
                session.demoted_under_pressure = False
            elif now - session.promote_asked_at >= PROMOTE_ASK_EVERY_S and self.admissible_for(session) >= demoted:
                session.promote_asked_at = now
                due.append((session, demoted))
        return due

    def request_reclaim(self, session: Session, requested_bytes: int, reason: str, demote: bool = False) -> Reclaim:
        """Record a request that ``session`` give ``requested_bytes`` back (its lease first; ``demote``: demote them to
        the host tier); the server delivers it."""
        reclaim = self.sessions.request_reclaim(session, requested_bytes, reason, self.clock.monotonic(), demote)
        self.leases.ask_back(session)
        return reclaim
