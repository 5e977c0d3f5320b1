"""The live handover channel: an old daemon gives its state and every chunk's FD to the new one (``hbmd --takeover``).

A new daemon started on an instance whose daemon is alive takes over without
a gap, as HAProxy's seamless reload and Envoy's hot restart do: the old
daemon stops accepting, sends its state and its descriptors over a Unix
socket (``SCM_RIGHTS``), and exits only once the new one says it serves. If
the new one fails before that, the old one goes on serving. This module is
the channel and its checks; the daemon's loop and ``main`` drive it.

Old daemon::

    listener = TakeoverListener(protocol_major)
    listener.bind(instance_dir / TAKEOVER_SOCKET)    # poll listener.fileno() with the loop's sockets
    pending = listener.accept()                      # None: nothing to do (a refusal was sent and logged)
    pending.hand_over(state, [(name, fd), ...], timeout)  # TakeoverError: resume serving
    if pending.wait_serving(timeout): exit           # False: the new daemon failed; resume serving

New daemon::

    handover = take_over(instance_dir / TAKEOVER_SOCKET, protocol_major, timeout)
    fd = handover.fds.pop(name)                      # popping an FD makes it the caller's
    handover.serving()                               # or handover.abandon(): the old daemon goes on

Wire format (Unix ``SOCK_SEQPACKET``: one message per datagram, the types of :mod:`.handshake`):

1. new → old: a ``TakeoverRequest`` (``{"takeover": WIRE_VERSION, "protocol": major}``).
2. old → new: ``Refused`` (``{"refused": why}``) and the end, or an ``Offer`` (``{"state_bytes": n, "fds": m}``).
3. old → new: the state in datagrams of at most :data:`STATE_PIECE_BYTES` raw bytes, no FDs.
4. old → new: ``FdNames`` (a list of names), each with as many FDs attached (at most 253), in order.
5. new → old: ``Serving`` (``{"serving": true}``) once it serves; closing without it abandons the takeover.

The two daemons trust each other only as far as the kernel vouches: each
checks that the other runs as its own uid (``SO_PEERCRED``), and the taker
checks every size, count and name the old daemon declares before it reads
what they describe. Every blocking step runs against a deadline, and every
FD received is closed on any failure.
"""

from __future__ import annotations

import array
import logging
import math
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

from hbmd.proto.codec import unpackb
from hbmd.proto.errors import ProtocolError
from hbmd.proto.undo import Undo

from ..fds import open_count, usable
from ..notify import MAX_FDNAME_CHARS, MAX_FDS_PER_MESSAGE, check_fdname
from .handshake import FdNames, Offer, Refused, Serving, TakeoverRequest, answer_to_request

log = logging.getLogger("hbmd.takeover")

HANDOVER_TIMEOUT_S = 30.0
"""Seconds a successor has to take the state and chunks, and then to serve."""
TAKEOVER_SOCKET = "takeover.sock"
"""The channel's socket, in the instance directory next to ``control.sock`` and ``handles.sock``."""
SOCKET_MODE = 0o600
"""Only the daemon's own user may even connect: the takeover hands over every client's memory."""
WIRE_VERSION = 1
"""The version of this channel's wire format; a taker speaking another one is refused."""
REQUEST_TIMEOUT_S = 1.0
"""Seconds :meth:`TakeoverListener.accept` waits for a request: the old daemon's loop stands still meanwhile."""
MAX_STATE_BYTES = 1 << 30
"""The largest state a taker accepts; the offer declares the size before any of it is read."""
STATE_PIECE_BYTES = 64 << 10
"""A datagram's share of the state: a datagram must fit the sender's send buffer (212,992 bytes by default)."""
MAX_MESSAGE_BYTES = 4096
"""A request, an offer, a refusal or the word that the new daemon serves."""
MAX_NAMES_BYTES = MAX_FDS_PER_MESSAGE * (MAX_FDNAME_CHARS + 2) + 5
"""A full batch's names as msgpack: each at most a 2-byte header and 255 characters, in a list of 5 header bytes."""
LISTEN_BACKLOG = 4
"""Takers queued at once: one is the rule; a second while one is pending is refused as busy."""

_RIGHTS_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * array.array("i").itemsize)


class TakeoverError(Exception):
    """The takeover did not happen: the peer went away, stalled past its deadline, or broke the protocol."""


class NothingToTakeOver(TakeoverError):
    """No daemon listens at the takeover socket: the instance is not running (or predates takeovers)."""


class TakeoverRefused(TakeoverError):
    """The old daemon refused (another uid, another protocol major, busy, no request in time); ``reason`` says why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"the daemon at {path} refused the takeover: {reason}")
        self.reason = reason


def _peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the peer, from the kernel (``SO_PEERCRED``), as it was when the connection was made."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


class _Link:
    """One end of a takeover connection: datagrams sent and received before ``deadline``, every defect a
    :class:`TakeoverError` that names the peer."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = math.inf

    def allow(self, timeout: float) -> None:
        """Give what follows ``timeout`` seconds from now."""
        self.deadline = time.monotonic() + timeout

    def _arm(self, waiting_for: str) -> None:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TakeoverError(f"{self.peer}: timed out waiting for {waiting_for}")
        self.sock.settimeout(remaining)

    def _failed(self, exc: OSError, waiting_for: str) -> TakeoverError:
        if isinstance(exc, TimeoutError):
            return TakeoverError(f"{self.peer}: timed out waiting for {waiting_for}")
        return TakeoverError(f"{self.peer}: {exc.strerror or exc} ({waiting_for})")

    def send(self, data: bytes | memoryview, waiting_for: str, fds: Sequence[int] = ()) -> None:
        self._arm(waiting_for)
        try:
            if fds:
                self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            else:
                self.sock.send(data)
        except OSError as exc:
            raise self._failed(exc, waiting_for) from None

    def send_now(self, message: Refused | Serving) -> bool:
        """Send a message without waiting (the peer reads or is gone); whether it went out."""
        try:
            self.sock.send(message.encode(), socket.MSG_DONTWAIT)
        except OSError as exc:
            log.debug("%s missed %s: %s", self.peer, type(message).__name__, exc)
            return False
        return True

    def receive_into(self, buffer: memoryview, waiting_for: str) -> int:
        """One datagram into ``buffer``, which it must fit, with no FDs; its length."""
        self._arm(waiting_for)
        try:
            # No control buffer: FDs a peer attaches anyway are dropped by the kernel, and MSG_CTRUNC tells.
            size, _, flags, _ = self.sock.recvmsg_into([buffer])
        except OSError as exc:
            raise self._failed(exc, waiting_for) from None
        if size == 0:
            raise TakeoverError(f"{self.peer} closed the connection before {waiting_for}")
        if flags & socket.MSG_TRUNC:
            raise TakeoverError(f"{self.peer} sent a message over {len(buffer)} bytes instead of {waiting_for}")
        if flags & socket.MSG_CTRUNC:
            raise TakeoverError(f"{self.peer} attached file descriptors to {waiting_for}")
        return size

    def receive_map(self, waiting_for: str) -> dict[Any, Any]:
        """One msgpack map of at most :data:`MAX_MESSAGE_BYTES`, with no FDs."""
        buffer = bytearray(MAX_MESSAGE_BYTES)
        size = self.receive_into(memoryview(buffer), waiting_for)
        try:
            message = unpackb(bytes(buffer[:size]))
        except ProtocolError as exc:
            raise TakeoverError(f"{self.peer} sent {exc} instead of {waiting_for}") from None
        if not isinstance(message, dict):
            raise TakeoverError(f"{self.peer} sent a {type(message).__name__} instead of {waiting_for}")
        return message

    def receive_fds(self, received: list[int], waiting_for: str) -> tuple[bytes, list[int]]:
        """One datagram and the FDs attached to it; each FD goes to ``received`` first, so the caller's undo closes
        it whatever is wrong with the datagram."""
        self._arm(waiting_for)
        try:
            data, ancillary, flags, _ = self.sock.recvmsg(
                MAX_NAMES_BYTES, _RIGHTS_SPACE, socket.MSG_CMSG_CLOEXEC
            )
        except OSError as exc:
            raise self._failed(exc, waiting_for) from None
        fds = array.array("i")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
        received.extend(fds)
        if not data and not fds:
            raise TakeoverError(f"{self.peer} closed the connection before {waiting_for}")
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
            raise TakeoverError(f"{self.peer} sent a message over the limits of {waiting_for}")
        return data, list(fds)

    def close(self) -> None:
        self.sock.close()


def _check_names(names: Sequence[str]) -> None:
    """Raise ``ValueError`` unless every name is a valid FD name and no two are the same."""
    seen: set[str] = set()
    for name in names:
        check_fdname(name)
        if name in seen:
            raise ValueError(f"two file descriptors named {name!r}")
        seen.add(name)


class PendingTakeover:
    """The old daemon's side of one accepted takeover: hand over, then learn whether the new daemon serves."""

    def __init__(self, link: _Link, peer_pid: int) -> None:
        self._link = link
        self.peer_pid = peer_pid
        """The new daemon's pid, from the kernel."""
        self.closed = False

    def hand_over(self, state: bytes, fds: Sequence[tuple[str, int]], timeout: float) -> None:
        """Send the ``state`` blob (bytes-like) and every ``(name, fd)``, within ``timeout`` seconds in all.

        The kernel passes duplicates: the caller keeps, and still closes, its
        own FDs. The loop stands still meanwhile, so the state must not change
        after it was taken. Raises ``ValueError`` before anything is sent for
        a state over :data:`MAX_STATE_BYTES`, a name the FD store would refuse
        (:func:`hbmd.daemon.notify.check_fdname`) or a name given twice;
        :class:`TakeoverError` when the new daemon goes away or stalls (the
        connection is closed then: resume serving).
        """
        view = memoryview(state).cast("B")
        if len(view) > MAX_STATE_BYTES:
            raise ValueError(f"a state of {len(view)} bytes exceeds the {MAX_STATE_BYTES} a takeover carries")
        _check_names([name for name, _ in fds])
        self._link.allow(timeout)
        try:
            self._link.send(Offer(len(view), len(fds)).encode(), "the offer to be read")
            for start in range(0, len(view), STATE_PIECE_BYTES):
                self._link.send(view[start : start + STATE_PIECE_BYTES], "the state to be read")
            for start in range(0, len(fds), MAX_FDS_PER_MESSAGE):
                batch = fds[start : start + MAX_FDS_PER_MESSAGE]
                self._send_batch([name for name, _ in batch], [fd for _, fd in batch])
        except TakeoverError:
            self._close()
            raise

    def _send_batch(self, names: list[str], fds: list[int]) -> None:
        self._link.send(FdNames(tuple(names)).encode(), "the file descriptors to be read", fds)

    def wait_serving(self, timeout: float) -> bool:
        """Whether the new daemon says it serves within ``timeout`` seconds: True, and the old one may exit; False
        when it closed, stalled or said anything else (it failed: the old one must resume serving). Closes the
        connection either way."""
        self._link.allow(timeout)
        try:
            Serving.decode(self._link.receive_map("the word that it serves"))
            serving = True
        except TakeoverError as exc:
            log.warning("takeover abandoned: %s", exc)
            serving = False
        except ValueError:  # it said something else: it failed
            serving = False
        self._close()
        return serving

    def refuse(self, why: str) -> None:
        """Turn the new daemon away (it raises :class:`TakeoverRefused` with ``why``) and close."""
        self._link.send_now(Refused(why))
        self._close()

    def _close(self) -> None:
        self._link.close()
        self.closed = True


class TakeoverListener:
    """The old daemon's takeover socket: accepts one taker at a time, from its own uid and protocol major."""

    def __init__(self, protocol_major: int, *, request_timeout: float = REQUEST_TIMEOUT_S) -> None:
        """``protocol_major``: this daemon's (``hbmd.proto.PROTOCOL_VERSION[0]``); a taker must speak the same."""
        self.protocol_major = protocol_major
        self.request_timeout = request_timeout
        self._sock: socket.socket | None = None
        self._pending: PendingTakeover | None = None

    def bind(self, path: str | os.PathLike[str]) -> None:
        """Listen at ``path`` (in the instance directory, whose lock the caller holds), mode 0600.

        A socket left there by an earlier daemon is replaced. The socket
        listens only once its mode is set, so nobody connects through a
        looser one in between.
        """
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        with Undo() as undo:
            undo.push(sock.close)
            sock.bind(os.fspath(path))
            os.chmod(path, SOCKET_MODE)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        self._sock = sock

    def fileno(self) -> int:
        """The listening socket's FD, for the caller's poller: readable when a taker waits."""
        if self._sock is None:
            raise ValueError("the takeover listener is not bound")
        return self._sock.fileno()

    def accept(self) -> PendingTakeover | None:
        """The takeover a waiting taker asks for, checked; None when none waits or it was refused.

        Refused (with the reason sent back, and logged): a peer of another
        uid, one that sends no well-formed request within
        ``request_timeout``, another wire version or protocol major, and any
        taker while another takeover is pending.
        """
        if self._sock is None:
            raise ValueError("the takeover listener is not bound")
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        pid, uid = _peer_credentials(conn)
        link = _Link(conn, f"the new daemon (pid {pid})")
        link.allow(self.request_timeout)
        try:
            # Read even from a peer of another uid: closed with its request unread, it would see a reset, not why.
            request = link.receive_map("its request")
            why = _refusal_for_uid(uid, os.geteuid()) or self._refusal_for_request(request)
        except TakeoverError as exc:
            why = _refusal_for_uid(uid, os.geteuid()) or str(exc)
        if why is None and self._pending is not None and not self._pending.closed:
            why = f"busy: another takeover (by pid {self._pending.peer_pid}) is under way"
        if why is not None:
            log.warning("refused a takeover by pid %d: %s", pid, why)
            link.send_now(Refused(why))
            link.close()
            return None
        self._pending = PendingTakeover(link, pid)
        return self._pending

    def _refusal_for_request(self, message: dict[Any, Any]) -> str | None:
        try:
            request = TakeoverRequest.decode(message)
        except ValueError as exc:
            return str(exc)
        version, major = request.wire_version, request.protocol_major
        if version != WIRE_VERSION:
            return f"takeover wire version {version}; this daemon speaks {WIRE_VERSION}"
        if major != self.protocol_major:
            return (
                f"protocol major {major}; this daemon speaks {self.protocol_major}: a daemon of another major "
                "cannot take over, stop this one first"
            )
        return None

    def close(self) -> None:
        """Close the listening socket, leaving its path: a new daemon may have bound its own there already."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _refusal_for_uid(peer_uid: int, own_uid: int) -> str | None:
    """Why a peer of ``peer_uid`` may not take over from (or hand over to) a daemon of ``own_uid``; None if it may.

    Only the same user: whoever takes over gets every client's memory.
    """
    if peer_uid != own_uid:
        return f"uid {peer_uid} is not this daemon's uid {own_uid}"
    return None


class Handover:
    """What the new daemon received: the old one's state and FDs, and the word it still owes the old one."""

    def __init__(self, link: _Link, peer_pid: int, state: bytearray, fds: dict[str, int]) -> None:
        self._link = link
        self.peer_pid = peer_pid
        """The old daemon's pid, from the kernel: it exits once told :meth:`serving`."""
        self.state = state
        """The state blob, as the old daemon gave it (received in place, not copied)."""
        self.fds = fds
        """Name → FD. Pop an entry to own its FD: :meth:`serving` and :meth:`abandon` close the ones left."""

    def serving(self) -> bool:
        """Tell the old daemon the new one serves, so it may exit; whether it heard (False: it is gone already)."""
        if self.fds:
            log.warning("closing %d handed-over FD(s) nobody took: %s", len(self.fds), ", ".join(sorted(self.fds)[:8]))
        told = self._link.send_now(Serving())
        self._close()
        return told

    def abandon(self) -> None:
        """Close without saying so, and close the FDs nobody took: the old daemon resumes serving."""
        self._close()

    def _close(self) -> None:
        self._link.close()
        _close_all(list(self.fds.values()))
        self.fds.clear()


def take_over(path: str | os.PathLike[str], protocol_major: int, timeout: float) -> Handover:
    """Take over from the daemon listening at ``path``: its state and its FDs, within ``timeout`` seconds.

    ``protocol_major``: this daemon's; the old one refuses another. Raises
    :class:`NothingToTakeOver` when no daemon listens there,
    :class:`TakeoverRefused` when it says no, :class:`TakeoverError` when it
    declares more than this process may hold, breaks the protocol, goes away
    or stalls; no FD received is left open then.
    """
    where = os.fspath(path)
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    received: list[int] = []
    with Undo() as undo:
        undo.push(sock.close)
        undo.push(_close_all, received)
        # With a timeout, a full backlog fails at once (EAGAIN) where a blocking connect would wait for good.
        sock.settimeout(timeout)
        try:
            sock.connect(where)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise NothingToTakeOver(f"no daemon to take over at {where}: {exc.strerror}") from None
        except BlockingIOError:
            raise TakeoverError(f"the daemon at {where} has takers queued already; try again") from None
        except OSError as exc:
            raise TakeoverError(f"cannot connect to {where}: {exc.strerror or exc}") from None
        pid, uid = _peer_credentials(sock)
        why = _refusal_for_uid(uid, os.geteuid())
        if why is not None:
            raise TakeoverError(f"the daemon at {where} (pid {pid}) may not hand over: {why}")
        link = _Link(sock, f"the daemon at {where} (pid {pid})")
        link.deadline = deadline
        link.send(TakeoverRequest(WIRE_VERSION, protocol_major).encode(), "the request to be read")
        try:
            answer = answer_to_request(link.receive_map("its offer"))
        except ValueError as exc:
            raise TakeoverError(f"{link.peer} sent a {exc}") from None
        if isinstance(answer, Refused):
            raise TakeoverRefused(where, answer.reason)
        _check_offer(link, answer)
        state = _receive_state(link, answer.state_bytes)
        fds = _receive_fds(link, answer.fd_count, received)
    return Handover(link, pid, state, fds)


def _check_offer(link: _Link, offer: Offer) -> None:
    """Raise :class:`TakeoverError` unless the offer's state size and FD count fit what this process may take."""
    if offer.state_bytes > MAX_STATE_BYTES:
        raise TakeoverError(
            f"{link.peer} offers a state of {offer.state_bytes} bytes, over the {MAX_STATE_BYTES} allowed"
        )
    room = usable() - open_count()
    if offer.fd_count > room:
        raise TakeoverError(
            f"{link.peer} hands over {offer.fd_count} file descriptors; this process may open only {room} more "
            "(raise LimitNOFILE)"
        )


def _receive_state(link: _Link, state_bytes: int) -> bytearray:
    state = bytearray(state_bytes)
    view = memoryview(state)
    got = 0
    while got < state_bytes:
        got += link.receive_into(view[got : got + STATE_PIECE_BYTES], "the state")
    return state


def _receive_fds(link: _Link, fd_count: int, received: list[int]) -> dict[str, int]:
    """``fd_count`` FDs by name, each name valid and new; ``received`` holds every FD that arrived, for the undo."""
    fds: dict[str, int] = {}
    while len(fds) < fd_count:
        data, batch = link.receive_fds(received, "the file descriptors")
        try:
            names = FdNames.decode(unpackb(data)).names
        except ProtocolError as exc:
            raise TakeoverError(f"{link.peer} sent {exc} instead of FD names") from None
        except ValueError as exc:
            raise TakeoverError(f"{link.peer} sent {exc}") from None
        if len(names) != len(batch) or len(fds) + len(batch) > fd_count:
            raise TakeoverError(
                f"{link.peer} sent {len(batch)} FDs with {len(names)} names, {len(fds)} of {fd_count} received before"
            )
        for name, fd in zip(names, batch):
            if name in fds:
                raise TakeoverError(f"{link.peer} sent two file descriptors named {name!r}")
            fds[name] = fd
    return fds
