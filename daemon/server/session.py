"""Session messages (``hbmd.proto.session``) beyond the hello: the daemon's own asks of a session, and its answers.

The state decides what a session should be told (a reclaim request, leased
granules it wants back, a lease to top up) and leaves it due; the loop has
:class:`SessionNotices` send it on the session's handle socket once each
request or batch of events is done. The hello and the datagrams a client
sends (placements and returns of leased granules) are the handle plane's
(``handles.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Generic

from hbmd.proto import Ack, CreditGrant, CreditRevoke, LeaseRevoke, PromoteRequest, ReclaimDone, ReclaimRequest
from hbmd.proto.units import format_bytes

from ..backends import A, C
from ..state import State
from .connection import HandleConnection
from .handles import HandlePlane
from .registry import RequestHandlers, handles

log = logging.getLogger("hbmd.server.session")

TOP_UP_WORK_PER_TURN_S = 0.002
"""Seconds of granules made for leases in one turn of the loop (one session's granule at least); the sessions left
are served first in the next turns, which follow at once. A lease is made ahead of need: with many sessions to top
up at once (engines starting together), making all their granules in one turn held every request waiting behind it
for tens of milliseconds."""


class SessionRequests(RequestHandlers[A, C]):
    """A session's answer to a reclaim request it was sent."""

    @handles(ReclaimDone)
    def reclaim_done(self, conn: HandleConnection[A, C], request_id: int, msg: ReclaimDone) -> Ack:
        """Record how much the session released for reclaim ``msg.reclaim_id``."""
        self.state.sessions.reclaim_answered(conn.opened_session, msg.reclaim_id, msg.released_bytes)
        log.info(
            "session %d answered reclaim %d: released %s",
            conn.opened_session.session_id, msg.reclaim_id, format_bytes(msg.released_bytes),
        )
        return Ack()


class SessionNotices(Generic[A, C]):
    """What the daemon tells sessions unasked: reclaim requests, leased granules asked back, lease top-ups."""

    def __init__(self, state: State[A, C], plane: HandlePlane[A, C], journal: Callable[[], None]) -> None:
        """``journal`` journals the state (nothing where the daemon keeps nothing across a restart)."""
        self.state = state
        self.plane = plane
        self.journal = journal

    def send_reclaims(self) -> None:
        """Deliver the reclaim requests the state made, on each session's handle socket."""
        while self.state.sessions.reclaims_due:
            session, reclaim = self.state.sessions.reclaims_due.pop(0)
            conn = self.plane.by_session.get(session.session_id)
            # A client of an earlier minor would read a demote as a reclaim, and drop the memory: it is not asked.
            if conn is not None and (conn.protocol_minor >= 6 or not reclaim.demote):
                conn.send_quietly(
                    ReclaimRequest(reclaim.reclaim_id, reclaim.requested_bytes, reclaim.reason, reclaim.demote)
                )

    def send_promotes(self, now: float) -> None:
        """Tell the clients that demoted buffers when asked that the device has room for them again."""
        for session, demoted in self.state.pressure.promotes_due(now):
            conn = self.plane.by_session.get(session.session_id)
            if conn is not None:
                conn.send_quietly(PromoteRequest(demoted))

    def send_revokes(self) -> None:
        """Ask sessions for the leased granules and the credit the state wants back."""
        while self.state.leases.revokes_due:
            session, chunk_ids = self.state.leases.revokes_due.pop(0)
            conn = self.plane.by_session.get(session.session_id)
            if conn is not None:
                conn.send_quietly(LeaseRevoke(chunk_ids))
        while self.state.leases.credit_revokes_due:
            conn = self.plane.by_session.get(self.state.leases.credit_revokes_due.pop(0).session_id)
            if conn is not None:
                conn.send_quietly(CreditRevoke())

    def serve_leases(self) -> None:
        """Ask back what the state wants back, and top up the leases that commits and placements ran down, after the
        replies have gone out, for :data:`TOP_UP_WORK_PER_TURN_S` (the rest in the next turns).

        The top-ups are journaled before they are sent, as a reply is: a
        client spends what it was granted, and a successor daemon must know
        the grant to take the spending.
        """
        self.send_revokes()
        topped_up = []
        until = time.perf_counter() + TOP_UP_WORK_PER_TURN_S
        due = self.state.leases.take_due()
        for served, session_id in enumerate(due):
            if served and time.perf_counter() >= until:
                self.state.leases.due_again(due[served:])
                break
            conn = self.plane.by_session.get(session_id)
            if conn is not None:
                self.plane.outbox.top_up_lease(conn, until)
                topped_up.append((conn, self.state.leases.top_up_credit(conn.opened_session)))
        if not topped_up:
            return
        self.journal()
        for conn, granted in topped_up:
            self.plane.outbox.flush(conn)
            if granted and not conn.send_quietly(CreditGrant(granted)):
                self.state.leases.withdraw(conn.opened_session, granted)

    def report_ignored_reclaims(self, now: float) -> None:
        """Log, once each, the reclaim requests that sessions left unanswered past the state's patience."""
        for conn in self.plane.by_session.values():
            reclaim = conn.opened_session.reclaim
            if reclaim is None or reclaim.reported:
                continue
            if reclaim.outcome(now, self.state.sessions.reclaim_patience_s) == "ignored":
                reclaim.reported = True
                log.warning(
                    "session %d (pid %d) has not answered reclaim request %d for %s; it keeps running",
                    conn.opened_session.session_id, conn.pid, reclaim.reclaim_id, format_bytes(reclaim.requested_bytes),
                )
