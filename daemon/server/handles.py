"""The handle plane: each session's Unix ``SOCK_SEQPACKET`` connection, from accept to the session's end.

A connection's first datagram is the :class:`Hello`; the peer's pid/uid/gid
come from ``SO_PEERCRED``; when it closes the session ends and its buffers
are freed. After the hello the client sends only the placements of leased
granules and their returns (``LeasePlace``, ``LeaseReturn``), the chunks it
made on its credit (``OwnChunks``, the only datagram with FDs) and the
credit's return (``CreditReturn``), read before any request is answered, each session's within its share of a turn of
the loop (:data:`WORK_PER_TURN_S`). What the daemon sends back, FDs above all, goes
through the outbox (``outbox.py``).

A session ends with its process, not with the last copy of its socket. A
worker that forked a helper (which never speaks to hbmd) shares the socket
with it, so the socket's EOF would wait for the helper too, and the
worker's persistent buffers could not be attached by its replacement. So at
accept the daemon takes a pidfd of the process that connected and polls it
with the sockets: when it turns readable that process has exited and the
session ends, even while the socket is still open elsewhere, once the
datagrams it sent before are read (over later turns where they are more
than a turn's share, for :data:`EXITED_READ_S` at most): each is a commit
that returned. The kernel records that process at the connect and hands
its pidfd over (``SO_PEERPIDFD``, Linux 6.5), in any pid namespace; older
kernels get one from the ``SO_PEERCRED`` pid (``pidfd_open``), moments
after the connect, so the window in which the pid could pass to another
process is that short. Where there is no pidfd (kernels before 5.3, or
before 6.5 a peer in a pid namespace the daemon cannot see, whose pid reads
0) the socket's EOF alone ends the session. A request that meets a session whose
process has died but whose exit the loop has not handled yet (an attach
right after a SIGKILL) ends that session first, so it is not refused for a
holder that is gone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import socket
import time
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from hbmd.proto import (
    MAX_OWN_CHUNKS,
    MAX_SEGMENTS,
    PROTOCOL_VERSION,
    CreditReturn,
    Hello,
    LeasePlace,
    LeaseReturn,
    OwnChunks,
    Refused,
    Welcome,
    decode_datagram,
    encode_datagram,
)
from hbmd.proto.errors import (
    Conflict,
    DaemonUnavailable,
    HbmdError,
    InternalError,
    PermissionDenied,
    ProtocolError,
    SessionLost,
    VersionMismatch,
)
from hbmd.proto.fdpass import receive_with_fds
from hbmd.proto.instance import VERSION
from hbmd.proto.units import format_bytes

from ..backends import A, C
from ..fds import limit as fd_limit
from ..fds import open_count as open_fds
from ..fds import usable as usable_fds
from ..state import Session, State
from ..state.writers import Writer
from .connection import Descriptors, HandleConnection, accepted, accepting, peer_pidfd, readable_now
from .hellos import Hellos
from .outbox import Outbox
from .ratelimit import RateLimitedLog

log = logging.getLogger("hbmd.server.handles")

MAX_DATAGRAM = 64 << 10
MAX_FDS_IN = MAX_OWN_CHUNKS
"""FDs read with an inbound datagram: those of an ``OwnChunks`` are checked and kept, any others closed at once."""
WORK_PER_TURN_S = 0.005
"""Seconds one session's datagrams may take of each turn of the loop; what it sends beyond waits for the next turn.
Work is counted, not datagrams: one placement costs from microseconds to a couple of milliseconds (a full 64 KiB
datagram), so a count would let a peer hold the loop for as many times the dearest one. An honest client sends a
placement per commit, at most one per leased granule it holds, each well within this."""
EXITED_READ_S = 2.0
"""How long the datagrams a session's process sent before it exited are read on, a turn's share at a time, before its
session ends: each is a commit that returned, and a persistent buffer must keep it. What a forked helper sends past
that is cut."""
T = TypeVar("T")


class HandlePlane(Generic[A, C]):
    """Accepts clients, opens their sessions at their hello, reads what they send, ends their sessions when they go.

    Its :attr:`outbox` holds what is sent back to them.
    """

    def __init__(self, state: State[A, C], journal: Callable[[], None] = lambda: None) -> None:
        """``journal``: writes what changed where the state is kept across restarts, before a welcome acknowledges
        it."""
        self.state = state
        self.descriptors = Descriptors()
        """Every socket and pidfd of the handle plane: the loop watches them as one descriptor."""
        self._journal = journal
        self._listener: socket.socket | None = None
        self._reserve_fd = -1
        """Kept open to be closed when the descriptors run out: one to accept a waiting peer with, and refuse it."""
        self._connections: dict[int, HandleConnection[A, C]] = {}
        self._by_session: dict[int, HandleConnection[A, C]] = {}
        self._by_pidfd: dict[int, HandleConnection[A, C]] = {}
        self._hellos = Hellos()
        """The connections that have not said hello yet."""
        self._placing = Descriptors()
        """Handle sockets of sessions that place leased granules: read before any request is answered (an epoll: it
        answers with those that sent something, whatever the number of sessions)."""
        self.outbox = Outbox(state, self.descriptors, self._connections)
        self._warnings = RateLimitedLog(log)
        self._worked: dict[int, float] = {}
        """Seconds each session's datagrams took this turn, by socket fd (see :data:`WORK_PER_TURN_S`)."""

    @property
    def by_session(self) -> Mapping[int, HandleConnection[A, C]]:
        """The connection of each open session, by session id."""
        return self._by_session

    def listen(self, listener: socket.socket) -> None:
        """Accept clients on ``listener``, the handle socket, listening and non-blocking; it stays the caller's."""
        self._listener = listener
        self._reserve_fd = self._open_reserve()
        self.descriptors.register(self._listener.fileno(), select.EPOLLIN)

    def close(self) -> None:
        """Hang up on every session and stop accepting, ending no session.

        The daemon is stopping, not its clients: what they map stays theirs.
        Ending their sessions would release their chunks, and on the host
        backend a released chunk is punched out, so a live worker would read
        zeros (tests/test_restart.py). The chunks' descriptors close with the
        process; the pages go once the last client unmaps them.
        """
        sessions = sum(conn.session is not None and not conn.session.observer for conn in self._connections.values())
        for conn in list(self._connections.values()):
            self._hang_up(conn)
        self._by_session.clear()
        if sessions:
            log.info("stopping with %d session(s) connected: their memory stays mapped in their processes", sessions)
        if self._listener is not None:
            # Its owner keeps it open: a connect made meanwhile waits in its backlog for whoever accepts next.
            self.descriptors.unregister(self._listener.fileno())
            self._listener = None
        if self._reserve_fd >= 0:
            os.close(self._reserve_fd)
            self._reserve_fd = -1

    def close_watches(self) -> None:
        """Close the epolls that watch the descriptors, once the plane is closed for good (:meth:`close` leaves them
        open: a daemon whose handover failed listens again)."""
        self.descriptors.close()
        self._placing.close()

    def new_turn(self) -> None:
        """A new turn of the loop: every session may send :data:`WORK_PER_TURN_S` of work again."""
        self._worked.clear()

    def on_event(self, fd: int) -> None:
        """Serve what woke the poll on ``fd``: the listener, a connection's socket or its peer's pidfd."""
        if self._listener is not None and fd == self._listener.fileno():
            self._accept(self._listener)
            return
        conn = self._connections.get(fd)
        if conn is not None:
            self._on_connection_event(conn)
            return
        conn = self._by_pidfd.get(fd)
        # Checked again: the event may be stale, its descriptor number reused this very loop.
        if conn is not None and readable_now(conn.pidfd) and not self._reading_after_exit(conn):
            self.close_connection(conn, "process exited")

    def _reading_after_exit(self, conn: HandleConnection[A, C]) -> bool:
        """Whether the session of a process that has exited still has datagrams to read, for this turn and the next
        (its socket's events read them, within each turn's share), :data:`EXITED_READ_S` at most."""
        if not self.behind(conn):
            return False
        now = self.state.clock.monotonic()
        if conn.exited_at is None:
            conn.exited_at = now
        return now - conn.exited_at < EXITED_READ_S

    def expire_hellos(self, now: float) -> None:
        """Close the connections that sent no hello within :data:`~.hellos.HELLO_TIMEOUT_S`."""
        for conn in self._hellos.overdue(now):
            self.close_connection(conn, "no hello in time")

    def take_placements(self) -> None:
        """Apply every leased granule's placement sent so far, by any session: a request sees all commits that returned.

        One ``poll`` over the placing sessions' sockets; only those with
        datagrams waiting are read, each within what is left of its work this
        turn (an honest client's placements always fit).
        """
        for fd, _ in self._placing.ready():
            conn = self._connections.get(fd)
            if conn is not None and conn.session is not None:
                self._drain_datagrams(conn)

    def behind(self, conn: HandleConnection[A, C]) -> bool:
        """Whether the session's client has datagrams not read yet: its share of this turn's work ran out first."""
        return conn.session is not None and conn.session.wants_lease and readable_now(conn.sock.fileno())

    def unless_holder_exited(self, operation: Callable[[], T]) -> T:
        """Run ``operation``; if a session holding the buffer it needs has exited (noticed or not), end that session,
        its datagrams read first, and run it again."""
        try:
            return operation()
        except Conflict as exc:
            session_id = exc.details.get("session_id")
            holder = self._by_session.get(session_id) if isinstance(session_id, int) else None
            if holder is None or not holder.has_exited():
                raise
            self._read_after_exit_now(holder)
            self.close_connection(holder, "process exited")
        return operation()

    def _read_after_exit_now(self, conn: HandleConnection[A, C]) -> None:
        """Read what an exited process's session has left unread, at once: a request waits on its end (a replacement
        attaching the buffers it grew). Within :data:`EXITED_READ_S` from when its exit was first seen, as over
        turns."""
        while self._reading_after_exit(conn):
            self._worked.pop(conn.sock.fileno(), None)
            if not self._drain_datagrams(conn):
                return

    def close_connection(self, conn: HandleConnection[A, C], why: str) -> None:
        """Close the connection and its pidfd and end its session, freeing its anonymous buffers."""
        # The pidfd outlives the hang-up while the session ends: an orphan it leaves is watched through it.
        pidfd = os.dup(conn.pidfd) if conn.pidfd >= 0 and conn.session is not None else -1
        try:
            self._hang_up(conn)
            if conn.session is not None:
                self._by_session.pop(conn.session.session_id, None)
                freed = self._end_session(conn.session, pidfd)
                log.log(logging.DEBUG if conn.session.observer else logging.INFO,
                        "session %d ended (%s): freed %s", conn.session.session_id, why, format_bytes(freed))
        finally:
            if pidfd >= 0:
                os.close(pidfd)

    def _hang_up(self, conn: HandleConnection[A, C]) -> None:
        """Close the connection and its pidfd, its session's placements read first; the session is left as it is."""
        fd = conn.sock.fileno()
        if conn.session is not None and conn.session.wants_lease:
            # Placements the client sent before it died are in the socket still: its buffers must include them.
            # A turn's work, whatever it spent this turn: a flood left there is cut, an honest client's few are not.
            self._worked.pop(fd, None)
            self._drain_datagrams(conn)
            self._placing.unregister(fd)
        self._connections.pop(fd, None)
        self._hellos.remove(conn, fd)
        self._worked.pop(fd, None)
        self.descriptors.unregister(fd)
        self.outbox.forget(conn)
        conn.sock.close()
        if conn.pidfd >= 0:
            self._by_pidfd.pop(conn.pidfd, None)
            self.descriptors.unregister(conn.pidfd)
            os.close(conn.pidfd)
            conn.pidfd = -1

    # accept

    def _accept(self, listener: socket.socket) -> None:
        for sock in accepting(listener, self._warnings, "handle", lambda exc: self._refuse_without_fds(listener, exc)):
            if open_fds() > usable_fds():
                # Keep the headroom the control connections need: a session would cost two more.
                self._warnings.warning("fds", "refusing handle connections: %s", self._out_of_fds_message())
                self._refuse(sock, self._out_of_fds_message())
                continue
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        """Take in an accepted peer to wait for its hello, knowing who it is."""
        credentials = accepted(sock, self._warnings, "handle")
        if credentials is None:
            return
        pid, uid, gid, groups = credentials
        oldest = self._hellos.to_close_for(uid)
        if oldest is not None:
            # The oldest goes, not the newcomer: an honest client says hello at once, a flood's do not.
            waiting = self._hellos.held(oldest.uid)
            self._warnings.warning(
                f"pending-{oldest.uid}", "uid %d has %d connections without a hello (%d of all uids); closing the "
                "oldest (pid %d)", oldest.uid, waiting, len(self._hellos), oldest.pid,
            )
            oldest.send_quietly(Refused(
                DaemonUnavailable.code.wire,
                f"closed: uid {oldest.uid} has {waiting} connections that sent no hello yet, "
                f"{len(self._hellos)} wait of all uids",
            ))
            self.close_connection(oldest, "too many connections without a hello")
        try:
            pidfd = peer_pidfd(sock, pid)
        except ProcessLookupError:
            sock.close()  # the peer is gone already
            return
        accepted_at = self.state.clock.monotonic()
        conn: HandleConnection[A, C] = HandleConnection(sock, pid, uid, gid, groups, accepted_at, pidfd)
        self._connections[sock.fileno()] = conn
        self._hellos.add(conn)
        self.descriptors.register(sock.fileno(), select.EPOLLIN)
        if pidfd >= 0:
            self._by_pidfd[pidfd] = conn
            self.descriptors.register(pidfd, select.EPOLLIN)

    @staticmethod
    def _refuse(sock: socket.socket, message: str) -> None:
        """Turn a peer away at once with a retryable refusal (it is busy, not forbidden)."""
        try:
            sock.send(encode_datagram(Refused(DaemonUnavailable.code.wire, message)))
        except OSError:
            pass  # it left already
        sock.close()

    def _refuse_without_fds(self, listener: socket.socket, exc: OSError) -> None:
        """Out of descriptors: accept and refuse each waiting peer through the reserve FD, so the loop does not spin.

        A listener with peers waiting stays readable; left there, they would wake the poll at once, forever.
        """
        message = self._out_of_fds_message()
        self._warnings.warning("fds", "refusing handle connections: %s (%s)", message, exc.strerror)
        if self._reserve_fd < 0:
            return
        os.close(self._reserve_fd)
        self._reserve_fd = -1
        try:
            while True:
                sock, _ = listener.accept()
                self._refuse(sock, message)
        except OSError:
            pass  # none left waiting, or still no descriptor: the next event tries again
        finally:
            self._reserve_fd = self._open_reserve()

    @staticmethod
    def _out_of_fds_message() -> str:
        return f"the daemon is out of file descriptors (RLIMIT_NOFILE {fd_limit()}); retry once others disconnect"

    @staticmethod
    def _open_reserve() -> int:
        try:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1

    # inbound datagrams

    def _on_connection_event(self, conn: HandleConnection[A, C]) -> None:
        if conn.outbox:
            self.outbox.flush(conn)
        if conn.session is not None:
            if not self._drain_datagrams(conn):
                self.close_connection(conn, "connection closed")
            return
        try:
            received = self._receive(conn)
        except BlockingIOError:
            return
        if received is None:
            self.close_connection(conn, "connection closed")
            return
        data, fds = received
        for fd in fds:
            os.close(fd)
        if fds:
            self._warnings.warning(
                "fds-in", "pid %d sent %d unsolicited file descriptors; closed them", conn.pid, len(fds)
            )
        if data:
            self._handshake(conn, data)

    def _receive(self, conn: HandleConnection[A, C]) -> tuple[bytes, list[int]] | None:
        """One inbound datagram and its FDs (b"" and none for one dropped), or None when the peer is gone;
        ``BlockingIOError`` when none waits. The caller closes the FDs."""
        try:
            data, fds, flags = receive_with_fds(conn.sock, MAX_DATAGRAM, MAX_FDS_IN, socket.MSG_DONTWAIT)
        except InterruptedError:
            raise BlockingIOError from None
        except BlockingIOError:
            raise
        except OSError:
            return None
        if not data and not fds:
            return None
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            for fd in fds:
                os.close(fd)
            self._warnings.warning("oversized", "pid %d sent an oversized datagram; dropped", conn.pid)
            return b"", []
        return data, fds

    def _drain_datagrams(self, conn: HandleConnection[A, C]) -> bool:
        """Apply the datagrams the session's client has sent (its leased granules' placements); False at its EOF.

        Run before any request is answered and before the session ends, so
        the daemon's record of its buffers includes every placement its
        client sent before. An honest client has a few in flight; a peer
        that keeps sending is read until its :data:`WORK_PER_TURN_S` for this
        turn is spent, and the rest waits for the next turn: it cannot hold
        the loop, nor delay anyone but itself.
        """
        fd = conn.sock.fileno()
        worked = self._worked.get(fd, 0.0)
        started = time.perf_counter()
        try:
            while worked < WORK_PER_TURN_S:
                try:
                    received = self._receive(conn)
                except BlockingIOError:
                    return True
                if received is None:
                    return False
                data, fds = received
                try:
                    if data:
                        self._apply_datagram(conn, data, fds)
                finally:
                    for fd in fds:
                        os.close(fd)
                now = time.perf_counter()
                worked += now - started
                started = now
        finally:
            self._worked[fd] = worked
        self._warnings.warning(
            f"flood-{conn.uid}", "session %d (pid %d) sends datagrams faster than they are read",
            conn.opened_session.session_id, conn.pid,
        )
        return True

    def _apply_datagram(self, conn: HandleConnection[A, C], data: bytes, fds: list[int]) -> None:
        """Apply one datagram of a session; the caller closes ``fds`` (what the state keeps, it duplicated)."""
        session = conn.opened_session
        try:
            msg = decode_datagram(data, MAX_SEGMENTS)
            if fds and not isinstance(msg, OwnChunks):
                self._warnings.warning("fds-in", "pid %d sent %d unsolicited file descriptors; closed them", conn.pid,
                                       len(fds))
            if isinstance(msg, LeasePlace):
                self.state.place(session, msg.buffer_id, msg.sizes, msg.chunk_ids, msg.offsets)
            elif isinstance(msg, OwnChunks):
                self.state.bind(session, msg.buffer_id, msg.sizes, msg.offsets, msg.chunk_sizes, fds)
            elif isinstance(msg, LeaseReturn):
                self.state.leases.given_back(session, msg.chunk_ids)
            elif isinstance(msg, CreditReturn):
                self.state.leases.credit_returned(session)
            else:
                log.debug("session %d sent an unexpected %s datagram; ignored", session.session_id, msg.KIND)
        except HbmdError as exc:
            # A client placing granules it was not leased, or where the growth needs none; chunks that are not what
            # they claim or not paid for: nothing changed.
            self._warnings.warning(
                f"datagram-{conn.uid}", "session %d (pid %d) sent a datagram that was refused: %s",
                session.session_id, conn.pid, exc.message,
            )

    # the hello

    def _handshake(self, conn: HandleConnection[A, C], data: bytes) -> None:
        try:
            self._open_session(conn, data)
        except Exception:
            log.exception("handshake with pid %d failed", conn.pid)
            conn.send_quietly(Refused(InternalError.code.wire, "internal error during the handshake"))
            self.close_connection(conn, "handshake failed")

    def _open_session(self, conn: HandleConnection[A, C], data: bytes) -> None:
        try:
            hello = self._check_hello(conn, data)
            resumed = hello.resume_session != 0
            if resumed:
                try:
                    session = self.state.sessions.resume(
                        hello.resume_session, conn.uid, conn.pid, hello.resume_credential
                    )
                except SessionLost:
                    if not (hello.start_over and self.state.sessions.may_start_over(
                            hello.resume_session, conn.uid, conn.pid, hello.resume_credential)):
                        raise
                    resumed = False
                    session = self._new_session(conn, hello, (hello.resume_session, hello.resume_credential))
            else:
                session = self._new_session(conn, hello)
        except HbmdError as exc:
            conn.send_quietly(Refused(exc.code.wire, exc.message))
            self.close_connection(conn, f"refused: {exc.message}")
            return
        conn.session = session
        self._hellos.remove(conn, conn.sock.fileno())
        conn.protocol_minor = hello.version[1]
        conn.replies_with_fds = hello.replies_with_fds
        self._by_session[session.session_id] = conn
        if session.wants_lease:
            self._placing.register(conn.sock.fileno(), select.EPOLLIN)
        note = "" if resumed else self.state.tenants.unconfigured(conn.uid, hello.tenant, session.tenant)
        if note:
            # A peer can declare names at will: a line per uid per interval.
            self._warnings.warning(f"tenant-{conn.uid}", "session %d (pid %d): %s", session.session_id, conn.pid, note)
        welcome = dataclasses.replace(self._welcome(session, resumed), tenant_note=note, started_over=session.declaring)
        self._journal()  # the session and its new credential, before the client holds them
        conn.send_quietly(welcome)
        # Observers (hbmctl, probes) connect every few seconds: at INFO they would bury the workers.
        log.log(
            logging.DEBUG if session.observer else logging.INFO,
            "session %d %s: pid %d uid %d%s",
            session.session_id,
            "resumed" if resumed else "started over" if session.declaring else "opened",
            conn.pid,
            conn.uid,
            f" ({session.client_name})" if session.client_name else "",
        )

    def _new_session(self, conn: HandleConnection[A, C], hello: Hello,
                     starting_over: tuple[int, str] = (0, "")) -> Session:
        access = self.state.tenants.config.access
        return self.state.open_session(
            conn.pid, conn.uid, conn.gid, hello.client_name, hello.tenant, admin=conn.uid in access.admin_uids,
            observer=hello.observer, lease=hello.lease and hello.version[1] >= 3,
            credit=hello.lease and hello.version[1] >= 8, starting_over=starting_over,
        )

    def _check_hello(self, conn: HandleConnection[A, C], data: bytes) -> Hello:
        """The client's hello, if it speaks this daemon's major version and its uid may use the instance."""
        hello = decode_datagram(data, MAX_SEGMENTS)
        if not isinstance(hello, Hello):
            raise ProtocolError(f"expected a hello, got {hello.KIND}")
        if len(hello.version) != 2 or min(hello.version) < 0:
            raise VersionMismatch(f"hello version must be [major, minor], got {hello.version[:4]}")
        if hello.version[0] != PROTOCOL_VERSION[0]:
            raise VersionMismatch(
                f"client speaks protocol {'.'.join(map(str, hello.version))}, "
                f"this daemon speaks {PROTOCOL_VERSION[0]}.x"
            )
        if not self.state.tenants.config.access.admits(conn.uid, conn.groups):
            raise PermissionDenied(f"uid {conn.uid} is not allowed to use hbmd instance {self.state.backend.instance}")
        return hello

    def _welcome(self, session: Session, resumed: bool) -> Welcome:
        """The welcome of a new or resumed session, with the credential that resumes it next time (none for an
        observer: a tool connects anew)."""
        backend = self.state.backend
        return Welcome(
            token=session.token,
            session_id=session.session_id,
            instance=backend.instance,
            backend=backend.name,
            granularity=backend.granularity,
            version=list(PROTOCOL_VERSION),
            daemon_version=VERSION,
            device_uuid=backend.device_uuid,
            device_index=backend.device_index,
            lease_bytes=self.state.leases.bytes_for(session),
            credit_bytes=self.state.leases.credit_for(session),
            resume_credential="" if session.observer else self.state.sessions.issue_credential(session),
            lease_chunk_ids=list(session.lease) if resumed else [],
            tenant=session.tenant.name,
        )

    def _end_session(self, session: Session, pidfd: int = -1) -> int:
        """End ``session`` (:meth:`State.close_session`, ``pidfd`` a pidfd of its process or -1), naming each
        persistent buffer its end leaves to nobody: kept, and charged, until attached again or deleted. Returns the
        bytes freed."""
        orphans = [buffer for buffer in session.buffers.values() if buffer.persistent]
        writer = Writer.of(session.pid, pidfd) if orphans and not session.observer else None
        try:
            freed = self.state.close_session(session, writer)
        finally:
            if writer is not None:
                writer.close()
        for buffer in orphans:
            until = f"for {buffer.keep_orphan_s:g}s" if buffer.expires_at else "until deleted (hbmctl delete)"
            log.info("buffer %d %r of session %d is an orphan: %s kept until attached again or grafted, or %s",
                     buffer.buffer_id, buffer.name, session.session_id, format_bytes(buffer.physical_bytes), until)
        return freed

    def end_unresumed(self, now: float) -> None:
        """End the sessions restored after a restart whose clients did not come back in time, or whose processes are
        gone, as a dead client's session ends (its anonymous buffers freed, its persistent ones orphaned)."""
        for session in self.state.sessions.unresumed(now, self._gone):
            freed = self._end_session(session)
            log.info("session %d (pid %d) was not resumed after the restart: ended, freed %s",
                     session.session_id, session.pid, format_bytes(freed))

    @staticmethod
    def _gone(pid: int) -> bool:
        """Whether process ``pid`` has exited (one this daemon cannot see, in another pid namespace, never is)."""
        if pid <= 0:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False

