"""The daemon's end of a control connection in ZMTP 3.0 and 3.1 with the NULL mechanism (RFC 23 and 37): bytes in,
messages out, under hard bounds. No sockets: :mod:`.control_socket` feeds it what it reads.

libzmq bounds one frame (``ZMQ_MAXMSGSIZE``) and counts whole messages
(``RCVHWM``), not the parts of one: a peer sending the parts of one message
forever, its MORE flag always set, made a ROUTER hold them (empty parts of
2 bytes, 64 of libzmq each: 32 MiB sent took the daemon to 1,065 MiB of RSS,
542 MiB kept after the peer left; SECURITY.md, "Measured"), and libzmq has
no option against it (its issues #1045 and #4526). Here one message has at
most :data:`MAX_PARTS` parts and :data:`MAX_MESSAGE_BYTES` bytes in all, a
command :data:`MAX_COMMAND_BYTES`, and each bound is checked from the
frame's header, before its body is read. A connection breaking one, or the
protocol, is a :class:`ZmtpViolation`: its owner closes it. Only DEALER
peers, hbmd's clients, are served (:data:`SOCKET_TYPE`); the daemon's READY
answers theirs, so that any handshake refused gets ZMTP's ERROR in its
place (:func:`error_command`).
"""

from __future__ import annotations

import struct
import sys

from hbmd.proto import MAX_FRAME_BYTES

MAX_MESSAGE_BYTES = MAX_FRAME_BYTES + 4096
"""Bytes of one message, all its parts together: a request is its kind and a payload of at most
``MAX_FRAME_BYTES`` (``ZMQ_MAXMSGSIZE`` bounded each frame so before; a larger payload up to it is answered with a
refusal, as it was)."""
MAX_PARTS = 16
"""Parts of one message. A request has two; a message of up to this many is answered with a refusal, as before,
a longer one closes the connection."""
MAX_COMMAND_BYTES = 4096
"""Bytes of one command frame: a client's READY (its socket type and routing id, some 40 bytes) or a heartbeat."""
MAX_COMMANDS_PER_FEED = 16
"""Commands one :meth:`ZmtpPeer.feed` answers at most; the rest wait for the next. A DEALER sends a heartbeat every
``ZMQ_HEARTBEAT_IVL`` (none by default); a peer streaming PINGs, which complete no request, made a turn that read
its connection until a request was whole last as long as it sent (issue #61)."""

GREETING_BYTES = 64
SOCKET_TYPE = b"DEALER"
"""The one socket type of the peers served: hbmd's clients'. A ROUTER also speaks with REQ and ROUTER peers (RFC 28),
but a REQ's requests start with an empty delimiter the daemon's requests do not have (its client waited out its
timeout), and a ROUTER's with the identity it routes by."""
MAX_ERROR_REASON = 255
"""Characters of an ERROR command's reason (RFC 37: a length of one byte)."""

_MORE, _LONG, _COMMAND = 0x01, 0x02, 0x04
_NULL_MECHANISM = b"NULL".ljust(20, b"\x00")
GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 1]) + _NULL_MECHANISM + b"\x00" + bytes(31)
"""What the daemon sends first: ZMTP 3.1, the NULL mechanism, not as a server (NULL has no roles)."""


class ZmtpViolation(Exception):
    """A peer broke ZMTP or a bound: its connection is closed. The message names what it did, for the log and, during
    the handshake, for the peer (:func:`error_command`)."""


def encode_frame(data: bytes, flags: int = 0) -> bytes:
    """One frame: its flags, its length (one byte up to 255, else eight) and ``data``."""
    if len(data) < 256:
        return bytes((flags, len(data))) + data
    return struct.pack(">BQ", flags | _LONG, len(data)) + data


def encode_message(frames: list[bytes]) -> bytes:
    """A message of one or more frames, as one run of bytes."""
    last = len(frames) - 1
    return b"".join(encode_frame(frame, _MORE if i < last else 0) for i, frame in enumerate(frames))


def encode_command(name: bytes, data: bytes) -> bytes:
    return encode_frame(bytes((len(name),)) + name + data, _COMMAND)


READY = encode_command(b"READY", b"\x0bSocket-Type" + struct.pack(">I", 6) + b"ROUTER")
"""The daemon's READY: a ROUTER, as its clients' DEALERs expect."""


def error_command(reason: str) -> bytes:
    """ZMTP's ERROR command with ``reason``, in printable ASCII and cut to :data:`MAX_ERROR_REASON` characters.

    Sent in place of the daemon's READY, it ends the handshake: libzmq reads
    it as a protocol error and stops reconnecting (after a plain close it
    reconnects every 100 ms), and whoever looks at the bytes reads why.
    """
    text = "".join(c if " " <= c <= "~" else "?" for c in reason)[:MAX_ERROR_REASON].encode("ascii")
    return encode_command(b"ERROR", bytes((len(text),)) + text)


def properties(data: bytes) -> dict[bytes, bytes]:
    """A READY's metadata: ``name-length name value-length(4) value`` each, to the last byte."""
    found: dict[bytes, bytes] = {}
    at = 0
    while at < len(data):
        name_length = data[at]
        name = data[at + 1 : at + 1 + name_length]
        at += 1 + name_length
        if not name or len(name) < name_length or at + 4 > len(data):
            raise ZmtpViolation("a READY whose metadata is cut short")
        (value_length,) = struct.unpack_from(">I", data, at)
        at += 4
        if at + value_length > len(data):
            raise ZmtpViolation("a READY whose metadata is cut short")
        found[name] = data[at : at + value_length]
        at += value_length
    return found


def check_greeting(greeting: bytes | bytearray) -> None:
    """Raise :class:`ZmtpViolation` for what is wrong with the first ``len(greeting)`` bytes of a peer's greeting."""
    if greeting[:1] not in (b"", b"\xff") or greeting[9:10] not in (b"", b"\x7f"):
        raise ZmtpViolation("bytes that are not a ZMTP greeting")
    if len(greeting) > 10 and greeting[10] < 3:
        raise ZmtpViolation(f"ZMTP {greeting[10]}: 3.0 or later is spoken here")
    mechanism = bytes(greeting[12:32])
    if mechanism != _NULL_MECHANISM[: len(mechanism)]:
        raise ZmtpViolation(f"the mechanism {mechanism.rstrip(bytes(1))!r}: only NULL is spoken here (no CURVE or "
                            "PLAIN: who may connect is the socket's file mode, and the kernel names the peer)")


class ZmtpPeer:
    """One connection's incoming bytes, parsed as they come: the greeting, the READY, then messages and heartbeats.

    :meth:`feed` returns the messages completed and the bytes to send back;
    :attr:`held` is what it keeps meanwhile (the bytes of a frame not yet
    whole, the parts of a message not yet ended, and bytes received but not
    parsed yet), never more than :data:`MAX_MESSAGE_BYTES`, a frame header
    and what the last feed that :attr:`stopped_short` was given.
    """

    __slots__ = ("_buffer", "_part_bytes", "_parts", "greeted", "ready", "stopped_short")

    def __init__(self) -> None:
        self._buffer = bytearray()
        """Bytes received and not yet parsed: the rest of the greeting, or frames, the last one perhaps not whole."""
        self._parts: list[bytes] = []
        """The parts of the message under way."""
        self._part_bytes = 0
        self.greeted = False
        """The peer's greeting has come."""
        self.ready = False
        """The peer's READY has come, and the daemon's gone back: messages may follow."""
        self.stopped_short = False
        """The last :meth:`feed` stopped at its ``room`` or at :data:`MAX_COMMANDS_PER_FEED` with bytes unparsed: a
        feed of no bytes goes on with them."""

    @property
    def held(self) -> int:
        return len(self._buffer) + self._part_bytes

    def feed(self, data: bytes = b"", room: int = sys.maxsize) -> tuple[list[list[bytes]], bytes]:
        """``(messages, reply)``: the messages ``data`` completes and what to send the peer; raises
        :class:`ZmtpViolation` at the first thing wrong, before the body of a frame that breaks a bound is read.

        It stops once ``room`` messages are complete or :data:`MAX_COMMANDS_PER_FEED` commands answered, keeping
        the rest unparsed (:attr:`stopped_short`): a run of bytes may hold thousands of empty messages or
        heartbeats, and what one turn of the loop does for a connection is bounded.
        """
        buffer = self._buffer
        buffer += data
        messages: list[list[bytes]] = []
        replies: list[bytes] = []
        if not self.greeted:
            check_greeting(buffer[:GREETING_BYTES])
            if len(buffer) < GREETING_BYTES:
                return messages, b""
            del buffer[:GREETING_BYTES]
            self.greeted = True
        commands = 0
        while buffer:
            if len(messages) >= room or commands >= MAX_COMMANDS_PER_FEED:
                self.stopped_short = True
                return messages, b"".join(replies)
            flags = buffer[0]
            if flags & ~(_MORE | _LONG | _COMMAND):
                raise ZmtpViolation(f"a frame with the reserved flags {flags:#04x}")
            header = 9 if flags & _LONG else 2
            if len(buffer) < header:
                break
            size = struct.unpack_from(">Q", buffer, 1)[0] if flags & _LONG else buffer[1]
            self._check_frame(flags, size)
            if len(buffer) < header + size:
                break
            body = bytes(buffer[header : header + size])
            del buffer[: header + size]
            if flags & _COMMAND:
                commands += 1
                replies.append(self._command(body))
                continue
            self._parts.append(body)
            self._part_bytes += size
            if not flags & _MORE:
                messages.append(self._parts)
                self._parts = []
                self._part_bytes = 0
        self.stopped_short = False
        return messages, b"".join(replies)

    def _check_frame(self, flags: int, size: int) -> None:
        if flags & _COMMAND:
            if flags & _MORE:
                raise ZmtpViolation("a command frame with MORE set")
            if size > MAX_COMMAND_BYTES:
                raise ZmtpViolation(f"a command of {size} bytes (at most {MAX_COMMAND_BYTES})")
            return
        if not self.ready:
            raise ZmtpViolation("a message before the READY command")
        if len(self._parts) >= MAX_PARTS:
            raise ZmtpViolation(f"a message of more than {MAX_PARTS} parts")
        if self._part_bytes + size > MAX_MESSAGE_BYTES:
            raise ZmtpViolation(f"a message of more than {MAX_MESSAGE_BYTES} bytes (a part of {size})")

    def _command(self, body: bytes) -> bytes:
        """What a command asks of the daemon: the peer's READY once, answered with the daemon's (only once the peer's
        socket type is known to be served: a peer refused gets an ERROR in its place), then heartbeats; anything else
        is a violation."""
        name = body[1 : 1 + body[0]] if body else b""
        data = body[1 + len(name) :]
        if not body or len(name) < body[0]:
            raise ZmtpViolation("a command frame without a whole name")
        if not self.ready:
            if name != b"READY":
                raise ZmtpViolation(f"the command {name[:32]!r} in place of READY")
            socket_type = properties(data).get(b"Socket-Type")
            if socket_type != SOCKET_TYPE:
                kind = "a socket of no type" if socket_type is None else \
                    f"a {socket_type[:32].decode('ascii', 'replace')} socket"
                raise ZmtpViolation(f"a READY from {kind}: the hbmd control socket serves only DEALER sockets "
                                    "(hbmd.client's)")
            self.ready = True
            return READY
        if name == b"PING" and 2 <= len(data) <= 18:
            return encode_command(b"PONG", data[2:])
        if name == b"PONG" and len(data) <= 16:
            return b""
        raise ZmtpViolation(f"the command {name[:32]!r} ({len(data)} bytes) after READY")
