"""Memory pressure, as a client meets it: reclaim requests, demotes and promotes, and commits refused for room.

The daemon asks a session to give memory back (``hbmctl reclaim``, or a
tenant over its share): the engine answers through a callback or by polling
(:meth:`Client.on_reclaim`, :meth:`Client.pending_reclaims`). Clients of tenants
configured to be demoted are asked, when idle, to move their buffers to the
host tier for another tenant's commit, and told when the device has room
again: the client does both itself, its engine need do nothing. A commit the
budget refuses is sent again with the lease given back, then while other
tenants' buffers are being demoted for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hbmd.proto import Committed, PromoteRequest, ReclaimDone, ReclaimRequest, Request
from hbmd.proto.errors import HbmdError, NotFound, OutOfBudget

from .core import SessionCore
from .leasing import Leasing
from .recovery import Recovery

log = logging.getLogger("hbmd.client")

DEMOTE_WAIT_S = 10.0
"""How long a commit refused while other tenants' idle buffers are demoted for it is sent again (each idle client
copies its buffers out at copy speed)."""
DEMOTE_RETRY_S = 0.02


class Pressure:
    """A client's side of the daemon's requests for room: it answers them through ``recovery``'s calls, moves the
    buffers ``recovery`` holds, and gives ``leasing``'s lease back for a refused commit."""

    def __init__(self, core: SessionCore, recovery: Recovery, leasing: Leasing) -> None:
        self._core = core
        self._recovery = recovery
        self._leasing = leasing
        self.callback: Callable[[ReclaimRequest], int] | None = None
        """The engine's answer to reclaim requests (:meth:`Client.on_reclaim`), run on the listener thread."""

    # reclaim requests, answered by the engine

    def pending(self) -> list[ReclaimRequest]:
        """Reclaim requests filed and not yet answered (see :meth:`Client.pending_reclaims`, which reads the socket
        first where no listener does)."""
        inbox = self._core.handles.inbox
        requests: list[ReclaimRequest] = []
        while True:
            try:
                # One at a time: the listener thread may file another between a copy and a clear.
                requests.append(inbox.reclaims.popleft())
            except IndexError:
                return requests

    def answer(self, request: ReclaimRequest, released_bytes: int) -> None:
        self._recovery.call(ReclaimDone(request.reclaim_id, released_bytes))

    def serve(self) -> None:
        """On the listener thread: answer the reclaim requests that came (where the engine gave a callback), then
        the demotes and promotes."""
        callback = self.callback
        if callback is not None:
            for request in self.pending():
                try:
                    self.answer(request, int(callback(request)))
                except Exception:
                    log.exception("reclaim callback for %d bytes failed", request.bytes)
        self.serve_demotes()

    # demotes and promotes, served by the client itself

    def serve_demotes(self) -> None:
        """Answer the daemon's requests to demote buffers (another tenant's commit waits for the room): the buffers
        this process maps go to the host tier, oldest first, until the bytes asked for have moved; and promote them
        back when the daemon says the device has room again. The daemon asks only clients of tenants configured to be
        demoted, when idle."""
        demotes = self._core.handles.inbox.demotes
        while True:
            try:
                request = demotes.popleft()
            except IndexError:
                return
            moved = 0
            with self._core.lock:  # the engine's own calls wait; its kernels keep running on the same addresses
                for holder in sorted(self._recovery.holders, key=lambda h: h.buffer_id):
                    if isinstance(request, ReclaimRequest) and moved >= request.bytes:
                        break
                    try:
                        if isinstance(request, ReclaimRequest):
                            moved += holder._demote_under_pressure()
                        else:
                            moved += holder._promote_after_pressure()
                    except HbmdError as exc:
                        log.warning("moving buffer %d for the daemon failed: %s", holder.buffer_id, exc)
            if isinstance(request, PromoteRequest):
                log.info("promoted %d bytes back to the device: the daemon has room again", moved)
                continue
            log.info("demoted %d bytes to the host tier for the daemon (%s)", moved, request.reason)
            try:
                self.answer(request, moved)
            except NotFound:
                # Asked by a daemon since restarted, which keeps no reclaim: nobody waits for the answer. The
                # requests queued behind it (a promote, say) are served all the same.
                log.debug("the daemon that asked for reclaim %d is gone: answer dropped", request.reclaim_id)

    # commits refused for room

    def call_after_refusal(self, msg: Request[Committed], refusal: OutOfBudget) -> tuple[Committed, int]:
        """Send ``msg`` again after the budget refused it: once with the lease given back (its granules and credit count
        against this session), then while idle tenants' buffers are being demoted for it; raises the last refusal."""
        if self._leasing.on and self._leasing.give_back():
            try:
                return self._recovery.call_with_id(msg)
            except OutOfBudget as exc:
                refusal = exc
        if not refusal.details.get("demoting"):
            raise refusal
        deadline = time.monotonic() + DEMOTE_WAIT_S
        while True:
            time.sleep(DEMOTE_RETRY_S)
            try:
                return self._recovery.call_with_id(msg)
            except OutOfBudget as exc:
                if not exc.details.get("demoting") or time.monotonic() > deadline:
                    raise
