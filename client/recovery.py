"""A session going on across a daemon restart: its calls, resume, reconnect, declare again, and the unconfirmed log.

Every call of the session goes through :meth:`Recovery.call_with_id`: where
the daemon went away, the session is taken back and the call sent again
under its request id.

When the daemon that served a session goes away, what this process maps
stays mapped. :class:`Recovery` takes the session back from the daemon that
serves next (with the credential of the last welcome), sends again the
placements and binds that daemon may never have read, and agrees with it on
the lease. Where the new daemon kept nothing (a cold restart: no FD store,
no takeover), the session starts over: a new one, on which every buffer
this process still maps is declared (:class:`~hbmd.proto.Redeclare`) so that
it is counted again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from typing import Protocol, TypeVar

from hbmd.proto import BufferInfo, LeasePlace, Message, OwnChunks, Redeclare, Request, Status, Welcome
from hbmd.proto.errors import DaemonUnavailable, HbmdError, PermissionDenied, SessionLost, TensorUnusable
from hbmd.proto.undo import Undo

from .core import SessionCore
from .lease import Credit, Lease
from .transport import HandleChannel

R = TypeVar("R", bound=Message)

log = logging.getLogger("hbmd.client")

RESUME_POLL_S = 0.01
MAX_KEPT_FDS = 64
"""The most FDs of chunks bound on credit this process keeps until the daemon's next answer shows it read them; a
commit past it asks for one (a worker that only grows on credit sends no other request)."""
MAX_UNCONFIRMED = 1024
"""The most placements and binds this process keeps (to send again should the daemon restart) until the daemon's next
answer shows it read them; a commit past it asks for one (a worker that only grows from its lease sends no request)."""


class Holder(Protocol):
    """What maps a buffer of the session in this process (an ``ExtensibleTensor``): should the daemon restart with
    nothing to keep its memory, the client declares the buffer again on its new session (:meth:`Client.holds`)."""

    @property
    def buffer_id(self) -> int: ...

    def _declaration(self) -> Redeclare | None:
        """The buffer as this process maps it; None where it maps nothing the daemon should count."""

    def _declared(self, buffer: BufferInfo | None, refusal: HbmdError | None) -> None:
        """The new daemon's record of the buffer, or why it refused to count it."""

    def _demote_under_pressure(self) -> int:
        """Demote the buffer to the host tier where it can be; returns the device bytes that gave back."""

    def _promote_after_pressure(self) -> int:
        """Promote the buffer back where :meth:`_demote_under_pressure` demoted it; returns the bytes promoted."""


class Listening(Protocol):
    """What reads the session's handle channel beside the calls: the client's
    :class:`~hbmd.client.listener.Listener`."""

    def moved(self) -> None:
        """The session speaks on a new handle channel: listen there."""


class Recovery:
    """The session's calls, what a client keeps to go on after its daemon restarts, and the steps that take the
    session back.

    ``lease`` and ``credit`` (None where the daemon grants none) are
    agreed on with a daemon that took the session back. Every part of the
    client calls through :meth:`call_with_id`, under the core's call lock.
    """

    def __init__(self, core: SessionCore, lease: Lease | None, credit: Credit | None) -> None:
        self._core = core
        self._lease = lease
        self._credit = credit
        self._listener: weakref.ref[Listening] | None = None
        self.credential = core.welcome.resume_credential
        """The resume credential of the last welcome."""
        self.lost: SessionLost | None = None
        """Why the session cannot be resumed, once that is known."""
        self.holders: weakref.WeakSet[Holder] = weakref.WeakSet()
        """What maps this session's buffers here: declared again where the session starts over."""
        self.started_over = 0
        """How many times the session started over on a daemon that had kept nothing of it."""
        self.unconfirmed: list[tuple[LeasePlace | OwnChunks, list[int]]] = []
        """Placements and binds sent since the last reply, with the FDs of the chunks bound: one the daemon had not
        read when it went may be lost with it, and is sent again."""
        self.kept_fds = 0
        """The FDs in :attr:`unconfirmed`."""
        self._moved: dict[int, int] = {}
        """The new id of each buffer whose id changed when the session last started over, by its old one: a request
        built before (by another thread, say) goes to the buffer it meant."""
        self._refused: dict[int, HbmdError] = {}
        """Why the daemon refused to count each buffer again when the session last started over, by its id: a request
        built for it before fails as its tensor does, rather than with the new daemon's ``not_found``."""

    def followed_by(self, listener: Listening) -> None:
        """Move ``listener`` to the new handle channel whenever the session is taken back.

        The listener is made after this recovery (what it serves calls
        through it), so it is told here; held weakly, since it holds this
        recovery: a client dropped unclosed is collected at once, and its
        listener thread ends.
        """
        self._listener = weakref.ref(listener)

    # calls

    def call(self, msg: Request[R], timeout: float | None = None) -> R:
        """Send a request and return its reply (see :meth:`call_with_id`)."""
        return self.call_with_id(msg, timeout)[0]

    def call_with_id(self, msg: Request[R], timeout: float | None = None) -> tuple[R, int]:
        """Send a request and return its reply and the id it went under; the daemon's refusal is raised. Where the
        daemon went away, the session is taken back (:meth:`resume`) and the request sent again under the same id."""
        core = self._core
        core.check_not_forked()
        if core.closed:
            raise HbmdError("this hbmd client is closed")
        with core.lock:
            request_id = core.control.next_request_id()
            deadline = None
            while True:
                msg = self.addressed(msg)
                unconfirmed = len(self.unconfirmed)
                try:
                    answer = core.control.call_with_id(msg, timeout, request_id)
                except (SessionLost, PermissionDenied) as exc:
                    # The daemon issued the token: if it no longer knows it, the daemon restarted or ended the session.
                    if isinstance(exc, PermissionDenied) and exc.details.get("token") != "unknown":
                        raise
                    deadline = deadline or time.monotonic() + core.resume_timeout
                    started_over = self.started_over
                    self.resume(deadline)
                    if self.started_over != started_over:
                        # A new session, which declared again under ids of its own since: the request is a new one.
                        request_id = core.control.next_request_id()
                    continue  # the same request, under the same id (and the buffer's new one, if it moved)
                self.confirmed(unconfirmed)  # the daemon read them before it answered
                return answer

    # requests built before the session started over

    def addressed(self, msg: Request) -> Request:
        """``msg`` as the session now knows its buffer: under the buffer's new id where the session started over and
        the id changed; :class:`TensorUnusable` where the new daemon refused to count the buffer."""
        buffer_id = getattr(msg, "buffer_id", None)
        if buffer_id in self._refused:
            raise TensorUnusable(
                f"buffer {buffer_id}: hbmd restarted with nothing to keep its memory and refused to count it "
                f"again ({self._refused[buffer_id].message}); free it and create or attach it anew",
                buffer_id=buffer_id,
            )
        if buffer_id in self._moved:
            return dataclasses.replace(msg, buffer_id=self._moved[buffer_id])  # type: ignore[type-var]
        return msg

    # the unconfirmed log

    def confirmed(self, count: int) -> None:
        """The daemon read the first ``count`` placements and binds: the FDs kept to send a bind again are closed."""
        for _, fds in self.unconfirmed[:count]:
            for fd in fds:
                self._core.fd_closer().close_later(fd)
            self.kept_fds -= len(fds)
        del self.unconfirmed[:count]

    def unconfirmed_sent(self, sent: LeasePlace | OwnChunks, fds: list[int]) -> None:
        """Keep a placement or bind just sent (and its FDs) until an answer confirms it; past :data:`MAX_KEPT_FDS` or
        :data:`MAX_UNCONFIRMED`, ask for one. A failure to ask is logged: the next answer confirms them as well."""
        self.unconfirmed.append((sent, fds))
        self.kept_fds += len(fds)
        if self.kept_fds > MAX_KEPT_FDS or len(self.unconfirmed) > MAX_UNCONFIRMED:
            try:
                self.call(Status())  # any answer says the daemon read every placement and bind before it
            except HbmdError as exc:
                log.debug("confirming %d placements and binds failed: %s", len(self.unconfirmed), exc)

    # taking the session back

    def resumed(self) -> bool:
        """Take the session back now if the daemon went away (waiting up to the core's ``resume_timeout``); False
        where it cannot be (:attr:`lost`)."""
        core = self._core
        with core.lock:
            if core.closed or core.forked:
                return False
            if not core.handles.lost():
                return self.lost is None
            try:
                self.resume(time.monotonic() + core.resume_timeout)
            except SessionLost:
                return False
            return True

    def resume(self, deadline: float) -> None:
        """Take the session back from the daemon that replaced the one that went away, by ``deadline``, or start it
        over where that daemon kept nothing; the call lock held. Raises :class:`SessionLost` where it cannot
        (and every later call does too)."""
        core = self._core
        paths = core.paths
        if self.lost is not None:
            raise self.lost
        if not self.credential:
            self.lost = SessionLost(
                f"hbmd at {paths.endpoint} no longer knows this session: connect again", path=paths.endpoint
            )
            raise self.lost
        started = time.monotonic()
        handles, welcome, anew = self._reconnect(deadline)
        old = core.handles
        core.go_on(handles, welcome)
        self.credential = welcome.resume_credential
        old.inbox.drain()  # grants that came before the daemon went, with their FDs
        if self._lease is not None:
            self._lease.serve(old.inbox.grants, old.inbox.revokes)
        self._reconcile_lease(welcome.lease_chunk_ids, anew)
        old.close()
        listener = self._listener() if self._listener is not None else None
        if listener is not None:
            listener.moved()
        if not anew:
            log.warning("hbmd at %s went away and came back: session %d resumed after %.2fs", paths.directory,
                        core.session_id, time.monotonic() - started)
            return
        self.started_over += 1
        declared = self._declare_again()
        log.warning("hbmd at %s restarted with nothing kept: session %d started over after %.2fs, %d buffers declared "
                    "again", paths.directory, core.session_id, time.monotonic() - started, declared)

    def _reconnect(self, deadline: float) -> tuple[HandleChannel, Welcome, bool]:
        """A handle channel to the daemon serving again, its welcome back, and whether that welcomes a new session
        (the daemon kept nothing); waits for it until ``deadline``."""
        core = self._core
        paths = core.paths
        # Its own hello's fields describe the session should the daemon start it over: this process declares what
        # it maps there, proving with the credential that it held the session (a pid would not: in a container the
        # daemon sees every process as pid 0).
        hello = dataclasses.replace(core.hello, resume_session=core.session_id,
                                    resume_credential=self.credential, start_over=bool(self.holders),
                                    replies_with_fds=True)
        waiting = False
        while True:
            try:
                handles = HandleChannel(paths, max(0.1, min(core.timeout, deadline - time.monotonic())))
                with Undo() as undo:
                    undo.push(handles.close)
                    welcome = handles.handshake(hello)
                handles.timeout = core.timeout  # what is left of the wait was for the handshake only
                return handles, welcome, hello.resume_session == 0 or welcome.started_over
            except SessionLost as exc:
                if hello.resume_session == 0 or not self.holders:
                    raise self._lose(f"came back without this session ({exc.message}): connect again") from exc
                # It restarted with nothing kept and would not start the session over (its key is new, or it is older
                # than 1.12): a new session all the same; a daemon that cannot tell this process held the session
                # refuses its declarations, and the tensors say so.
                hello = core.hello
            except PermissionDenied as exc:
                raise self._lose(f"came back without this session ({exc.message}): connect again") from exc
            except DaemonUnavailable as exc:
                if core.closed:  # closed meanwhile (its close waits for the listener, which may be here)
                    raise SessionLost("this hbmd client was closed while its daemon was away") from exc
                if not waiting:
                    # The engine's call pauses here: once, say why and for how long, not on every poll.
                    log.warning("hbmd at %s is away (%s): session %d waits up to %.0fs for it to come back "
                                "(HBMD_RESUME_TIMEOUT)", paths.directory, exc.message, core.session_id,
                                max(0.0, deadline - time.monotonic()))
                    waiting = True
                if time.monotonic() > deadline:
                    raise self._lose(f"did not come back within {core.resume_timeout:g}s (HBMD_RESUME_TIMEOUT): "
                                     f"{exc.message}") from exc
                time.sleep(RESUME_POLL_S)

    def _lose(self, why: str) -> SessionLost:
        """The session is lost for good: every later call raises the error returned."""
        paths = self._core.paths
        self.lost = SessionLost(f"hbmd at {paths.directory} {why}", path=paths.endpoint)
        return self.lost

    def _reconcile_lease(self, leased: list[int], anew: bool) -> None:
        """Agree with the resumed daemon on the lease: placements it never read are sent again, granules it does not
        record are let go of, those it records and this process lacks are given back; binds are sent again (one it
        had read it finds taken already, and changes nothing) and the credit all given back.

        On a session started over (``anew``) nothing is sent again: what
        this process maps is declared instead.
        """
        handles = self._core.handles
        still_leased = set(leased)
        for placement, fds in [] if anew else self.unconfirmed:
            if isinstance(placement, OwnChunks):
                handles.send(placement, fds)
            elif still_leased.issuperset(placement.chunk_ids):
                handles.send(placement)
                still_leased.difference_update(placement.chunk_ids)
        self.confirmed(len(self.unconfirmed))
        if self._lease is not None:
            # Kept where the daemon still records them as leased; the credit all goes back.
            self._lease.resumed(still_leased)
        if self._credit is not None:
            handles.inbox.credits.clear()
            self._credit.give_back()

    def _declare_again(self) -> int:
        """Declare every buffer this process maps on the session started over, highest id first (see
        :attr:`Redeclare.buffer_id`); returns how many the daemon counts."""
        control = self._core.control
        self._moved, self._refused = {}, {}
        declared = 0
        for holder in sorted(self.holders, key=lambda h: h.buffer_id, reverse=True):
            declaration = holder._declaration()
            if declaration is None:
                continue
            old = holder.buffer_id
            try:
                created, _ = control.call_with_id(declaration, None, control.next_request_id())
            except (SessionLost, DaemonUnavailable):
                raise
            except HbmdError as exc:
                log.error("hbmd refused to count buffer %d again after its restart (%s): its pages are dropped and its "
                          "tensor is unusable, free it", old, exc.message)
                self.holders.discard(holder)
                self._refused[old] = exc
                holder._declared(None, exc)
                continue
            holder._declared(created.buffer, None)
            declared += 1
            if created.buffer.buffer_id != old:
                self._moved[old] = created.buffer.buffer_id
        return declared
