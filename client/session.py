"""``Client``: one session with one daemon instance, request by request.

What goes on around the requests lives in modules of its own: the handle socket's
two readers (:mod:`~hbmd.client.inbox`), commits served from the lease and
the credit (:mod:`~hbmd.client.leasing`), the session going on across a
daemon restart (:mod:`~hbmd.client.recovery`), and the daemon's requests
for room (:mod:`~hbmd.client.pressure`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

from hbmd.proto import (
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
    Graft,
    Hello,
    ListBuffers,
    ListSessions,
    Message,
    Move,
    Reclaim,
    ReclaimRequest,
    ReclaimSent,
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
    HbmdError,
    InvalidRequest,
    OutOfBudget,
    PermissionDenied,
    SessionLost,
    VersionMismatch,
)
from hbmd.proto.instance import InstancePaths
from hbmd.proto.undo import Undo

from .budget import DeviceMemory
from .delivery import Delivery
from .env import resume_timeout_from_env, spin_from_env, tenant_from_env
from .leasing import Leasing
from .listener import Listener
from .mapper import Mapper
from .pressure import Pressure
from .recovery import Holder, Recovery
from .transport import ControlChannel, FdCloser, HandleChannel

DEFAULT_TIMEOUT_S = 10.0

log = logging.getLogger("hbmd.client")

R = TypeVar("R", bound=Message)


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
    restarted cold, with nothing holding its memory: no systemd FD store, no
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
            tenant = tenant_from_env()
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
        self._listener = Listener(self)
        self._closer: FdCloser | None = None
        # None of these holds the client: one dropped unclosed is collected, and its session ends with its socket.
        self._recovery = Recovery(self, self.welcome.resume_credential)
        self.leasing = Leasing(self)
        self._pressure = Pressure(self)
        if self.leasing.on or self._recovery.credential:
            # The listener takes the session back as soon as the daemon is, idle engine or not.
            self._listener.start()
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
    def leased_granules(self) -> int:
        """Leased granules ready in this process."""
        return self.leasing.granules

    @property
    def started_over(self) -> int:
        """How many times the session started over on a daemon that had kept nothing of it (see :class:`Client`)."""
        return self._recovery.started_over

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

    @property
    def exclusive(self) -> threading.RLock:
        """Held by every call; hold it across steps that must not interleave with another thread's calls."""
        return self._lock

    # requests

    def call(self, msg: Request[R], timeout: float | None = None) -> R:
        """Send any request and return its reply, typed by the request; the daemon's refusal is raised.

        Requests whose reply brings chunk FDs (:class:`Committed`) go through
        :meth:`commit`, :meth:`attach`, :meth:`defragment` or :meth:`remap`
        instead, which deliver them.
        """
        return self._call_with_id(msg, timeout)[0]

    def _call_with_id(self, msg: Request[R], timeout: float | None = None) -> tuple[R, int]:
        """:meth:`call`, and the id the request went under. Where the daemon went away, the session is taken back
        (:meth:`Recovery.resume`) and the request sent again under the same id."""
        self._check_not_forked()
        if self.closed:
            raise HbmdError("this hbmd client is closed")
        with self._lock:
            request_id = self._control.next_request_id()
            deadline = None
            while True:
                msg = self._recovery.addressed(msg)
                unconfirmed = len(self._recovery.unconfirmed)
                try:
                    answer = self._control.call_with_id(msg, timeout, request_id)
                except (SessionLost, PermissionDenied) as exc:
                    # The daemon issued the token: if it no longer knows it, the daemon restarted or ended the session.
                    if isinstance(exc, PermissionDenied) and exc.details.get("token") != "unknown":
                        raise
                    deadline = deadline or time.monotonic() + self.resume_timeout
                    self._recovery.resume(deadline)
                    continue  # the same request, under the same id (and the buffer's new one, if it moved)
                self._recovery.confirmed(unconfirmed)  # the daemon read them before it answered
                return answer

    def status(self) -> StatusReply:
        return self.call(Status())

    def sessions(self, session_id: int = -1) -> list[SessionInfo]:
        """The live sessions this session may see (its own user's; an admin's, all), or ``session_id`` alone; asked
        for page by page."""
        sessions: list[SessionInfo] = []
        while True:
            page = self.call(ListSessions(after=sessions[-1].session_id if sessions else 0, session_id=session_id))
            sessions += page.sessions
            if not (page.more and page.sessions):
                # A daemon before 1.10 sends every session and no filter: it is applied here too.
                return [s for s in sessions if session_id in (-1, s.session_id)]

    def buffers(self, session_id: int = -1, *, name: str = "", owner_uid: int = -1) -> list[BufferInfo]:
        """The buffers this session may see, every one or session ``session_id``'s, only those named ``name``
        (where not empty) of user ``owner_uid`` (where not -1); asked for page by page."""
        buffers: list[BufferInfo] = []
        while True:
            after = buffers[-1].buffer_id if buffers else 0
            page = self.call(ListBuffers(session_id, after=after, name=name, owner_uid=owner_uid))
            buffers += page.buffers
            if not (page.more and page.buffers):
                # A daemon before 1.10 sends every buffer and no filter: it is applied here too.
                return [b for b in buffers if name in ("", b.name) and owner_uid in (-1, b.owner_uid)]

    def create_buffer(
        self,
        capacity: int,
        num_segments: int = 1,
        *,
        name: str = "",
        persistent: bool = False,
        shareable: bool = False,
        segment_capacities: list[int] | None = None,
        keep_orphan_s: float = 0.0,
    ) -> BufferInfo:
        """Reserve a buffer of ``num_segments`` equal segments, or of the uneven ``segment_capacities``; a persistent
        one is freed by the daemon ``keep_orphan_s`` seconds after it becomes an orphan (0: kept until deleted)."""
        if segment_capacities:
            self._need_minor(1, "uneven segments")
        if keep_orphan_s:
            self._need_minor(11, "orphans' grace periods")
        return self.call(CreateBuffer(capacity, num_segments, name, persistent, shareable,
                                      list(segment_capacities or []), float(keep_orphan_s))).buffer

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

    def graft(self, buffer_id: int, name: str) -> Delivery:
        """Take every chunk of this user's orphaned persistent buffer ``name`` into this session's empty buffer
        ``buffer_id`` of the same layout, at the same offsets; the delivery brings them all (see
        :class:`~hbmd.proto.Graft`)."""
        self._need_minor(11, "grafts")
        return self._deliver(Graft(buffer_id, name))

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
        """Ask for the buffer's chunks in ``tier`` (``"host"``: demote, ``"device"``: promote).

        The delivery brings them, none where the buffer is there already. Finish with :meth:`finish_defragment`.
        """
        self._need_minor(6, "demote and promote")
        return self._deliver(Move(buffer_id, tier))

    def remap(self, buffer_id: int) -> Delivery:
        """Every chunk of the buffer again, as the daemon records it: the way back after a failed map."""
        return self._deliver(Remap(buffer_id))

    def detach(self, buffer_id: int, readonly: bool = False) -> Detached:
        """Let go of this session's persistent buffer without freeing it.

        Any session of this user attaches it again by name. Finish writing it
        first: another session may attach it as soon as this returns. Unmap it
        then: the memory stays with the daemon, not with this process. An
        anonymous buffer is refused (:class:`InvalidRequest`).
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

        A request the budget refuses is sent again as
        :meth:`Pressure.call_after_refusal` says: with the lease given back,
        then while other tenants' idle buffers are being demoted for it.
        """
        self._lock.acquire()  # the delivery releases it once its batches are in
        with Undo() as undo:
            undo.push(self._lock.release)
            try:
                reply, request_id = self._call_with_id(msg)
            except OutOfBudget as exc:
                reply, request_id = self._pressure.call_after_refusal(msg, exc)
            return Delivery(reply, request_id, self._handles.inbox, self._fd_closer(), self.timeout, self._lock)

    def release(self, buffer_id: int) -> Released:
        return self.call(Release(buffer_id))

    def free(self, buffer_id: int) -> Freed:
        return self.call(Free(buffer_id))

    def device_memory(self) -> DeviceMemory:
        """What an engine sizes its KV cache from after warm-up (all in bytes).

        ``free`` is the device's free memory (NVML on a GPU, no context needed;
        ``MemAvailable`` on the host; -1 where unknown), ``committed`` what
        hbmd has committed for every session, ``budget_left`` what more the
        daemon will admit for this session (its tenant's maximum and others'
        guaranteed minimums counted).
        """
        return DeviceMemory.of(self.status())

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
        self._pressure.callback = callback
        self._listener.start()

    def pending_reclaims(self) -> list[ReclaimRequest]:
        """Reclaim requests received and not yet answered, for engines that poll instead of registering a callback.

        Answer each with :meth:`answer_reclaim`.
        """
        return self._pressure.pending()

    def answer_reclaim(self, request: ReclaimRequest, released_bytes: int) -> None:
        self._pressure.answer(request, released_bytes)

    # what maps the session's buffers here

    def holds(self, holder: Holder) -> None:
        """``holder`` maps a buffer of this session here: declare it again should the session have to start over."""
        self._recovery.holders.add(holder)

    def lets_go(self, holder: Holder) -> None:
        """``holder`` maps nothing of this session any more."""
        self._recovery.holders.discard(holder)

    # the session across restarts

    def resumed(self) -> bool:
        """Take the session back now if the daemon went away (waiting up to :attr:`resume_timeout`); False where it
        cannot be (see :attr:`lost`)."""
        with self._lock:
            if self.closed or os.getpid() != self._pid:
                return False
            if not self._handles.lost():
                return self._recovery.lost is None
            try:
                self._recovery.resume(time.monotonic() + self.resume_timeout)
            except SessionLost:
                return False
            return True

    @property
    def lost(self) -> bool:
        """Whether the daemon went away: it may come back and the session resume (:meth:`resumed`), or not, and every
        call then raises ``SessionLost``."""
        return not self.closed and (self._recovery.lost is not None or self._handles.lost())

    def _go_on(self, handles: HandleChannel, welcome: Welcome) -> None:
        """Speak to the daemon that took the session back (or started it over) through ``handles``, as ``welcome``
        says."""
        self._handles = handles
        self._control.resume(welcome.token, handles, _replies_with_fds(self._hello, welcome))
        self.welcome = welcome

    def _fd_closer(self) -> FdCloser:
        if self._closer is None:
            self._closer = FdCloser()
        return self._closer

    def _check_not_forked(self) -> None:
        """Raise :class:`ForkedClient` in a process forked from this client's: the session is the parent's."""
        if os.getpid() != self._pid:
            raise ForkedClient(
                "this hbmd client belongs to the parent process; call hbmd.client.connect() in the child"
            )

    def close(self) -> None:
        """End the session: the daemon frees its anonymous buffers."""
        if not self.closed:
            self.closed = True
            self._listener.stop(self._handles)
            with self._lock:
                self._control.close()
                self._handles.close()
                if self._closer is not None:
                    self._closer.stop()
                self.leasing.close()

    def _let_go_after_fork(self) -> None:
        """In a forked child: close the inherited handle socket, so the child never keeps the parent's session.

        Only the raw socket: the ZeroMQ one belongs to a context that must
        not be touched after fork. The client counts as closed here.
        """
        self.closed = True
        self._handles.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _replies_with_fds(hello: Hello, welcome: Welcome) -> bool:
    """Whether a commit's reply rides with its FDs: the client's hellos ask for it, and the daemon of this welcome
    knows to (1.7)."""
    return hello.replies_with_fds and tuple(welcome.version) >= (1, 7)


_clients: weakref.WeakSet[Client] = weakref.WeakSet()
"""Every client of this process, for the fork hook."""


def _let_go_after_fork() -> None:
    for client in list(_clients):
        client._let_go_after_fork()


os.register_at_fork(after_in_child=_let_go_after_fork)


def _program_name() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
