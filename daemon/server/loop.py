"""The server's loop: bind the instance's sockets, publish it, poll, dispatch control requests, stop and clean up.

One thread runs the loop, so requests run one at a time, each to completion
before the next starts; admission needs no lock of its own. Other threads
do read and change the state: a metrics scrape (``metrics.py``) and the
SIGHUP config reload (``reload.py``). So the loop holds :attr:`Server.lock`
while it handles a batch of events, and they take it too: they see and
change the state between two batches, never in the middle of a request.
The server decodes, checks the session token, calls the :class:`State` and
encodes the reply; it never calls the driver itself.

Every turn of the loop is bounded: signals, new connections and hellos are
served each turn, then each session's datagrams and the control requests,
each only for a share of work (``WORK_PER_TURN_S`` per session,
:data:`CONTROL_WORK_PER_TURN_S` for the control plane), and last the lease
top-ups (``TOP_UP_WORK_PER_TURN_S``); what is left waits for the next turn,
which follows at once. So a peer flooding either plane delays itself,
SIGTERM is honoured within a turn, and the systemd watchdog, fed once per
turn, is fed as long as the loop truly turns. A request whose own session
still has datagrams unread that way waits for them, over later turns: it
must see every placement and bind its client sent before it, or it would
back again what the client has already mapped and written.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Generic

from hbmd.proto import (
    MAX_REQUEST_BYTES,
    MAX_SEGMENTS,
    PROTOCOL_VERSION,
    Committed,
    ErrorReply,
    Message,
    Redeclare,
    Request,
    decode_body,
    encode_frames,
    peek_request_id,
    read_envelope,
    requests,
)
from hbmd.proto.errors import HbmdError, InternalError, InvalidRequest, OutOfBudget, ProtocolError
from hbmd.proto.instance import VERSION, InstanceInfo, InstancePaths

from ..backends import A, C
from ..notify import SystemdNotifier
from ..restart.persist import RESUME_WINDOW_S, Persistence, chunk_fds, image_of, pack_image
from ..restart.takeover import HANDOVER_TIMEOUT_S, TakeoverError, TakeoverListener
from ..rundir import create_file, open_instance_directory, open_lock, pass_line, resume_key
from ..state import Answer, Session, State
from .admin import AdminRequests
from .buffers import BufferRequests
from .connection import HandleConnection
from .control import ControlQueue
from .control_socket import ControlSocket
from .device_lock import DeviceLock, DeviceTaken
from .handles import HandlePlane
from .listening import ListeningSockets
from .outbox import DRAIN_CHECK_S
from .ratelimit import RateLimitedLog
from .registry import RequestHandlers, handler_table
from .session import SessionNotices, SessionRequests

if TYPE_CHECKING:  # an optional collaborator: prometheus_client loads only when metrics are asked for
    from ..metrics import Metrics

CONTROL_WORK_PER_TURN_S = 0.02
"""Seconds of control requests served in one turn of the loop at most; those left wait for the next turn, after the
handle plane, new connections, hellos and signals have been seen to. A turn answers one request of each peer waiting
(:class:`ControlQueue`: a peer is a process, however many connections it opens, and uids take turns), so a peer
pipelining requests gets one served, then every other waiting peer gets one: a flood delays its sender, others wait
at most for the one of its requests being answered (tests/test_flood.py)."""

TIMERS_EVERY_S = 0.005
"""How often the loop looks for what time alone makes due: idle leases, hello and resume timeouts, ignored reclaims,
promotes. Each look walks every session, and a loop answering requests turns twice for each; what it looks for waits
seconds."""

log = logging.getLogger("hbmd.server")


class _Behind(Exception):
    """The asking session's own datagrams are not all read yet (its turn's share of work ran out): its request waits
    for them, so that it sees every placement and bind its client sent before it."""


class AlreadyRunning(RuntimeError):
    """Another daemon holds the instance's lock."""


class InvariantViolated(RuntimeError):
    """An invariant of the state does not hold (``check_invariants``): a bug in the daemon, which must stop serving."""


class Server(Generic[A, C]):
    """Serves one :class:`State` on one instance directory until :meth:`stop`."""

    HANDLER_CLASSES: tuple[type[RequestHandlers], ...] = (AdminRequests, BufferRequests, SessionRequests)
    """The request handlers, one class per protocol family; together they answer every request once."""

    def __init__(
        self,
        state: State[A, C],
        paths: InstancePaths,
        *,
        lock: threading.Lock,
        notifier: SystemdNotifier | None = None,
        group: int | None = None,
        metrics: Metrics | None = None,
        persistence: Persistence | None = None,
        check_invariants: bool = False,
        resume_window_s: float = RESUME_WINDOW_S,
        device_lock: DeviceLock | None = None,
        listening: ListeningSockets | None = None,
    ) -> None:
        """Raises :class:`HandlerTableError` when a request of the protocol has no handler here.

        ``lock`` is held while the loop touches the state, so a metrics scrape
        or a config reload on another thread sees it whole. ``check_invariants``:
        check the state's invariants after every batch of events, and stop with
        :class:`InvariantViolated` where one does not hold (tests). ``resume_window_s``: how long sessions
        handed over to a successor wait for their clients (here too, should it fail). ``device_lock``: the lock of
        the GPU or of host memory (one daemon of each), taken and let go with the instance's own. ``listening``: the
        listening sockets handed over or passed in, served on instead of binding new ones.
        """
        table = handler_table(self.HANDLER_CLASSES, requests())
        self.state = state
        self.paths = paths
        self.group = group
        self.lock = lock
        self.metrics = metrics
        self.persistence = persistence
        self.check_invariants = check_invariants
        self.resume_window_s = resume_window_s
        self.device_lock = device_lock
        self._notifier = notifier if notifier is not None else SystemdNotifier(None)
        interval = self._notifier.watchdog_interval
        self._idle_ms = 1000.0 if interval is None else min(1000.0, interval * 1000)
        """How long an idle loop waits for an event: a second, or less where the watchdog wants keep-alives more
        often (with ``WatchdogSec=1`` an idle loop fed it every second, at its limit)."""
        self._stopping = False
        self._timers_at = 0.0
        """When the loop last looked for what time makes due (the state's monotonic clock; :data:`TIMERS_EVERY_S`)."""
        self.handed_over = False
        """A successor serves in this daemon's place: it stopped for that."""
        self._lock_fd = -1
        self._dir_fd = -1
        self._control: ControlSocket | None = None
        self._listening = listening
        self._requests = ControlQueue()
        """Control requests read from the control socket, waiting for their peer's turn."""
        self._waiting: dict[int, tuple[bytes, list[bytes]]] = {}
        """Requests waiting for their session's datagrams (:class:`_Behind`), by session id: one each at most."""
        self._successors: TakeoverListener | None = None
        self._wake_r = self._wake_w = -1
        self._signals_installed = False
        journal = persistence.sync if persistence is not None else lambda: None
        self._plane: HandlePlane[A, C] = HandlePlane(state, journal)
        self._poller = select.poll()
        """The loop's one poll: the handle plane's and the control socket's epolls, the takeover listener, the wake
        pipe and the device lock, each a descriptor (the daemon speaks ZMTP itself; pyzmq is its clients')."""
        self._poller.register(self._plane.descriptors.fileno(), select.POLLIN)
        self._notices: SessionNotices[A, C] = SessionNotices(state, self._plane, journal)
        self._refusals = RateLimitedLog(log)
        handlers = {cls: cls(state, self._plane) for cls in self.HANDLER_CLASSES}
        buffer_requests = handlers[BufferRequests]
        assert isinstance(buffer_requests, BufferRequests)
        self._buffer_requests = buffer_requests
        self._handlers: dict[type[Request], Callable[..., Message]] = {
            kind: getattr(handlers[cls], name) for kind, (cls, name) in table.items()
        }

    # lifecycle

    def bind(self) -> None:
        """Take the instance lock and bind both sockets.

        Raises ``RunDirectoryError`` where someone else could change the
        instance directory, :class:`AlreadyRunning` where another daemon serves
        it or (in another run directory) its GPU.
        """
        self.paths.check_lengths()
        self._dir_fd = open_instance_directory(self.paths.directory, self.group)
        self._lock_fd = open_lock(self._dir_fd, self.paths.lock.name)
        try:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise AlreadyRunning(self._instance_held()) from None
            # Who holds the instance, for the refusal of the next daemon to try.
            os.ftruncate(self._lock_fd, 0)
            os.pwrite(self._lock_fd, f"{os.getpid()}\n".encode(), 0)
            self._lock_device()
        except (AlreadyRunning, DeviceTaken, OSError) as exc:
            os.close(self._lock_fd)
            os.close(self._dir_fd)
            self._lock_fd = self._dir_fd = -1
            if isinstance(exc, DeviceTaken):
                raise AlreadyRunning(str(exc)) from None
            raise
        credentials = self.state.sessions.credentials
        credentials.use_key(resume_key(self._dir_fd), pass_line(self._dir_fd, credentials.line))
        for stale in (self.paths.info, self._info_tmp):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale.name, dir_fd=self._dir_fd)
        self._listening = ListeningSockets.serve(self._listening, self.paths, self._dir_fd, self.group)
        self._control = ControlSocket()
        self._control.listen(self._listening.control)
        self._poller.register(self._control.fileno(), select.POLLIN)
        self._plane.listen(self._listening.handles)
        self._successors = TakeoverListener(PROTOCOL_VERSION[0])
        self._successors.bind(self.paths.takeover)
        self._poller.register(self._successors.fileno(), select.POLLIN)

        if self._wake_r < 0:
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._poller.register(self._wake_r, select.POLLIN)

    def _instance_held(self) -> str:
        """The refusal of a daemon that finds the instance locked, naming the daemon that holds it where it says."""
        pid = os.pread(self._lock_fd, 32, 0).decode(errors="replace").strip()
        holder = f" (pid {pid})" if pid.isdigit() else ""
        return (f"another hbmd{holder} is already serving {self.paths.directory}: stop it, or start this one with "
                "--takeover to take its place")

    def _lock_device(self) -> None:
        """Take the lock of what this daemon serves (:class:`DeviceTaken` where another daemon holds it), and answer
        those that ask who holds it from the loop."""
        if self.device_lock is None or self.device_lock.held:
            return
        self.device_lock.acquire(self.paths.directory.parent)
        if self.device_lock.unshared:
            log.debug("locked %s by the name %s only, seen in this network namespace (%s)",
                      self.device_lock.device_uuid or "host memory", self.device_lock.name,
                      self.device_lock.unshared)
        self._poller.register(self.device_lock.fileno(), select.POLLIN)

    @property
    def _info_tmp(self) -> Path:
        return self.paths.info.with_suffix(".tmp")

    def publish(self) -> None:
        """Write ``instance.json``: clients and tools find the instance by it, so it comes once all is up."""
        backend = self.state.backend
        info = InstanceInfo(
            instance=backend.instance,
            backend=backend.name,
            device_index=backend.device_index,
            device_uuid=backend.device_uuid,
            pid=os.getpid(),
            protocol=list(PROTOCOL_VERSION),
            daemon_version=VERSION,
            control=self.paths.endpoint,
            handles=os.fspath(self.paths.handles),
        )
        fd = create_file(self._dir_fd, self._info_tmp.name, 0o644, self.group)
        with os.fdopen(fd, "w") as tmp:
            tmp.write(info.to_json())
        os.replace(self._info_tmp.name, self.paths.info.name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the loop; the wake pipe interrupts the poll."""
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._signals_installed = True
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def stop(self) -> None:
        """Make :meth:`run` return after the batch of events it is handling."""
        self._stopping = True

    def run(self) -> None:
        """Serve until :meth:`stop`; raises :class:`InvariantViolated` as soon as ``check_invariants`` finds them so."""
        idle_work = True
        while not self._stopping:
            unread = self._control is not None and self._control.pending
            busy = idle_work or self._waiting or self._requests or unread or self.state.leases.due
            timeout = 0 if busy else DRAIN_CHECK_S * 1000 if self._plane.outbox.holding else self._idle_ms
            events = self._ready(timeout)
            with self.lock:
                self._plane.new_turn()
                for fd, _ in events:
                    try:
                        self._on_event(fd)
                    except Exception:
                        # A bug met by one peer's input must not stop the daemon for every other.
                        log.exception("handling an event on descriptor %d failed", fd)
                if unread and not any(self._is_control(fd) for fd, _ in events):
                    # What the last turn left unread is read whether or not the poll found the socket ready.
                    self._read_control()
                # Control requests last: a request sees every session the same turn of the loop ended (a worker that
                # exited just before its peer asked for status is gone from the status).
                if self._requests:
                    self._answer_requests()
                if self._waiting:
                    self._answer_waiting()
                self._look_after_sessions()
                if self.check_invariants and events:
                    self._check_invariants()
                if self.persistence is not None:
                    self.persistence.sync()
                idle_work = self._idle() if not events else True
            # Fed here only, once per turn, and every turn is bounded: a loop that stops turning stops feeding it.
            self._notifier.watchdog()

    def took_over(self) -> None:
        """The daemon taken over from was told this one serves: the sockets it gave are this one's to remove."""
        if self._listening is not None:
            self._listening.owned = True

    def close(self) -> None:
        """Hang up on every session, drop the sockets, files and lock."""
        self._unbind(for_good=True)
        self._plane.close_watches()
        if self._signals_installed:
            # The pipe closes below: a signal after that (a lingering daemon's SIGTERM) must not be written to it.
            signal.set_wakeup_fd(-1)
            self._signals_installed = False
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _unbind(self, for_good: bool) -> None:
        """Hang up on every session (ending none), stop accepting and let the lock go.

        ``for_good``: close the listening sockets too, and remove the files
        (theirs where they are this daemon's) while the lock is held. Else (a
        handover) they stay open and in place, and connects wait in their
        backlog for the successor, or for this daemon should it fail.
        """
        self._plane.close()
        self._waiting.clear()  # their clients send them again once they have resumed
        self._requests.clear()
        if self._control is not None:
            self._poller.unregister(self._control.fileno())
            self._control.close()
            self._control = None
        if self._successors is not None:
            self._poller.unregister(self._successors.fileno())
            self._successors.close()
            self._successors = None
        if self.device_lock is not None:
            # The GPU before the instance: a successor waiting for the instance finds the GPU free once it has it.
            if self.device_lock.held:
                self._poller.unregister(self.device_lock.fileno())
            self.device_lock.release()
        if self._lock_fd >= 0:
            # Only the daemon holding the lock may remove what it made: another one may be serving.
            for path in (self.paths.info, self.paths.takeover) if for_good else (self.paths.takeover,):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path.name, dir_fd=self._dir_fd)
        if for_good and self._listening is not None:
            self._listening.close(self._dir_fd if self._lock_fd >= 0 else -1)
            self._listening = None
        for fd in (self._lock_fd, self._dir_fd):
            if fd >= 0:
                os.close(fd)
        self._lock_fd = self._dir_fd = -1

    # the loop's steps

    def _ready(self, timeout: float) -> list[tuple[int, int]]:
        """What the poll finds ready within ``timeout`` ms: the handle plane's descriptors one by one (the poll watches
        their epoll as one), the others as they are."""
        ready: list[tuple[int, int]] = []
        for fd, events in self._poller.poll(timeout):
            if fd == self._plane.descriptors.fileno():
                ready.extend(self._plane.descriptors.ready())
            else:
                ready.append((fd, events))
        return ready

    def _is_control(self, fd: int) -> bool:
        return self._control is not None and fd == self._control.fileno()

    def _read_control(self) -> None:
        if self._control is not None:
            self._requests.read(self._control)

    def _on_event(self, fd: int) -> None:
        if self._is_control(fd):
            self._read_control()
        elif fd == self._wake_r:
            self._drain_wake()
        elif self._successors is not None and fd == self._successors.fileno():
            self._hand_over(self._successors)
        elif self.device_lock is not None and self.device_lock.held and fd == self.device_lock.fileno():
            self.device_lock.answer()
        else:
            self._plane.on_event(fd)

    def _hand_over(self, successors: TakeoverListener) -> None:
        """Hand the state and every chunk to a successor daemon asking for them (``hbmd --takeover``), and stop once it
        serves.

        The sessions are hung up on (not ended) and marked resuming, and the
        lock let go; the listening sockets go to the successor with the chunks,
        and their connects wait in the backlog meanwhile. Its clients reconnect
        to it and resume. Where it fails before it serves, this daemon takes
        the lock again and serves on: its clients resume here.
        """
        pending = successors.accept()
        if pending is None:
            return
        self._plane.take_placements()
        resume_by = self.state.clock.monotonic() + self.resume_window_s
        for session in list(self.state.sessions.by_id.values()):
            if session.observer:
                self._plane.close_connection(self._plane.by_session[session.session_id], "handing over")
        image = pack_image(image_of(self.state))
        fds = list(chunk_fds(self.state))
        log.info("handing over to pid %d: %d sessions, %d buffers, %d chunks, state of %d bytes", pending.peer_pid,
                 len(self.state.sessions.by_id), len(self.state.buffers.by_id), len(fds), len(image))
        self._unbind(for_good=False)
        for session in self.state.sessions.by_id.values():
            self.state.sessions.suspend(session, resume_by)
        listening = self._listening.named_fds() if self._listening is not None else []
        try:
            pending.hand_over(image, fds + listening, HANDOVER_TIMEOUT_S)
            served = pending.wait_serving(HANDOVER_TIMEOUT_S)
        except (TakeoverError, OSError) as exc:
            log.error("handing over to pid %d failed: %s", pending.peer_pid, exc)
            pending.refuse(str(exc))
            served = False
        finally:
            for _, fd in fds:
                os.close(fd)
        if served:
            log.info("pid %d serves in this daemon's place: stopping", pending.peer_pid)
            self.handed_over = True
            self.stop()
            return
        log.warning("pid %d did not take over: serving on; sessions resume here", pending.peer_pid)
        self.bind()
        self.publish()

    def _look_after_sessions(self) -> None:
        """What is due whatever the events were: held FDs sent on and leases topped up at every turn; idle leases asked
        back, hello-less connections closed, unresumed sessions ended, orphans past their grace period freed, ignored
        reclaims reported and buffers demoted under pressure promoted where there is room, every
        :data:`TIMERS_EVERY_S`."""
        self._plane.outbox.retry_draining()
        now = self.state.clock.monotonic()
        if now - self._timers_at >= TIMERS_EVERY_S:
            self._timers_at = now
            self.state.leases.ask_back_idle(self.state.sessions.by_id.values(), now)
            self._plane.expire_hellos(now)
            if self._control is not None:
                self._control.look_after(now)
            self._plane.end_unresumed(now)
            self.state.orphans.expire()
            self._notices.report_ignored_reclaims(now)
            self._notices.send_promotes(now)
        self._notices.serve_leases()

    def _check_invariants(self) -> None:
        try:
            self.state.check_invariants()
        except AssertionError as exc:
            raise InvariantViolated(str(exc)) from exc

    def _idle(self) -> bool:
        """One step of the backend's background work (the warm pool, the host pool); False when done or failing."""
        try:
            return self.state.idle()
        except (HbmdError, OSError) as exc:
            log.debug("background work paused: %s", exc)
            return False

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 512):
                pass
        except BlockingIOError:
            pass

    # control plane

    def _answer_requests(self) -> None:
        """Answer the control requests read, in their peers' turns, one round of turns (as many requests as peers
        wait) for :data:`CONTROL_WORK_PER_TURN_S` at most (one request at least, however long it takes); the rest
        wait, and the next poll returns at once for them. A stop asked meanwhile ends it at once.

        One round, not more: the next turn reads again, so that a request sent
        meanwhile beside a flood's is read, and answered before the flood's next.
        """
        ends = time.perf_counter() + CONTROL_WORK_PER_TURN_S
        for _ in range(self._requests.peers):
            if self._control is None or self._stopping:
                return
            identity, body = self._requests.take()
            try:
                self._answer(self._control, identity, body)
            except Exception:
                # A bug met by one peer's request must not stop the daemon for every other.
                log.exception("answering a control request failed")
            if time.perf_counter() >= ends:
                return

    def _answer(self, control: ControlSocket, identity: bytes, body: list[bytes]) -> None:
        """Answer one request of the peer ``identity``, or keep it in :attr:`_waiting` while its session is behind."""
        try:
            reply = self._dispatch(body)
        except _Behind as behind:
            self._waiting[behind.args[0]] = (identity, body)
            return
        if reply is not None:
            control.send(identity, reply)

    def _answer_waiting(self) -> None:
        """Answer the waiting requests whose sessions' datagrams have all been read since."""
        waiting, self._waiting = self._waiting, {}
        for identity, body in waiting.values():
            if self._control is not None:
                self._answer(self._control, identity, body)

    def _dispatch(self, frames: list[bytes]) -> list[bytes] | None:
        """Answer one request: the reply's frames, or None where it rides with the request's FDs on the handle socket
        (:meth:`Outbox.reply_with_fds`). What it changed is journaled before the answer and the FDs go (where the
        state is kept)."""
        started = time.perf_counter()
        request_id = 0
        operation = "invalid"
        session: Session | None = None
        conn: HandleConnection[A, C] | None = None
        fresh: Session | None = None  # the session of a change not answered yet: its answer becomes the session's last
        reply: Message | list[bytes]
        try:
            # Decoded once, within a request's bounds: a larger frame or a longer list is refused unread.
            kind, request_id, token, raw = read_envelope(frames, MAX_REQUEST_BYTES, MAX_SEGMENTS)
            if not issubclass(kind, Request):
                raise ProtocolError(f"{kind.KIND} is not a request")
            handler = self._handlers[kind]  # every request has one: the table was checked before the server was built
            operation = kind.KIND
            # The token before the body: an unknown peer costs no decoding.
            session = self.state.sessions.for_token(token)
            session.declaring = session.declaring and kind is Redeclare  # declarations come first, or not at all
            self._plane.take_placements()
            conn = self._plane.by_session[session.session_id]
            if session.session_id in self._waiting:
                raise ProtocolError("this session already has a request waiting for its datagrams; send one at a time")
            if self._plane.behind(conn):
                raise _Behind(session.session_id)
            answered = session.answer
            if answered is not None and request_id == answered.request_id >= session.last_request_id:
                reply = self._answer_again(conn, request_id, answered)
            else:
                body = decode_body(kind, raw)
                latest = max(session.last_request_id, answered.request_id if answered is not None else 0)
                if kind.changes_state and request_id < latest:
                    raise InvalidRequest(
                        f"request {request_id} of session {session.session_id} came after request {latest}: not "
                        "done (its client gave up on it)", request_id=request_id, latest=latest,
                    )
                session.last_request_id = max(session.last_request_id, request_id)
                fresh = session if kind.changes_state else None
                session.previous_credential_hash = ""  # the client speaks: it holds its last welcome's credential
                reply = handler(conn, request_id, body)
        except _Behind:
            raise  # nothing done yet: answered once the session's datagrams are read
        except OutOfBudget as exc:
            assert session is not None  # only a handler refuses for budget: the session is known
            self._log_refusal(operation, session, exc)
            reply = ErrorReply.of(exc)
        except HbmdError as exc:
            reply = ErrorReply.of(exc)
        except Exception:
            log.exception("request %d failed", request_id)
            reply = ErrorReply.of(InternalError(f"internal error handling request {request_id}; see the daemon log"))
        if not request_id:
            # Refused before its id was read: the id alone is read from the frame, so the refusal reaches its caller.
            request_id = peek_request_id(frames)
        self._notices.send_reclaims()
        self._notices.send_revokes()
        if self.metrics is not None:
            self.metrics.record(operation, reply.code if isinstance(reply, ErrorReply) else "ok", started)
        encoded: list[bytes] | None
        if isinstance(reply, list):
            encoded = reply  # the answer given before a restart, as it went then
        elif (isinstance(reply, Committed) and conn is not None
                and self._plane.outbox.reply_with_fds(conn, request_id, reply)):
            encoded = None
        else:
            encoded = encode_frames(reply, request_id)
        if fresh is not None and not fresh.observer:
            fresh.answer = (
                Answer(request_id, None, reply.buffer.buffer_id, [c.chunk_id for c in reply.chunks])
                if isinstance(reply, Committed) else Answer(request_id, encoded)
            )
        if self.persistence is not None:
            self.persistence.sync()
        if conn is not None and conn.outbox:
            self._plane.outbox.flush(conn)  # after the journal: FDs and a reply riding with them acknowledge changes
        return encoded

    def _answer_again(self, conn: HandleConnection[A, C], request_id: int, answered: Answer) -> Committed | list[bytes]:
        """A request sent again after a restart: the daemon did it before, so it answers as it did, once more: the
        frames it sent, or its chunks delivered again.

        Only the last request of a session can be sent again (its client has
        one in flight, and numbers them in order): another id is a new request.
        """
        # A peer can send its last request again at will: a line per uid per interval.
        self._refusals.log(logging.INFO, f"again-{conn.uid}", "session %d sent request %d again after a restart: "
                           "answered as before", conn.opened_session.session_id, request_id)
        if answered.frames is not None:
            return answered.frames
        return self._buffer_requests.deliver_again(conn, request_id, answered)

    def _log_refusal(self, operation: str, session: Session, exc: OutOfBudget) -> None:
        """A refusal for want of budget, at INFO for a session holding a lease: it gives that back and retries, so the
        first refusal is expected, not news. A peer can ask for refusals at will: one line per uid per interval."""
        self._refusals.log(logging.INFO if session.leased_bytes else logging.WARNING, f"budget-{session.uid}",
                           "refused %s of session %d (pid %d, uid %d, tenant %r): %s%s", operation, session.session_id,
                           session.pid, session.uid, session.tenant.name, exc.message,
                           " (it holds a lease to give back)" if session.leased_bytes else "")
