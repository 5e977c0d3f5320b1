"""``Client``: one session with one daemon instance, request by request.

The client composes parts that live in modules of their own, each given the
session's core (:mod:`~hbmd.client.core`: channels, call lock, facts) and
the parts it uses: the calls and the session going on across a daemon
restart (:mod:`~hbmd.client.recovery`), commits served from the lease and
the credit (:mod:`~hbmd.client.leasing`), the daemon's requests for room
(:mod:`~hbmd.client.pressure`) and the thread that serves what the daemon
sends unasked (:mod:`~hbmd.client.listener`). The handle socket's two
readers share it through :mod:`~hbmd.client.inbox`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
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
from hbmd.proto.errors import InvalidRequest, OutOfBudget, VersionMismatch
from hbmd.proto.instance import InstancePaths
from hbmd.proto.undo import Undo

from .budget import DeviceMemory
from .core import SessionCore
from .delivery import Delivery
from .env import resume_timeout_from_env, spin_from_env, tenant_from_env
from .leasing import Leasing, granted
from .listener import Listener
from .mapper import Mapper
from .pressure import Pressure
from .recovery import Holder, Recovery

DEFAULT_TIMEOUT_S = 10.0

log = logging.getLogger("hbmd.client")

R = TypeVar("R", bound=Message)


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
        if tenant is None:
            tenant = tenant_from_env()
        hello = Hello(list(PROTOCOL_VERSION), os.getpid(), client_name or _program_name(), tenant, observer,
                      lease and not observer, replies_with_fds=True)
        self._core = core = SessionCore(
            paths, hello, timeout=timeout, spin=spin_from_env(), mapper=mapper,
            resume_timeout=resume_timeout_from_env() if resume_timeout is None else resume_timeout,
        )
        if core.welcome.tenant_note:
            log.warning("hbmd at %s: %s", paths.directory, core.welcome.tenant_note)
        # None of the parts holds the client: one dropped unclosed is collected, and its session ends with its socket.
        leased, credit = granted(core)
        for held in (leased, credit):
            if held is not None:
                weakref.finalize(self, held.close)
        self._recovery = Recovery(core, leased, credit)
        self.leasing = Leasing(core, self._recovery, leased, credit)
        self._pressure = Pressure(core, self._recovery, self.leasing)
        self._listener = Listener(core, self._recovery, self.leasing, self._pressure)
        self._recovery.followed_by(self._listener)
        if self.leasing.on or self._recovery.credential:
            # The listener takes the session back as soon as the daemon is, idle engine or not.
            self._listener.start()

    # identity

    @property
    def paths(self) -> InstancePaths:
        return self._core.paths

    @property
    def timeout(self) -> float:
        return self._core.timeout

    @property
    def resume_timeout(self) -> float:
        """Seconds a call waits for a daemon that went away to come back (see :class:`Client`)."""
        return self._core.resume_timeout

    @property
    def welcome(self) -> Welcome:
        """The daemon's welcome of this session (the last one, where it was taken back since)."""
        return self._core.welcome

    @welcome.setter
    def welcome(self, welcome: Welcome) -> None:
        self._core.welcome = welcome

    @property
    def closed(self) -> bool:
        return self._core.closed

    @property
    def forked(self) -> bool:
        """Whether this process is a child forked from the one that opened the session (every call raises
        :class:`ForkedClient` here)."""
        return self._core.forked

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
        return self._core.control.requests_sent

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
        return self._core.mapper

    @property
    def exclusive(self) -> threading.RLock:
        """Held by every call; hold it across steps that must not interleave with another thread's calls (the lock
        order is :class:`~hbmd.client.core.SessionCore`'s)."""
        return self._core.lock

    # requests

    def call(self, msg: Request[R], timeout: float | None = None) -> R:
        """Send any request and return its reply, typed by the request; the daemon's refusal is raised.

        Requests whose reply brings chunk FDs (:class:`Committed`) go through
        :meth:`commit`, :meth:`attach`, :meth:`defragment` or :meth:`remap`
        instead, which deliver them.
        """
        return self._recovery.call(msg, timeout)

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
        ``buffer_id`` of as many segments, each chunk at the same offset of its segment; the delivery brings them all
        (see :class:`~hbmd.proto.Graft`)."""
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
        core = self._core
        core.lock.acquire()  # the delivery releases it once its batches are in
        with Undo() as undo:
            undo.push(core.lock.release)
            try:
                reply, request_id = self._recovery.call_with_id(msg)
            except OutOfBudget as exc:
                reply, request_id = self._pressure.call_after_refusal(msg, exc)
            return Delivery(reply, request_id, core.handles.inbox, core.fd_closer(), core.timeout, core.lock)

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
        if not self._listener.running:
            self._core.handles.inbox.poll(0)
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
        return self._recovery.resumed()

    @property
    def lost(self) -> bool:
        """Whether the daemon went away: it may come back and the session resume (:meth:`resumed`), or not, and every
        call then raises ``SessionLost``."""
        core = self._core
        return not core.closed and (self._recovery.lost is not None or core.handles.lost())

    def close(self) -> None:
        """End the session: the daemon frees its anonymous buffers."""
        core = self._core
        if not core.closed:
            core.closed = True
            self._listener.stop()
            with core.lock:
                core.close()
                self.leasing.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _program_name() -> str:
    return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
