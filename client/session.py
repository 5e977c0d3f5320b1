"""``Client``: one session with one daemon instance."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Protocol, TypeVar

from hbmd.proto import (
    MAX_PLACED_GRANULES,
    PROTOCOL_VERSION,
    Attach,
    BufferInfo,
    Commit,
    CommitSegments,
    Committed,
    CreateBuffer,
    Defragment,
    Delete,
    Detach,
    Detached,
    FinishDefragment,
    Free,
    Freed,
    Hello,
    LeasePlace,
    ListBuffers,
    ListSessions,
    Message,
    Move,
    OwnChunks,
    Reclaim,
    ReclaimDone,
    ReclaimRequest,
    ReclaimSent,
    Redeclare,
    Release,
    Released,
    Remap,
    Request,
    Seal,
    Sealed,
    SessionInfo,
    Status,
    StatusReply,
    Welcome,
)
from hbmd.proto.errors import (
    DaemonUnavailable,
    HbmdError,
    InvalidRequest,
    NotFound,
    OutOfBudget,
    PermissionDenied,
    SessionLost,
    TensorUnusable,
    VersionMismatch,
)
from hbmd.proto.instance import InstancePaths, list_instances, resolve_run_dir
from hbmd.proto.undo import Undo

from .budget import DeviceMemory
from .devices import parse_device
from .delivery import Delivery
from .lease import Credit, Lease, LeasedGranule, Spare
from .mapper import Mapper
from .transport import SPIN_S, ControlChannel, FdCloser, HandleChannel

DEFAULT_TIMEOUT_S = 10.0
RESUME_TIMEOUT_S = 30.0
"""How long a client waits by default for its daemon to come back after it went away (``HBMD_RESUME_TIMEOUT``)."""
RESUME_POLL_S = 0.01
DEMOTE_WAIT_S = 10.0
"""How long a commit refused while other tenants' idle buffers are demoted for it is sent again (each idle client
copies its buffers out at copy speed: 64 GiB took about 1.2 s at the H200's 55 GB/s)."""
DEMOTE_RETRY_S = 0.02
TENANT_ENV = "HBMD_TENANT"
"""The tenant a client declares where its code names none: how an operator sets it for an engine it does not write
(vLLM's workers, say)."""

log = logging.getLogger("hbmd.client")

R = TypeVar("R", bound=Message)


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


class ForkedClient(HbmdError):
    """A client was used in a child process after ``fork()``; connect anew there."""


class Client:
    """A session with one daemon instance: the handle socket, the control socket and a mapper.

    Use :func:`connect` to find the instance for a device. Not fork-safe: a
    child process must connect again (using the parent's client raises
    :class:`ForkedClient`), and the child's copy of the handle socket is
    closed at fork, so a child never keeps its parent's session alive. An
    ``observer`` (a monitoring tool) holds no memory and is not counted
    among the sessions.

    When the daemon restarts, the session goes on: what this process maps
    stays mapped (addresses never move), and the client takes the session
    back from the new daemon (with the credential of its last welcome) as
    soon as it serves, waiting up to ``resume_timeout`` seconds
    (``HBMD_RESUME_TIMEOUT``, default 30). The call in flight is sent again
    under its request id: the daemon answers it again where it had done it,
    and does it where it had not. Only where the daemon kept nothing (it
    restarted with no keeper for its memory: no systemd FD store, no
    ``--takeover``) or does not come back in time does a call raise
    :class:`SessionLost`, a retryable :class:`DaemonUnavailable`; then close
    this client and connect again: the new session attaches the persistent
    buffers by name and creates anonymous ones anew.

    Where the daemon kept nothing, the session starts over instead: a new
    one, on which this client declares again every buffer its tensors still
    map (:class:`Redeclare`), so that the new daemon counts memory still in
    use; their tensors go on at the same addresses, under the buffer ids
    they had wherever those are free.
    A buffer the daemon refuses to count (admitted as a commit of its
    bytes would be) loses its pages at once and makes its tensor unusable
    (:class:`TensorUnusable`; free it). Persistent buffers that no process
    maps are lost then, and anything this process had leased.

    ``lease`` (the default): take the granules the daemon leases ahead of
    need, imported by a listener thread, so that a small commit maps them
    without a round trip (:mod:`hbmd.client.lease`).

    ``tenant``: the name this session's memory is charged to, as the
    daemon's ``--config`` declares tenants (None: ``HBMD_TENANT``, else
    none, and the session is charged to its uid). A name this user may not
    declare is refused at connect with ``PermissionDenied``.
    """

    def __init__(
        self,
        paths: InstancePaths,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        client_name: str = "",
        tenant: str | None = None,
        observer: bool = False,
        mapper: Mapper | None = None,
        lease: bool = True,
        resume_timeout: float | None = None,
    ) -> None:
        """``mapper`` replaces the backend's own (a test's mapper that fails on demand, say); ``resume_timeout``:
        seconds to wait for a daemon that went away (None: ``HBMD_RESUME_TIMEOUT``, else 30)."""
        self.paths = paths
        self.timeout = timeout
        self.resume_timeout = resume_timeout_from_env() if resume_timeout is None else resume_timeout
        spin = spin_from_env()
        if tenant is None:
            tenant = os.environ.get(TENANT_ENV, "")
        self._pid = os.getpid()
        self._hello = Hello(list(PROTOCOL_VERSION), self._pid, client_name or _program_name(), tenant, observer,
                            lease and not observer, replies_with_fds=True)
        """The hello of a new session: sent again where the session must start over."""
        with Undo() as undo:
            self._handles = HandleChannel(paths, timeout)
            undo.push(self._handles.close)
            self.welcome = self._handles.handshake(self._hello)
            self._control = ControlChannel(paths, self.welcome.token, timeout, session=self._handles,
                                           replies_with_fds=_replies_with_fds(self._hello, self.welcome),
                                           spin=spin)
        if self.welcome.tenant_note:
            log.warning("hbmd at %s: %s", paths.directory, self.welcome.tenant_note)
        self._mapper = mapper
        self._mapper_lock = threading.Lock()
        self.closed = False
        # One call at a time: the reclaim listener's callback may call in while the engine does.
        self._lock = threading.RLock()
        self._listener: threading.Thread | None = None
        self._reclaim_callback: Callable[[ReclaimRequest], int] | None = None
        self._closer: FdCloser | None = None
        self._lease: Lease | None = None
        self._credential = self.welcome.resume_credential
        self._unconfirmed: list[tuple[LeasePlace | OwnChunks, list[int]]] = []
        """Placements and binds sent since the last reply, with the FDs of the chunks bound: one the daemon had not
        read when it went may be lost with it, and is sent again."""
        self._kept_fds = 0
        """The FDs in :attr:`_unconfirmed`."""
        self._lost: SessionLost | None = None
        """Why the session cannot be resumed, once that is known."""
        self._holders: weakref.WeakSet[Holder] = weakref.WeakSet()
        """What maps this session's buffers here: declared again where the session starts over."""
        self.started_over = 0
        """How many times the session started over on a daemon that had kept nothing of it (see :meth:`_resume`)."""
        self._moved: dict[int, int] = {}
        """The new id of each buffer whose id changed when the session last started over, by its old one: a request
        built before (by another thread, say) goes to the buffer it meant."""
        self._refused: dict[int, HbmdError] = {}
        """Why the daemon refused to count each buffer again when the session last started over, by its id: a request
        built for it before fails as its tensor does, rather than with the new daemon's ``not_found``."""
        # Neither the lease, the credit nor the listener holds the client: one dropped unclosed is collected, and
        # its session ends with its socket, as without leases.
        me = weakref.ref(self)

        def send(msg: Message) -> None:
            _alive(me)._handles.send(msg)

        if self.welcome.lease_bytes > 0:
            self._lease = Lease(self.granularity, lambda: _alive(me).mapper, send)
            weakref.finalize(self, self._lease.close)
        self._credit: Credit | None = None
        if self.welcome.credit_bytes > 0:
            self._credit = Credit(send, lambda: _alive(me).mapper)
            weakref.finalize(self, self._credit.close)
        if self._lease is not None or self._credit is not None or self._credential:
            # The listener takes the session back as soon as the daemon is, idle engine or not.
            self._listen_in_background()
        _clients.add(self)

    # identity

    @property
    def instance(self) -> str:
        return self.welcome.instance

    @property
    def backend(self) -> str:
        return self.welcome.backend

    @property
    def granularity(self) -> int:
        return self.welcome.granularity

    @property
    def session_id(self) -> int:
        return self.welcome.session_id

    @property
    def requests_sent(self) -> int:
        """Requests this client has sent the daemon so far: round trips (a commit from the lease makes none)."""
        return self._control.requests_sent

    @property
    def mapper(self) -> Mapper:
        """Maps this instance's chunks into the process: host ``mmap`` or CUDA VMM."""
        if self._mapper is None:
            with self._mapper_lock:  # the listener imports leased granules with it too
                if self._mapper is not None:
                    return self._mapper
                if self.backend == "host":
                    from .host import HostMapper

                    self._mapper = HostMapper(self.granularity)
                else:
                    from .cuda import CudaMapper

                    self._mapper = CudaMapper(self.welcome.device_uuid, self.granularity)
        return self._mapper

    # requests

    def call(self, msg: Request[R], timeout: float | None = None) -> R:
        """Send any request and return its reply, typed by the request; the daemon's refusal is raised.

        Requests whose reply brings chunk FDs (:class:`Committed`) go through
        :meth:`commit`, :meth:`attach`, :meth:`defragment` or :meth:`remap`
        instead, which deliver them.
        """
        return self._call_with_id(msg, timeout)[0]

    def _call_with_id(self, msg: Request[R], timeout: float | None = None) -> tuple[R, int]:
        self._check_not_forked()
        if self.closed:
            raise HbmdError("this hbmd client is closed")
        with self._lock:
            request_id = self._control.next_request_id()
            deadline = None
            while True:
                buffer_id = getattr(msg, "buffer_id", None)
                if buffer_id in self._moved:
                    msg = dataclasses.replace(msg, buffer_id=self._moved[buffer_id])  # type: ignore[type-var]
                if buffer_id in self._refused:
                    raise TensorUnusable(
                        f"buffer {buffer_id}: hbmd restarted with nothing to keep its memory and refused to count it "
                        f"again ({self._refused[buffer_id].message}); free it and create or attach it anew",
                        buffer_id=buffer_id,
                    )
                unconfirmed = len(self._unconfirmed)
                try:
                    answer = self._control.call_with_id(msg, timeout, request_id)
                except (SessionLost, PermissionDenied) as exc:
                    # The daemon issued the token: if it no longer knows it, the daemon restarted or ended the session.
                    if isinstance(exc, PermissionDenied) and exc.details.get("token") != "unknown":
                        raise
                    deadline = deadline or time.monotonic() + self.resume_timeout
                    self._resume(deadline)
                    continue  # the same request, under the same id (and the buffer's new one, if it moved)
                self._confirmed(unconfirmed)  # the daemon read them before it answered
                return answer

    def _confirmed(self, count: int) -> None:
        """The daemon read the first ``count`` placements and binds: the FDs kept to send a bind again are closed."""
        for _, fds in self._unconfirmed[:count]:
            for fd in fds:
                self._fd_closer().close_later(fd)
            self._kept_fds -= len(fds)
        del self._unconfirmed[:count]

    def _unconfirmed_sent(self, sent: LeasePlace | OwnChunks, fds: list[int]) -> None:
        """Keep a placement or bind just sent (and its FDs) until an answer confirms it; past :data:`MAX_KEPT_FDS` or
        :data:`MAX_UNCONFIRMED`, ask for one. A failure to ask is logged: the next answer confirms them as well."""
        self._unconfirmed.append((sent, fds))
        self._kept_fds += len(fds)
        if self._kept_fds > MAX_KEPT_FDS or len(self._unconfirmed) > MAX_UNCONFIRMED:
            try:
                self.status()  # any answer says the daemon read every placement and bind before it
            except HbmdError as exc:
                log.debug("confirming %d placements and binds failed: %s", len(self._unconfirmed), exc)

    def _fd_closer(self) -> FdCloser:
        if self._closer is None:
            self._closer = FdCloser()
        return self._closer

    def _check_not_forked(self) -> None:
        """Raise :class:`ForkedClient` in a process forked from this client's: the session is the parent's."""
        if os.getpid() != self._pid:
            raise ForkedClient("this hbmd client belongs to the parent process; call hbmd.client.connect() in the child")

    def _resume(self, deadline: float) -> None:
        """Take the session back from the daemon that replaced the one that went away, by ``deadline``, or start it
        over where that daemon kept nothing; the client's lock held. Raises :class:`SessionLost` where it cannot
        (and every later call does too)."""
        if self._lost is not None:
            raise self._lost
        if not self._credential:
            self._lost = SessionLost(
                f"hbmd at {self.paths.endpoint} no longer knows this session: connect again", path=self.paths.endpoint
            )
            raise self._lost
        started = time.monotonic()
        handles, welcome, anew = self._reconnect(deadline)
        old, self._handles = self._handles, handles
        self._control.resume(welcome.token, handles, _replies_with_fds(self._hello, welcome))
        self.welcome = welcome
        self._credential = welcome.resume_credential
        old.drain()  # grants that came before the daemon went, with their FDs
        if self._lease is not None:
            self._lease.serve(old.grants, old.revokes)
        self._reconcile_lease(welcome.lease_chunk_ids, anew)
        old.close()
        self._listener = None
        self._listen_in_background()
        if not anew:
            log.warning("hbmd at %s went away and came back: session %d resumed after %.2fs", self.paths.directory,
                        self.session_id, time.monotonic() - started)
            return
        self.started_over += 1
        declared = self._declare_again()
        log.warning("hbmd at %s restarted with nothing kept: session %d started over after %.2fs, %d buffers declared "
                    "again", self.paths.directory, self.session_id, time.monotonic() - started, declared)

    def _declare_again(self) -> int:
        """Declare every buffer this process maps on the session started over, highest id first (see
        :attr:`Redeclare.buffer_id`); returns how many the daemon counts."""
        self._moved, self._refused = {}, {}
        declared = 0
        for holder in sorted(self._holders, key=lambda h: h.buffer_id, reverse=True):
            declaration = holder._declaration()
            if declaration is None:
                continue
            old = holder.buffer_id
            try:
                created, _ = self._control.call_with_id(declaration, None, self._control.next_request_id())
            except (SessionLost, DaemonUnavailable):
                raise
            except HbmdError as exc:
                log.error("hbmd refused to count buffer %d again after its restart (%s): its pages are dropped and its "
                          "tensor is unusable, free it", old, exc.message)
                self._holders.discard(holder)
                self._refused[old] = exc
                holder._declared(None, exc)
                continue
            holder._declared(created.buffer, None)
            declared += 1
            if created.buffer.buffer_id != old:
                self._moved[old] = created.buffer.buffer_id
        return declared

    def holds(self, holder: Holder) -> None:
        """``holder`` maps a buffer of this session here: declare it again should the session have to start over."""
        self._holders.add(holder)

    def lets_go(self, holder: Holder) -> None:
        """``holder`` maps nothing of this session any more."""
        self._holders.discard(holder)

    def _reconnect(self, deadline: float) -> tuple[HandleChannel, Welcome, bool]:
        """A handle channel to the daemon serving again, its welcome back, and whether that welcomes a new session
        (the daemon kept nothing); waits for it until ``deadline``."""
        hello = Hello(list(PROTOCOL_VERSION), self._pid, resume_session=self.session_id,
                      resume_credential=self._credential, replies_with_fds=True)
        waiting = False
        while True:
            try:
                handles = HandleChannel(self.paths, max(0.1, min(self.timeout, deadline - time.monotonic())))
                with Undo() as undo:
                    undo.push(handles.close)
                    welcome = handles.handshake(hello)
                handles.timeout = self.timeout  # what is left of the wait was for the handshake only
                return handles, welcome, hello.resume_session == 0
            except SessionLost as exc:
                if hello.resume_session == 0 or not self._holders:
                    self._lost = SessionLost(
                        f"hbmd at {self.paths.directory} came back without this session ({exc.message}): "
                        "connect again", path=self.paths.endpoint,
                    )
                    raise self._lost from exc
                # It restarted with nothing kept: a new session, on which this process declares what it still maps.
                hello = self._hello
            except PermissionDenied as exc:
                self._lost = SessionLost(
                    f"hbmd at {self.paths.directory} came back without this session ({exc.message}): connect again",
                    path=self.paths.endpoint,
                )
                raise self._lost from exc
            except DaemonUnavailable as exc:
                if self.closed:  # closed meanwhile (its close waits for the listener, which may be here)
                    raise SessionLost("this hbmd client was closed while its daemon was away") from exc
                if not waiting:
                    # The engine's call pauses here: once, say why and for how long, not on every poll.
                    log.warning("hbmd at %s is away (%s): session %d waits up to %.0fs for it to come back "
                                "(HBMD_RESUME_TIMEOUT)", self.paths.directory, exc.message, self.session_id,
                                max(0.0, deadline - time.monotonic()))
                    waiting = True
                if time.monotonic() > deadline:
                    self._lost = SessionLost(
                        f"hbmd at {self.paths.directory} did not come back within {self.resume_timeout:g}s "
                        f"(HBMD_RESUME_TIMEOUT): {exc.message}",
                        path=self.paths.endpoint,
                    )
                    raise self._lost from exc
                time.sleep(RESUME_POLL_S)

    def _reconcile_lease(self, leased: list[int], anew: bool) -> None:
        """Agree with the resumed daemon on the lease: placements it never read are sent again, granules it does not
        record are let go of, those it records and this process lacks are given back; binds are sent again (one it
        had read is refused, changing nothing) and the credit all given back.

        On a session started over (``anew``) nothing is sent again: what
        this process maps is declared instead.
        """
        still_leased = set(leased)
        for placement, fds in [] if anew else self._unconfirmed:
            if isinstance(placement, OwnChunks):
                self._handles.send(placement, fds)
            elif still_leased.issuperset(placement.chunk_ids):
                self._handles.send(placement)
                still_leased.difference_update(placement.chunk_ids)
        self._confirmed(len(self._unconfirmed))
        if self._lease is not None:
            self._lease.resumed(still_leased)
        if self._credit is not None:
            self._handles.credits.clear()
            self._credit.give_back()

    def resumed(self) -> bool:
        """Take the session back now if the daemon went away (waiting up to :attr:`resume_timeout`); False where it
        cannot be (see :attr:`lost`)."""
        with self._lock:
            if self.closed or os.getpid() != self._pid:
                return False
            if not self._handles.lost():
                return self._lost is None
            try:
                self._resume(time.monotonic() + self.resume_timeout)
            except SessionLost:
                return False
            return True

    def status(self) -> StatusReply:
        return self.call(Status())

    def sessions(self) -> list[SessionInfo]:
        return self.call(ListSessions()).sessions

    def buffers(self, session_id: int = -1) -> list[BufferInfo]:
        return self.call(ListBuffers(session_id)).buffers

    def create_buffer(
        self,
        capacity: int,
        num_segments: int = 1,
        *,
        name: str = "",
        persistent: bool = False,
        shareable: bool = False,
        segment_capacities: list[int] | None = None,
    ) -> BufferInfo:
        """Reserve a buffer of ``num_segments`` equal segments, or of the uneven ``segment_capacities``."""
        if segment_capacities:
            self._need_minor(1, "uneven segments")
        return self.call(
            CreateBuffer(capacity, num_segments, name, persistent, shareable, list(segment_capacities or []))
        ).buffer

    def _need_minor(self, minor: int, feature: str) -> None:
        major, daemon_minor = self.welcome.version
        if daemon_minor < minor:
            raise VersionMismatch(
                f"{feature} need an hbmd daemon of protocol {major}.{minor} or later; "
                f"{self.paths.directory} speaks {major}.{daemon_minor}"
            )

    def commit(self, buffer_id: int, bytes_per_segment: int) -> Delivery:
        """Grow the buffer; the :class:`Delivery` brings the reply and the new chunks to map (use it in ``with``)."""
        return self._deliver(Commit(buffer_id, bytes_per_segment))

    def commit_segments(self, buffer_id: int, sizes: list[int]) -> Delivery:
        """Grow each segment to its own size in ``sizes``; the new chunks come as with :meth:`commit`."""
        self._need_minor(1, "per-segment commits")
        return self._deliver(CommitSegments(buffer_id, list(sizes)))

    def attach(self, name: str, *, readonly: bool = False) -> Delivery:
        """Take over this user's orphaned persistent buffer ``name``; the delivery brings its layout and every chunk.

        ``readonly``: read the sealed buffer ``name`` beside its owner and other
        readers instead (map the chunks read-only); let go with
        ``detach(buffer_id, readonly=True)``.
        """
        if readonly:
            # A daemon that does not know the field would hand over the buffer itself.
            self._need_minor(2, "read-only attaches")
        return self._deliver(Attach(name, readonly))

    def seal(self, buffer_id: int) -> Sealed:
        """Make this session's persistent buffer immutable and readable by other sessions of this user at once."""
        self._need_minor(2, "sealed buffers")
        return self.call(Seal(buffer_id))

    def defragment(self, buffer_id: int, preserve: bool) -> Delivery:
        """Ask for one chunk per committed run; the delivery brings the new chunks."""
        return self._deliver(Defragment(buffer_id, preserve))

    def finish_defragment(self, buffer_id: int, keep_new: bool) -> Released:
        """The remap of a preserving defragment or a move is done (``keep_new``) or given up."""
        return self.call(FinishDefragment(buffer_id, keep_new))

    def move(self, buffer_id: int, tier: str) -> Delivery:
        """Ask for the buffer's chunks in ``tier`` (``"host"``: demote, ``"device"``: promote); the delivery brings them,
        none where the buffer is there already. Finish with :meth:`finish_defragment`."""
        self._need_minor(6, "demote and promote")
        return self._deliver(Move(buffer_id, tier))

    def remap(self, buffer_id: int) -> Delivery:
        """Every chunk of the buffer again, as the daemon records it: the way back after a failed map."""
        return self._deliver(Remap(buffer_id))

    def detach(self, buffer_id: int, readonly: bool = False) -> Detached:
        """Let go of this session's persistent buffer without freeing it; any session of this user attaches it again by name.

        Finish writing it first: another session may attach it as soon as
        this returns. Unmap it then: the memory stays with the daemon, not
        with this process. An anonymous buffer is refused (:class:`InvalidRequest`).
        ``readonly``: drop one read claim on a sealed buffer instead.
        """
        return self.call(Detach(buffer_id, readonly))

    def delete(self, name: str, owner_uid: int = -1) -> Freed:
        """Free this user's orphaned persistent buffer ``name``, or (admins) user ``owner_uid``'s.

        Raises ``InvalidRequest`` for ``owner_uid`` on a daemon older than
        protocol 1.2, which would ignore it and delete this user's buffer.
        """
        if owner_uid != -1 and tuple(self.welcome.version) < (1, 2):
            raise InvalidRequest(
                f"hbmd {self.welcome.daemon_version} cannot delete another user's buffer (needs protocol 1.2)",
                field="owner_uid",
            )
        return self.call(Delete(name, owner_uid))

    def _deliver(self, msg: Request[Committed]) -> Delivery:
        """Send a request answered by :class:`Committed`; its chunks come in the :class:`Delivery` returned.

        A request the budget refuses while this session holds a lease is
        sent once more with the lease given back: its bytes are room (the
        daemon reads the return before the request). One refused while other
        tenants' idle buffers are being demoted for it is sent again until
        they are, for :data:`DEMOTE_WAIT_S` at most.
        """
        self._lock.acquire()  # the delivery releases it once its batches are in
        with Undo() as undo:
            undo.push(self._lock.release)
            try:
                reply, request_id = self._call_with_id(msg)
            except OutOfBudget as exc:
                reply, request_id = self._call_after_refusal(msg, exc)
            return Delivery(reply, request_id, self._handles, self._fd_closer(), self.timeout, self._lock)

    def _call_after_refusal(self, msg: Request[Committed], refusal: OutOfBudget) -> tuple[Committed, int]:
        """Send ``msg`` again after the budget refused it: once with the lease given back (its granules and credit count
        against this session), then while idle tenants' buffers are being demoted for it; raises the last refusal."""
        if (self._lease is not None or self._credit is not None) and self._give_back_lease():
            try:
                return self._call_with_id(msg)
            except OutOfBudget as exc:
                refusal = exc
        if not refusal.details.get("demoting"):
            raise refusal
        return self._call_while_demoting(msg)

    def _call_while_demoting(self, msg: Request[Committed]) -> tuple[Committed, int]:
        """Send ``msg`` again until the budget admits it or no demote is under way for it, :data:`DEMOTE_WAIT_S` at
        most; raises the last refusal."""
        deadline = time.monotonic() + DEMOTE_WAIT_S
        while True:
            time.sleep(DEMOTE_RETRY_S)
            try:
                return self._call_with_id(msg)
            except OutOfBudget as exc:
                if not exc.details.get("demoting") or time.monotonic() > deadline:
                    raise

    # leases

    def _give_back_lease(self) -> bool:
        """Give every leased granule back, those granted and not imported yet too, and all the credit; whether any
        of either went.

        A call that waits for a reply riding with FDs reads the handle socket
        itself and files the grants that come meanwhile for the listener to
        import: left there, they would come into the lease after it was given
        back, and stay leased to a session that was just refused for want of
        room.
        """
        self._handles.drain()
        given = False
        if self._lease is not None:
            self._lease.serve(self._handles.grants, self._handles.revokes)
            given = self._lease.give_back() > 0
        if self._credit is not None:
            self._credit.serve(self._handles.credits)
            given = self._credit.give_back() > 0 or given
        return given

    def take_lease(self, count: int) -> list[LeasedGranule] | None:
        """``count`` leased granules, imported and ready to map; None where the lease holds fewer, is off, or the
        commit is one the daemon serves faster (more than :data:`MAX_PLACED_GRANULES`). Raises :class:`ForkedClient` in a
        forked child: the lease is the parent's, its handle socket closed here."""
        self._check_not_forked()
        if self._lease is None or count > min(MAX_PLACED_GRANULES, self.welcome.lease_bytes // self.granularity):
            return None
        taken = self._lease.take(count)
        if taken is None:
            # Grants the listener has not read yet may be waiting.
            self._handles.drain()
            self._lease.serve(self._handles.grants, self._handles.revokes)
            taken = self._lease.take(count)
        return taken

    def place(self, buffer_id: int, sizes: list[int], taken: list[LeasedGranule], offsets: list[int]) -> bool:
        """Tell the daemon that the ``taken`` granules back ``buffer_id`` at ``offsets``, its segments grown to ``sizes``.

        Call it before mapping them: once it returns True the daemon will
        record the placement before anything else this session asks, or its
        end. False: the daemon had gone away and the session is resumed now;
        nothing was placed and the granules are back in the lease (commit
        through the daemon instead). Where it raises, nothing was sent and the
        granules are back in the lease.
        """
        placement = LeasePlace(buffer_id, list(sizes), [g.chunk_id for g in taken], list(offsets))
        try:
            self._handles.send(placement)
        except SessionLost:
            self._lease.put_back(taken)
            self._resume(time.monotonic() + self.resume_timeout)
            return False
        except BaseException:
            self._lease.put_back(taken)
            raise
        self._lease.placed(taken)
        self._unconfirmed_sent(placement, [])
        return True

    def credit_covers(self, amount: int) -> bool:
        """Whether the credit holds ``amount`` bytes now (grants that came are read first)."""
        if self._credit is None:
            return False
        if self._credit.bytes < amount:
            self._handles.drain()
            self._credit.serve(self._handles.credits)
        return self._credit.bytes >= amount

    def take_spare(self, size: int) -> Spare | None:
        """The chunk of ``size`` bytes the listener made ahead on credit, if there is one (see :class:`Credit`)."""
        return None if self._credit is None else self._credit.take_spare(size)

    def bind(self, buffer_id: int, sizes: list[int], runs: list[tuple[int, int]], made: list[Any],
             fds: list[int]) -> bool:
        """Tell the daemon that the chunks ``made`` here (:meth:`Mapper.make`) back ``buffer_id``, one per
        ``(offset, size)`` of ``runs``, its segments grown to ``sizes``, paid from the credit.

        ``fds`` holds each chunk's FD where it was exported already (a
        spare's) and -1 where it is exported here, in its place. Call it once
        they are mapped, before the commit returns: once it returns True the
        daemon will record them (or, for chunks that are not what they
        claim, refuse them) before anything else this session asks, or its
        end, and keeps them past this process; the FDs are then this client's.
        False: the credit is short, or the daemon had gone away and the
        session is resumed now; nothing was bound (unmap them, close the FDs
        and commit through the daemon instead).
        """
        for i, prepared in enumerate(made):
            if fds[i] < 0:
                fds[i] = self.mapper.export(prepared)
        bind = OwnChunks(buffer_id, list(sizes), [offset for offset, _ in runs], [size for _, size in runs])
        ahead = bind.chunk_sizes[0] if len(runs) == 1 else 0
        try:
            sent = self._credit.spend(sum(bind.chunk_sizes), lambda: self._handles.send(bind, fds), ahead)
        except SessionLost:
            self._resume(time.monotonic() + self.resume_timeout)
            return False
        if sent:
            # Kept until the daemon is known to have read the bind: a daemon that went before may need it again.
            self._unconfirmed_sent(bind, fds)
        return sent

    def discard_leased(self, taken: list[LeasedGranule]) -> None:
        """Let go of placed granules' imports: the mappings made from them hold the memory."""
        for granule in taken:
            self.mapper.discard(granule.prepared)

    @property
    def leased_granules(self) -> int:
        """Leased granules ready in this process."""
        return 0 if self._lease is None else len(self._lease)

    @property
    def exclusive(self) -> threading.RLock:
        """Held by every call; hold it across steps that must not interleave with another thread's calls."""
        return self._lock

    def _listen_in_background(self) -> None:
        if self._listener is None:
            self._listener = threading.Thread(
                target=_listen, args=(weakref.ref(self), self._handles), name="hbmd-listener", daemon=True
            )
            self._listener.start()

    def _on_datagrams(self) -> None:
        """On the listener thread: serve the leases and reclaim requests that arrived, and make the next chunk on
        credit ahead."""
        try:
            if self._lease is not None:
                self._lease.serve(self._handles.grants, self._handles.revokes)
            if self._credit is not None:
                self._credit.serve(self._handles.credits)
                self._credit.make_spare()
            if self._reclaim_callback is not None:
                self._answer_reclaims()
            self._serve_demotes()
        except Exception:
            if not self.closed:
                log.exception("the hbmd listener thread failed on a datagram")

    # reclaim

    def reclaim(self, session_id: int, num_bytes: int) -> ReclaimSent:
        """Ask session ``session_id`` to give ``num_bytes`` back (what ``hbmctl reclaim`` does)."""
        return self.call(Reclaim(session_id, num_bytes))

    def on_reclaim(self, callback: Callable[[ReclaimRequest], int]) -> None:
        """Answer the daemon's reclaim requests with ``callback``, on a background thread.

        ``callback(request)`` decides what to release (``request.bytes`` is
        what the daemon would like back) and returns the bytes it released;
        the client reports that to the daemon. It runs on the listener thread,
        so the engine synchronises what it touches; client calls from it are
        serialised with the engine's own.
        """
        self._reclaim_callback = callback
        self._listen_in_background()

    def pending_reclaims(self) -> list[ReclaimRequest]:
        """Reclaim requests received and not yet answered, for engines that poll instead of registering a callback.

        Answer each with :meth:`answer_reclaim`.
        """
        if self._listener is None:
            self._handles.poll(0)
        requests: list[ReclaimRequest] = []
        while True:
            try:
                # One at a time: the listener thread may file another between a copy and a clear.
                requests.append(self._handles.reclaims.popleft())
            except IndexError:
                return requests

    def answer_reclaim(self, request: ReclaimRequest, released_bytes: int) -> None:
        self.call(ReclaimDone(request.reclaim_id, released_bytes))

    def _serve_demotes(self) -> None:
        """Answer the daemon's requests to demote buffers (another tenant's commit waits for the room): the buffers
        this process maps go to the host tier, oldest first, until the bytes asked for have moved; and promote them
        back when the daemon says the device has room again. The daemon asks only clients of tenants configured to be
        demoted, when idle; their engines need do nothing."""
        while True:
            try:
                request = self._handles.demotes.popleft()
            except IndexError:
                return
            moved = 0
            with self._lock:  # the engine's own calls wait; its kernels keep running on the same addresses
                for holder in sorted(self._holders, key=lambda h: h.buffer_id):
                    if isinstance(request, ReclaimRequest) and moved >= request.bytes:
                        break
                    try:
                        if isinstance(request, ReclaimRequest):
                            moved += holder._demote_under_pressure()
                        else:
                            moved += holder._promote_after_pressure()
                    except HbmdError as exc:
                        log.warning("moving buffer %d for the daemon failed: %s", holder.buffer_id, exc)
            if isinstance(request, ReclaimRequest):
                log.info("demoted %d bytes to the host tier for the daemon (%s)", moved, request.reason)
                try:
                    self.answer_reclaim(request, moved)
                except NotFound:
                    # Asked by a daemon since restarted, which keeps no reclaim: nobody waits for the answer. The
                    # requests queued behind it (a promote, say) are served all the same.
                    log.debug("the daemon that asked for reclaim %d is gone: answer dropped", request.reclaim_id)
            else:
                log.info("promoted %d bytes back to the device: the daemon has room again", moved)

    def _answer_reclaims(self) -> None:
        for request in self.pending_reclaims():
            try:
                released = int(self._reclaim_callback(request))
                self.answer_reclaim(request, released)
            except Exception:
                log.exception("reclaim callback for %d bytes failed", request.bytes)

    def device_memory(self) -> DeviceMemory:
        """What an engine sizes its KV cache from after warm-up (all in bytes).

        ``free`` is the device's free memory (NVML on a GPU, no context needed;
        ``MemAvailable`` on the host; -1 where unknown), ``committed`` what
        hbmd has committed for every session, ``budget_left`` what more the
        daemon will admit for this session (its tenant's maximum and others'
        guaranteed minimums counted).
        """
        return DeviceMemory.of(self.status())

    def release(self, buffer_id: int) -> Released:
        return self.call(Release(buffer_id))

    def free(self, buffer_id: int) -> Freed:
        return self.call(Free(buffer_id))

    def close(self) -> None:
        """End the session: the daemon frees its anonymous buffers."""
        if not self.closed:
            self.closed = True
            if self._listener is not None and self._listener is not threading.current_thread():
                self._handles.shut()  # wakes the listener at once: its socket reads EOF
                self._listener.join()
            with self._lock:
                self._control.close()
                self._handles.close()
                if self._closer is not None:
                    self._closer.stop()
                if self._lease is not None:
                    self._lease.close()
                if self._credit is not None:
                    self._credit.close()

    def _let_go_after_fork(self) -> None:
        """In a forked child: close the inherited handle socket, so the child never keeps the parent's session.

        Only the raw socket: the ZeroMQ one belongs to a context that must
        not be touched after fork. The client counts as closed here.
        """
        self.closed = True
        self._handles.close()

    @property
    def lost(self) -> bool:
        """Whether the daemon went away: it may come back and the session resume (:meth:`resumed`), or not, and every
        call then raises ``SessionLost``."""
        return not self.closed and (self._lost is not None or self._handles.lost())

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _listen(client_ref: "weakref.ref[Client]", handles: HandleChannel) -> None:
    """The listener thread's loop; it holds its client only while serving what arrived.

    When the daemon goes away it takes the session back as soon as the
    daemon serves again (a new listener goes on then), so a restart is
    over before the engine's next call, however long that is.
    """
    while handles.poll(0.2):
        client = client_ref()
        if client is None or client.closed:
            return
        client._on_datagrams()
        del client
    client = client_ref()
    gone = client is not None and not client.closed and client._handles is handles and client._credential
    if gone and not client.resumed() and not client.closed:
        log.warning("%s", client._lost)


def _replies_with_fds(hello: Hello, welcome: Welcome) -> bool:
    """Whether a commit's reply rides with its FDs: the client's hellos ask for it, and the daemon of this welcome
    knows to (1.7)."""
    return hello.replies_with_fds and tuple(welcome.version) >= (1, 7)


def _alive(client_ref: "weakref.ref[Client]") -> Client:
    client = client_ref()
    if client is None:
        raise ReferenceError("the hbmd client is gone")
    return client


_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()
"""Every client of this process, for the fork hook."""


def _let_go_after_fork() -> None:
    for client in list(_clients):
        client._let_go_after_fork()


os.register_at_fork(after_in_child=_let_go_after_fork)


def resume_timeout_from_env() -> float:
    """``HBMD_RESUME_TIMEOUT`` in seconds (default :data:`RESUME_TIMEOUT_S`; 0: never wait)."""
    return _number_from_env("HBMD_RESUME_TIMEOUT", RESUME_TIMEOUT_S, "seconds")


def spin_from_env() -> float:
    """``HBMD_SPIN_US``, in seconds: how long a call polls for its reply before it sleeps (default
    :data:`~hbmd.client.transport.SPIN_S`; 0: never poll)."""
    return _number_from_env("HBMD_SPIN_US", SPIN_S * 1e6, "microseconds") / 1e6


def _number_from_env(name: str, default: float, unit: str) -> float:
    """``$name``, a number of ``unit``, 0 or more (``default`` where unset); ``ValueError`` naming it otherwise."""
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (0 <= value < float("inf")):
        raise ValueError(f"{name}={text!r} is not a number of {unit}, 0 or more")
    return value


def _program_name() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"


def instance_for(device: Any, run_dir: str | os.PathLike | None) -> str:
    """The instance that serves ``device`` under ``run_dir``."""
    kind, index = parse_device(device)
    if kind == "cpu":
        return "host"
    from hbmd.driver import CudaUnavailable

    from .cuda import instance_for_cuda_device

    try:
        return instance_for_cuda_device(index, run_dir)
    except CudaUnavailable as exc:
        # A host instance may well be what this user meant to reach: its device is "cpu".
        if "host" not in list_instances(run_dir):
            raise
        raise CudaUnavailable(
            f"{exc}; an hbmd host instance serves under {resolve_run_dir(run_dir)}: device 'cpu' uses it"
        ) from None


def connect(
    device: Any = None,
    run_dir: str | os.PathLike | None = None,
    *,
    instance: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    client_name: str = "",
    tenant: str | None = None,
    observer: bool = False,
    mapper: Mapper | None = None,
    lease: bool = True,
    resume_timeout: float | None = None,
) -> Client:
    """Open a session with the daemon serving ``device`` (or the named ``instance``: ``gpu0``, ``host``, ...).

    ``run_dir`` defaults to ``$HBMD_RUN_DIR``, then ``/run/hbmd``; ``tenant``
    to ``$HBMD_TENANT``, then none; ``resume_timeout`` to
    ``$HBMD_RESUME_TIMEOUT``, then 30 s (see :class:`Client`). Raises
    :class:`DaemonUnavailable` when nothing answers there.
    """
    if instance is None:
        instance = instance_for(device, run_dir)
    paths = InstancePaths.of(run_dir, instance)
    return Client(
        paths, timeout=timeout, client_name=client_name, tenant=tenant, observer=observer, mapper=mapper, lease=lease,
        resume_timeout=resume_timeout,
    )


_defaults: dict[tuple[str, str], Client] = {}


def default_client(device: Any) -> Client:
    """The process-wide client for ``device``'s instance, connected on first use, and again after fork or once the
    daemon came back without its session (the next tensor gets a new session, not ``SessionLost``)."""
    instance = instance_for(device, None)
    key = (os.fspath(resolve_run_dir(None)), instance)
    client = _defaults.get(key)
    if client is None or client.closed or client._pid != os.getpid() or (client.lost and not client.resumed()):
        if client is not None and not client.closed and client._pid == os.getpid():
            client.close()
        client = _defaults[key] = connect(instance=instance)
    return client
