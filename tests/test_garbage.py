"""A live daemon under a seeded, bounded barrage of garbage on both of its sockets.

The promise (SPEC, daemon): every request is validated and a bad one gets an
error reply; the daemon never crashes on input, never leaks a handle or an
FD, and never changes state on a failed request. A legitimate session's
bytes survive whatever other peers send.
"""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import struct
import subprocess
import time
import typing

import msgpack
import pytest
import zmq
from hbmd import proto
from hbmd.client import ExtensibleTensor, NotFound
from hbmd.proto import codec
from hbmd.proto.errors import ErrorCode, ProtocolError
from hbmd.proto.instance import InstancePaths
from helpers import MiB, filled, torch, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]

SEED = 20261202
REPLY_TIMEOUT_MS = 5000
SILENT_PEER_DROP_S = 10.0
"""The daemon drops a peer that never says hello after ~5 s; this allows for its 1 s poll."""

REQUESTS = proto.requests()
NOT_REQUESTS = sorted(set(codec._KINDS.values()) - set(REQUESTS), key=lambda cls: cls.KIND)
# Integers on the edges of every range check, all within msgpack's 64 bits. None is a reservation
# between 2**33 bytes and the daemon's 2**50 limit: the one huge reservation is checked on its own.
EDGE_INTS = [0, 1, -1, 7, 4096, 2 * MiB, 2 * MiB + 1, 2**31 - 1, 2**31, 2**32, 2**53, 2**62, 2**63 - 1, 2**64 - 1,
             -(2**63)]
ABSURD_INTS = [-1, 0, -(2**63), 2**62, 2**63 - 1, 2**64 - 1]
# What msgpack cannot encode for an int field, spelled as what a peer can send instead.
RAW_NOT_INTS = {
    "2**70 as float64": b"\xcb" + struct.pack(">d", 2.0**70),
    "2**70 as ext": b"\xc7\x09\x01" + (2**70).to_bytes(9, "big"),
    "2**70 as bin": b"\xc4\x09" + (2**70).to_bytes(9, "big"),
    "2**70 as str": msgpack.packb(str(2**70)),
    "true": b"\xc3",
    "nil": b"\xc0",
    "timestamp ext": b"\xd6\xff" + struct.pack(">I", 7),
    "nested list": b"\x91" * 50 + b"\x01",
}
ABSURD_STRINGS = ["", "\x00", "\n\r\t", "../../etc/passwd", "uid:0", "é" * 5000, "x" * 100_000]
LONG_NAME = "n" * (proto.MAX_FRAME_BYTES - 1024)
"""A name that fits one frame, but not twice over: what an error reply may echo of it matters."""
DEEP = b"\x91" * 1015 + b"\x01"
"""Nested lists as deep as msgpack unpacks inside an envelope and a body (its limit is 1024 levels in all)."""
PLACEHOLDER = "\x00placeholder\x00"


def daemon_state(client) -> tuple:
    """What a failed request must leave alone: the totals and every buffer."""
    status = client.status()
    totals = (status.committed_bytes, status.reserved_bytes, status.num_buffers, status.num_chunks, status.num_sessions)
    return totals, sorted(client.buffers(), key=lambda b: b.buffer_id)


def fd_links(pid: int) -> list[str]:
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed while we looked
            pass
    return sorted(links)


def fail_with_log(daemon, headline: str, problems: list[str]) -> typing.NoReturn:
    pytest.fail(f"{headline}; problems so far:\n" + "\n".join(problems[:60]) + f"\nlog tail:\n{daemon.log()[-4000:]}")


def fds_leaked(daemon, fds_before: int) -> int:
    """How many more FDs the daemon holds than before, once it has closed its peers (it does so asynchronously)."""
    try:
        wait_until(lambda: daemon.open_fds() == fds_before, timeout=10)
    except TimeoutError:
        pass
    return daemon.open_fds() - fds_before


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def random_value(rng: random.Random, depth: int = 0) -> typing.Any:
    """Any msgpack value: scalars of every type, lists and maps (with keys msgpack allows but hbmd refuses)."""
    if depth < 3 and rng.random() < 0.3:
        if rng.random() < 0.5:
            return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
        keys = [rng.choice(["id", "token", "body", "buffer_id", ""]), rng.randbytes(3), rng.randrange(-3, 3)]
        return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return rng.choice(
        [
            lambda: None,
            lambda: rng.random() < 0.5,
            lambda: rng.choice(EDGE_INTS),
            lambda: rng.uniform(-1e18, 1e18),
            lambda: rng.randbytes(rng.randrange(12)).decode("latin-1"),
            lambda: rng.randbytes(rng.randrange(12)),
            lambda: msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randrange(9))),
        ]
    )()


def sample_value(tp: typing.Any) -> typing.Any:
    """A valid value of a field type."""
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: sample_value(hints[f.name]) for f in dataclasses.fields(tp)})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return [sample_value(args[0])]
    if origin is dict:
        return {"k": sample_value(args[1])}
    if args:  # a union: its first option
        return sample_value(args[0])
    return {int: 1, str: "s", bool: True, float: 0.5}[tp]


def sample_wire(cls: type) -> dict:
    return codec.to_wire(sample_value(cls))


def random_request(rng: random.Random, buffer_ids: list[int], session_ids: list[int]) -> proto.Message:
    """A well-typed request with edge-case values, aimed at real buffers and sessions part of the time."""
    cls = rng.choice(REQUESTS)
    hints = typing.get_type_hints(cls)
    fields = {}
    for field in dataclasses.fields(cls):
        tp = hints[field.name]
        if field.name == "buffer_id" and buffer_ids and rng.random() < 0.7:
            fields[field.name] = rng.choice(buffer_ids)
        elif field.name == "session_id" and session_ids and rng.random() < 0.7:
            fields[field.name] = rng.choice(session_ids)
        elif field.name == "persistent":
            # A persistent buffer would outlive the attacker by design: leave those out of the random part.
            continue
        elif tp is int:
            fields[field.name] = rng.choice(EDGE_INTS)
        elif tp is bool:
            fields[field.name] = rng.random() < 0.5
        elif tp is str:
            fields[field.name] = rng.choice(ABSURD_STRINGS)
        else:
            fields[field.name] = sample_value(tp)
    return cls(**fields)


def pack_with(value: typing.Any, raw: bytes) -> bytes:
    """``value`` packed, its one ``PLACEHOLDER`` string replaced by the raw msgpack bytes ``raw``.

    How the test sends what ``msgpack.packb`` refuses to build: integers past
    64 bits spelled as other types, nesting past its recursion limit.
    """
    packed, marker = msgpack.packb(value), msgpack.packb(PLACEHOLDER)
    assert packed.count(marker) == 1
    return packed.replace(marker, raw)


class ControlAttacker:
    """Raw DEALER sockets on the control endpoint; every reply is checked and every problem noted."""

    def __init__(self, endpoint: str, problems: list[str], daemon) -> None:
        self.context = zmq.Context()
        self.endpoint = endpoint
        self.problems = problems
        self.daemon = daemon
        self.sent = 0
        self.unanswered = 0
        self.sock = self.dealer()

    def dealer(self) -> zmq.Socket:
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        return sock

    def ask(self, frames: list[bytes], what: str, timeout_ms: int = REPLY_TIMEOUT_MS) -> proto.Message | None:
        """Send ``frames``; the reply must come, decode, carry the request's id, and be either the
        request's own reply kind or an error other than ``internal_error``."""
        self.sock.send_multipart(frames)
        self.sent += 1
        if not self.sock.poll(timeout_ms):
            self.problems.append(f"{what}: no reply within {timeout_ms} ms")
            # A late reply would be taken for the next request's.
            self.sock.close(linger=0)
            self.sock = self.dealer()
            self.unanswered += 1
            # Stop at once rather than wait out every remaining message on a dead or hung daemon.
            if not self.daemon.alive() or self.unanswered >= 3:
                fail_with_log(self.daemon, f"the daemon stopped answering at {what}", self.problems)
            return None
        reply = self.sock.recv_multipart()
        try:
            envelope = proto.decode_frames(reply)
        except ProtocolError as exc:
            size = sum(map(len, reply))
            self.problems.append(f"{what}: the reply ({size} bytes) does not decode: {exc.message[:100]}")
            return None
        if envelope.request_id != proto.peek_request_id(frames):
            self.problems.append(f"{what}: reply to request {envelope.request_id}, not {proto.peek_request_id(frames)}")
        body = envelope.body
        if isinstance(body, proto.ErrorReply):
            if body.code == ErrorCode.INTERNAL.wire or body.code not in {code.wire for code in ErrorCode}:
                self.problems.append(f"{what}: {body.code} reply: {body.message[:200]}")
            elif "Traceback" in body.message or "\n" in body.message:
                self.problems.append(f"{what}: the error message is not one line: {body.message[:200]!r}")
            return body
        try:
            kind = codec.kind_class(frames[0].decode("ascii"))
        except (ProtocolError, UnicodeDecodeError, IndexError):
            kind = None
        expected = kind.Reply if kind in REQUESTS else None
        if type(body) is not expected:
            self.problems.append(f"{what}: answered with {body.KIND}")
        return body

    def refused(self, frames: list[bytes], what: str, code: ErrorCode, timeout_ms: int = REPLY_TIMEOUT_MS) -> None:
        reply = self.ask(frames, what, timeout_ms)
        if reply is not None and not (isinstance(reply, proto.ErrorReply) and reply.code == code.wire):
            self.problems.append(f"{what}: expected {code.wire}, got {reply}")

    def close(self) -> None:
        self.context.destroy(linger=0)


def handle_socket(paths: InstancePaths) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.settimeout(5)
    sock.connect(os.fspath(paths.handles))
    return sock


def hello(version=(1, 0), **fields) -> bytes:
    return proto.encode_datagram(proto.Hello(list(version), os.getpid(), "garbage", **fields))


def fd_probe() -> tuple[socket.socket, socket.socket]:
    """``(sent, watcher)``: once every copy of ``sent`` is closed, ``watcher`` reads EOF."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


class Barrage:
    """The attacks, one method per socket and kind of garbage; what went wrong lands in ``problems``."""

    def __init__(self, daemon, legit, rng: random.Random) -> None:
        self.daemon = daemon
        self.legit = legit
        self.rng = rng
        self.paths = InstancePaths.of(daemon.run_dir, "host")
        self.problems: list[str] = []
        self.control = ControlAttacker(self.paths.endpoint, self.problems, daemon)
        self.datagrams = 0
        self.connections = 0
        self.open_sockets: list[socket.socket] = []
        self.attacker = daemon.connect(client_name="attacker", lease=False)
        self.token = self.attacker.welcome.token
        self.buffer_ids = [self.attacker.create_buffer(8 * MiB, 2).buffer_id]
        self.session_ids = [self.attacker.session_id, legit.session_id]

    @property
    def messages(self) -> int:
        return self.control.sent + self.datagrams + self.connections

    def run(self, phase: str, *args: int) -> None:
        """Run one attack; if the daemon dies under it, fail with what was seen so far and its log."""
        try:
            getattr(self, phase)(*args)
        except OSError:
            if self.daemon.alive():
                raise
        if not self.daemon.alive():
            exit_code = self.daemon.proc.returncode
            fail_with_log(self.daemon, f"the daemon died during {phase} (exit {exit_code})", self.problems)

    def request_id(self) -> int:
        """A new id of the attacker's session, past its client's own and every one before, by a random step: the
        daemon does no request that changes state older than one of the session it answered."""
        control = self.attacker._core.control
        control.requests_sent += self.rng.randrange(1, 2**40)
        return control.requests_sent

    def request(self, msg: proto.Message, token: str | None = None) -> list[bytes]:
        return proto.encode_frames(msg, self.request_id(), self.token if token is None else token)

    # control plane

    def random_frames(self, count: int) -> None:
        """Random byte frames, one to five of them, of random lengths: each gets an error reply."""
        for i in range(count):
            lengths = [self.rng.choice([0, 1, 2, 9, 40, 300, 4096]) for _ in range(self.rng.randint(1, 5))]
            frames = [self.rng.randbytes(length) for length in lengths]
            if self.rng.random() < 0.5:  # a real kind in front, to get past the routing
                frames[0] = self.rng.choice(list(codec._KINDS)).encode()
            self.control.ask(frames, f"random frames #{i}")

    def mutated_requests(self, count: int) -> None:
        """Valid requests truncated, bit-flipped, spliced or with frames added, dropped or swapped."""
        for i in range(count):
            frames = self.request(random_request(self.rng, self.buffer_ids, self.session_ids))
            payload = bytearray(frames[1])
            how = self.rng.choice(["truncate", "flip", "splice", "extra frame", "one frame", "swap", "kind"])
            if how == "truncate":
                frames[1] = bytes(payload[: self.rng.randrange(len(payload))])
            elif how == "flip":
                for _ in range(self.rng.randint(1, 4)):
                    payload[self.rng.randrange(len(payload))] = self.rng.randrange(256)
                frames[1] = bytes(payload)
            elif how == "splice":
                at = self.rng.randrange(len(payload))
                frames[1] = bytes(payload[:at]) + self.rng.randbytes(self.rng.randint(1, 16)) + bytes(payload[at:])
            elif how == "extra frame":
                frames.insert(self.rng.randrange(3), self.rng.randbytes(self.rng.randrange(8)))
            elif how == "one frame":
                frames = [frames[self.rng.randrange(2)]]
            elif how == "swap":
                frames.reverse()
            else:
                frames[0] = self.rng.choice(list(codec._KINDS)).encode()
            self.control.ask(frames, f"mutated request #{i} ({how})")

    def wrong_shapes(self, count: int) -> None:
        """Valid msgpack of the wrong shape: any value as the payload, as the body, or in place of one field."""
        for i in range(count):
            kind = self.rng.choice(list(codec._KINDS))
            shape = self.rng.choice(["payload", "body", "field", "envelope field"])
            msg = random_request(self.rng, self.buffer_ids, self.session_ids)
            payload: typing.Any = {"id": self.request_id(), "token": self.token, "body": codec.to_wire(msg)}
            if shape == "payload":
                payload = random_value(self.rng)
            elif shape == "body":
                payload["body"] = random_value(self.rng)
            elif shape == "field" and payload["body"]:
                payload["body"][self.rng.choice(list(payload["body"]))] = random_value(self.rng)
                kind = msg.KIND
            else:
                field = self.rng.choice(["id", "token"])
                payload[field] = random_value(self.rng)
                if field == "id" and type(payload["id"]) is int and 0 < payload["id"] < 2**63:
                    # An id past the client's own moves the session on: the client's next is past it too, and
                    # still an id.
                    payload["id"] %= 2**62
                    control = self.attacker._core.control
                    control.requests_sent = max(control.requests_sent, payload["id"])
            self.control.ask([kind.encode(), msgpack.packb(payload)], f"wrong shape #{i} ({shape}, {kind})")

    def unknown_kinds(self) -> None:
        """Kinds nobody registered, near misses of real ones, and non-ASCII: a protocol error each."""
        near = ["buffer.commit ", "BUFFER.COMMIT", "buffer.commit\x00", "buffer.", ".", "", "admin.status\n", "admin"]
        kinds = [k.encode() for k in near] + ["bufer.cömmit".encode(), b"\xff\xfe", b"\x00" * 64]
        kinds += [self.rng.randbytes(self.rng.randint(1, 40)) for _ in range(60)]
        for kind in kinds:
            frames = self.request(proto.Status())
            self.control.refused([kind, frames[1]], f"unknown kind {kind[:40]!r}", ErrorCode.PROTOCOL)

    def replies_as_requests(self) -> None:
        """Every kind that is not a request (replies, handshake and FD headers), with a valid token: refused."""
        for cls in NOT_REQUESTS:
            wire = sample_wire(cls)
            for token in (self.token, "", "f" * 32):
                frames = [cls.KIND.encode(), msgpack.packb({"id": 5, "token": token, "body": wire})]
                self.control.refused(frames, f"{cls.KIND} sent as a request", ErrorCode.PROTOCOL)
        # Deep nesting in the one union field (the details' values), whose decoding error shows the value.
        body = {"code": "x", "message": "m", "retryable": False, "details": {"a": PLACEHOLDER}}
        frames = [b"error", pack_with({"id": 6, "token": self.token, "body": body}, DEEP)]
        self.control.refused(frames, "an error reply with 1015-deep details sent as a request", ErrorCode.PROTOCOL)

    def bad_tokens(self) -> None:
        """Forged, stale, empty and mistyped tokens: refused, and nothing changes."""
        stale = self.daemon.connect(client_name="stale", lease=False)
        stale_token = stale.welcome.token
        stale.close()
        wait_until(lambda: all(s.session_id != stale.session_id for s in self.legit.sessions()))
        legit_buffer = self.legit.buffers(self.legit.session_id)[0].buffer_id
        tokens = {
            "forged": f"{self.rng.getrandbits(128):032x}",
            "stale": stale_token,
            "empty": "",
            "one char off": self.token[:-1] + ("0" if self.token[-1] != "0" else "1"),
            "prefix": self.token[:16],
            "padded": self.token + " ",
            "long": "a" * 100_000,
        }
        for name, token in tokens.items():
            for msg in (proto.Status(), proto.Commit(legit_buffer, 8 * MiB), proto.Free(legit_buffer)):
                before = daemon_state(self.legit)
                self.control.refused(self.request(msg, token), f"{name} token on {msg.KIND}", ErrorCode.PERMISSION)
                if daemon_state(self.legit) != before:
                    self.problems.append(f"{name} token on {msg.KIND} changed the daemon's state")
        for name, raw in {"int": b"\x07", "bin": b"\xc4\x01t", "nil": b"\xc0", "list": b"\x91\xa1t"}.items():
            payload = pack_with({"id": 8, "token": PLACEHOLDER, "body": {}}, raw)
            self.control.refused([b"admin.status", payload], f"{name} as the token", ErrorCode.PROTOCOL)

    def absurd_values(self) -> None:
        """Valid token, every request, every int field at the edges of 64 bits (and past them, hand-built),
        every str field absurd: refused or served, never an internal error, and a refusal changes nothing."""
        own_buffer = self.buffer_ids[0]
        base = {"buffer_id": own_buffer, "session_id": self.attacker.session_id, "capacity": 8 * MiB,
                "num_segments": 2, "bytes_per_segment": 2 * MiB, "bytes": 2 * MiB, "name": "absent",
                "persistent": False, "shareable": False}
        for cls in REQUESTS:
            hints = typing.get_type_hints(cls)
            fields = {f.name: base.get(f.name, sample_value(hints[f.name])) for f in dataclasses.fields(cls)}
            for field in dataclasses.fields(cls):
                tp = hints[field.name]
                values = ABSURD_INTS if tp is int else [*ABSURD_STRINGS, LONG_NAME] if tp is str else []
                for value in values:
                    msg = cls(**{**fields, field.name: value})
                    self.ask_unchanged(self.request(msg), f"{cls.KIND}.{field.name}={value!r:.30}")
                for name, raw in RAW_NOT_INTS.items() if tp is int else ():
                    body = {**codec.to_wire(fields), field.name: PLACEHOLDER}
                    frames = [cls.KIND.encode(), pack_with({"id": 9, "token": self.token, "body": body}, raw)]
                    self.ask_unchanged(frames, f"{cls.KIND}.{field.name} = {name}", ErrorCode.PROTOCOL)

    def ask_unchanged(self, frames: list[bytes], what: str, code: ErrorCode | None = None) -> None:
        before = daemon_state(self.legit)
        reply = self.control.ask(frames, what)
        if isinstance(reply, proto.ErrorReply):
            if code is not None and reply.code != code.wire:
                self.problems.append(f"{what}: expected {code.wire}, got {reply.code}")
            if daemon_state(self.legit) != before:
                self.problems.append(f"{what}: refused ({reply.code}) but the daemon's state changed")
            return
        if code is not None:
            self.problems.append(f"{what}: expected {code.wire}, got {reply}")
        if isinstance(reply, proto.BufferCreated):  # a legal reservation: give it back
            self.attacker.free(reply.buffer.buffer_id)

    def over_budget(self) -> None:
        """A commit past the budget is refused whole: nothing half-allocated."""
        big = self.attacker.create_buffer(512 * MiB, 1)
        budget = self.legit.status().budget_bytes
        self.ask_unchanged(self.request(proto.Commit(big.buffer_id, min(budget + 2 * MiB, 512 * MiB))),
                           "a commit past the budget", ErrorCode.OUT_OF_BUDGET)
        self.attacker.free(big.buffer_id)

    def huge_reservation(self) -> None:
        """Reserving commits nothing, so it must cost the daemon next to nothing, even at 1 PiB."""
        before = rss_bytes(self.daemon.pid)
        reply = self.control.ask(self.request(proto.CreateBuffer(1 << 50, 1)), "a 1 PiB reservation")
        grown = rss_bytes(self.daemon.pid) - before
        if grown > 64 * MiB:
            self.problems.append(f"a 1 PiB reservation, committing nothing, grew the daemon's RSS by {grown >> 20} MiB")
        if isinstance(reply, proto.BufferCreated):
            self.attacker.free(reply.buffer.buffer_id)

    def foreign_buffers(self) -> None:
        """Another session's buffer: every operation is NotFound (as a missing one) and changes nothing."""
        intruder = self.daemon.connect(client_name="intruder", lease=False)
        try:
            victim = self.legit.buffers(self.legit.session_id)[0].buffer_id
            before = daemon_state(self.legit)
            for what, call in {
                "commit": lambda: intruder.commit(victim, 8 * MiB).close(),
                "release": lambda: intruder.release(victim),
                "free": lambda: intruder.free(victim),
            }.items():
                try:
                    call()
                    self.problems.append(f"another session's {what} of buffer {victim} succeeded")
                except NotFound:
                    pass
                self.control.sent += 1
            for msg in (proto.Commit(victim, 6 * MiB), proto.Release(victim), proto.Free(victim),
                        proto.Defragment(victim, True), proto.FinishDefragment(victim, True)):
                self.control.refused(self.request(msg, intruder.welcome.token), f"another session's {msg.KIND}",
                                     ErrorCode.NOT_FOUND)
            if daemon_state(self.legit) != before:
                self.problems.append("another session's refused requests changed the daemon's state")
        finally:
            intruder.close()

    def oversized_frames(self) -> None:
        """Frames past MAX_FRAME_BYTES: an error reply, or (past the socket's MAXMSGSIZE) a dropped peer."""
        just_over = self.request(proto.Status())
        just_over[1] += b"\x00" * (proto.MAX_FRAME_BYTES + 1 - len(just_over[1]))
        self.control.refused(just_over, "a payload one byte over MAX_FRAME_BYTES", ErrorCode.PROTOCOL)
        long_kind = [b"k" * (proto.MAX_FRAME_BYTES - 64), self.request(proto.Status())[1]]
        self.control.refused(long_kind, "a kind frame of nearly MAX_FRAME_BYTES", ErrorCode.PROTOCOL)
        for size in (2 * proto.MAX_FRAME_BYTES, 16 * proto.MAX_FRAME_BYTES):
            dropped = self.control.dealer()
            dropped.send_multipart([b"admin.status", b"\x00" * size])
            self.control.sent += 1
            dropped.poll(200)
            dropped.close(linger=0)

    def stall(self) -> None:
        """A maximal garbage frame is refused within 1 s: the daemon serves one request at a time,
        so however long it takes is how long every other client waits."""
        chunk_ids = [1] * (proto.MAX_FRAME_BYTES - 256)
        body = msgpack.packb({"request_id": 1, "chunk_ids": chunk_ids, "batch": 0, "batches": 1})
        frames = [b"session.fds", pack_with({"id": 3, "token": self.token, "body": PLACEHOLDER}, body)]
        started = time.monotonic()
        self.control.refused(frames, f"a {len(frames[1]) / MiB:.1f} MiB session.fds frame", ErrorCode.PROTOCOL,
                             timeout_ms=60_000)
        took = time.monotonic() - started
        if took > 1.0:
            self.problems.append(f"a {len(frames[1]) / MiB:.1f} MiB session.fds frame held the daemon for {took:.1f} s")

    def raw_streams(self) -> None:
        """Bytes that are not ZMTP at all, and a ZMTP greeting announcing a 2**63-byte frame."""
        path = os.fspath(self.paths.control)
        greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
        streams = [self.rng.randbytes(self.rng.randint(1, 2000)) for _ in range(30)]
        handshake = greeting + b"\x04" + bytes([len(ready)]) + ready
        streams.append(handshake + b"\x02" + struct.pack(">Q", 2**63 - 1))
        streams.append(handshake + b"\x02" + struct.pack(">Q", 2**64 - 1) + b"x" * 100)
        streams.append(greeting[:11])
        for data in streams:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                sock.connect(path)
                try:
                    sock.sendall(data)
                except OSError:  # libzmq may hang up mid-stream: that is its right
                    pass
            self.connections += 1

    # handle plane

    def expect_refusal(self, sock: socket.socket, what: str, codes: set[ErrorCode]) -> None:
        """The daemon answers a bad hello with a Refused datagram, then closes the connection."""
        try:
            first = sock.recv(65536)
            reply = proto.decode_datagram(first) if first else None
            if not isinstance(reply, proto.Refused) or reply.code not in {c.wire for c in codes}:
                self.problems.append(f"{what}: expected a refusal {sorted(c.wire for c in codes)}, got {reply}")
            elif sock.recv(65536) != b"":
                self.problems.append(f"{what}: refused but the connection stayed open")
        except (OSError, ProtocolError) as exc:
            self.problems.append(f"{what}: {exc!r} instead of a refusal")

    def bad_hellos(self) -> None:
        """Random bytes, wrong versions, wrong types and wrong kinds instead of a hello: refused, connection closed."""
        cases: list[tuple[str, bytes, set[ErrorCode]]] = []
        for i in range(120):
            cases.append((f"random bytes #{i}", self.rng.randbytes(self.rng.randint(1, 3000)), {ErrorCode.PROTOCOL}))
        for version in ([0, 0], [2, 0], [], [99, 0], [2**64 - 1, 0], [-(2**63), 0], [-1, 0], [0]):
            cases.append((f"version {version}", hello(version), {ErrorCode.VERSION_MISMATCH}))
        for name, raw in {"str version": msgpack.packb(["1", "0"]), "float version": msgpack.packb([1.0, 0]),
                          "version as str": msgpack.packb("1.0"), "bool version": msgpack.packb([True, False]),
                          "2**70 in version": b"\x92\xcb" + struct.pack(">d", 2.0**70) + b"\x00"}.items():
            data = pack_with({"kind": "session.hello", "body": {"version": PLACEHOLDER, "pid": 1}}, raw)
            cases.append((name, data, {ErrorCode.PROTOCOL}))
        for tenant in ("uid:0", "\x00", "t" * 10_000):
            cases.append((f"tenant {tenant[:10]!r}", hello(tenant=tenant), {ErrorCode.PERMISSION, ErrorCode.INVALID}))
        for msg in (proto.Commit(1, 2 * MiB), proto.Status(), proto.Refused("x", "y"), proto.FdBatch(1, [1], 0, 1),
                    proto.ErrorReply("internal_error", "x", False)):
            cases.append((f"a {msg.KIND} datagram as the hello", proto.encode_datagram(msg), {ErrorCode.PROTOCOL}))
        cases.append(("a hello without fields", msgpack.packb({"kind": "session.hello"}), {ErrorCode.PROTOCOL}))
        cases.append(("a hello as a list", msgpack.packb(["session.hello", {}]), {ErrorCode.PROTOCOL}))
        for what, data, codes in cases:
            with handle_socket(self.paths) as sock:
                sock.send(data)
                self.datagrams += 1
                self.expect_refusal(sock, what, codes)

    def lenient_hellos(self) -> None:
        """Hellos of the right major with a missing, huge, negative or extra minor: a welcome or a refusal."""
        for version in ([1], [1, 2**64 - 1], [1, 0, 0], [1, -1]):
            with handle_socket(self.paths) as sock:
                sock.send(hello(version))
                self.datagrams += 1
                try:
                    reply = proto.decode_datagram(sock.recv(65536))
                except (OSError, ProtocolError) as exc:
                    self.problems.append(f"hello {version}: {exc!r}")
                    continue
                if not isinstance(reply, (proto.Welcome, proto.Refused)):
                    self.problems.append(f"hello {version}: answered with {reply}")

    def oversized_datagrams(self) -> None:
        """Datagrams past the daemon's 64 KiB buffer, before and after a hello: dropped, and nothing else."""
        for size in (64 * 1024 + 1, 150 * 1024):
            sock = handle_socket(self.paths)
            self.open_sockets.append(sock)
            sock.send(b"\x00" * size)
            sock.send(hello())
            self.datagrams += 2
            try:
                welcome = proto.decode_datagram(sock.recv(65536))
            except (OSError, ProtocolError) as exc:
                self.problems.append(f"a hello after a {size}-byte datagram: {exc!r}")
                continue
            if not isinstance(welcome, proto.Welcome):
                self.problems.append(f"a hello after a {size}-byte datagram: {welcome} instead of a welcome")
                continue
            sock.send(b"\x01" * size)
            self.datagrams += 1
            if all(s.session_id != welcome.session_id for s in self.legit.sessions()):
                self.problems.append(f"a {size}-byte datagram after the hello ended the session")

    def hit_and_run(self) -> None:
        """Peers that connect and close at once, or say hello and vanish before the welcome."""
        for i in range(60):
            sock = handle_socket(self.paths)
            if i % 2:
                sock.send(hello())
                self.datagrams += 1
            sock.close()
            self.connections += 1

    def unsolicited_fds(self) -> None:
        """FDs sent to the daemon, before and after a hello, within and past its 16-FD limit: it closes them all.

        Each probe is one end of a socket pair whose other end reads EOF only
        once every copy, the daemon's included, is closed.
        """
        cases = [
            ("riding on the hello", hello(), 3, "with hello"),
            ("on garbage instead of a hello", b"\xc1garbage", 3, "garbage"),
            ("on an empty datagram before the hello", b"", 3, "before hello"),
            ("after the hello", b"\x00", 3, "after hello"),
            ("after the hello, 20 at once", b"\x00", 20, "after hello"),
            ("after the hello, on an oversized datagram", b"\x00" * (100 * 1024), 3, "after hello"),
            ("after the hello, on a second hello", hello(), 3, "after hello"),
        ]
        devnull = os.open(os.devnull, os.O_RDONLY)
        memfd = os.memfd_create("hbmd-garbage-probe")
        try:
            for what, data, count, stage in cases:
                sock = handle_socket(self.paths)
                self.open_sockets.append(sock)
                if stage == "after hello":
                    sock.send(hello())
                    welcome = proto.decode_datagram(sock.recv(65536))
                probes = [fd_probe() for _ in range(count)]
                extra = [devnull, memfd] if count < 16 else []
                socket.send_fds(sock, [data], [sent.fileno() for sent, _ in probes] + extra)
                self.datagrams += 1
                for sent, _ in probes:
                    sent.close()
                if stage == "before hello":
                    sock.send(hello())
                    self.datagrams += 1
                for _, watcher in probes:
                    watcher.settimeout(5)
                    try:
                        if watcher.recv(1) != b"":
                            self.problems.append(f"FDs {what}: a probe received data")
                    except TimeoutError:
                        self.problems.append(f"FDs {what}: the daemon kept an unsolicited FD open for 5 s")
                    watcher.close()
                if stage == "garbage":
                    self.expect_refusal(sock, f"FDs {what}", {ErrorCode.PROTOCOL})
                elif stage == "after hello":
                    if all(s.session_id != welcome.session_id for s in self.legit.sessions()):
                        self.problems.append(f"FDs {what}: the session ended")
                else:
                    reply = proto.decode_datagram(sock.recv(65536))
                    if not isinstance(reply, proto.Welcome):
                        self.problems.append(f"FDs {what}: {reply} instead of a welcome")
        finally:
            os.close(devnull)
            os.close(memfd)

    def deep_hello(self) -> None:
        """A hello-plane datagram nested as deep as msgpack unpacks: refused like any other bad hello."""
        body = {"code": "x", "message": "m", "retryable": False, "details": {"a": PLACEHOLDER}}
        data = pack_with({"kind": "error", "body": body}, DEEP)
        with handle_socket(self.paths) as sock:
            sock.send(data)
            self.datagrams += 1
            self.expect_refusal(sock, "an error datagram with 1015-deep details as the hello", {ErrorCode.PROTOCOL})

    def close(self) -> None:
        for sock in self.open_sockets:
            sock.close()
        self.control.close()
        self.attacker.close()


@pytest.mark.system
def test_a_barrage_of_garbage_on_every_socket_changes_nothing(daemon):
    """Thousands of bad messages on both sockets: the daemon stays up, answers each bad request with a
    clean error, closes every FD it was sent, and a legitimate session's bytes and budget are untouched.

    No session here takes leases, so that the daemon's descriptors stay still (hostile placements of
    leased granules: test_leases.py)."""
    client = daemon.connect(client_name="test", lease=False)
    rng = random.Random(SEED)
    legit = ExtensibleTensor(16 * MiB, "cpu", num_segments=2, client=client)
    legit.resize_per_segment_(5 * MiB)
    view = legit.full_view()
    generator = torch.Generator().manual_seed(SEED)
    pattern = torch.randint(0, 256, (2, 5 * MiB), dtype=torch.uint8, generator=generator)
    view[: 5 * MiB] = pattern[0]
    view[8 * MiB : 13 * MiB] = pattern[1]
    # This call also settles our control connection, which the daemon accepts asynchronously, before counting.
    legit_bytes = client.status().committed_bytes
    fds_before = daemon.open_fds()
    links_before = fd_links(daemon.pid)

    silent = handle_socket(InstancePaths.of(daemon.run_dir, "host"))
    silent_since = time.monotonic()
    barrage = Barrage(daemon, client, rng)
    started = time.monotonic()
    try:
        for phase in ("random_frames", "mutated_requests", "wrong_shapes"):
            barrage.run(phase, 600)
        for phase in ("unknown_kinds", "replies_as_requests", "bad_tokens", "absurd_values", "over_budget",
                      "huge_reservation", "foreign_buffers", "oversized_frames", "stall", "raw_streams",
                      "bad_hellos", "lenient_hellos", "oversized_datagrams", "hit_and_run", "unsolicited_fds",
                      "deep_hello"):
            barrage.run(phase)
        # The silent peer: dropped by the daemon without a word (waited for once, here).
        silent.settimeout(max(0.1, SILENT_PEER_DROP_S - (time.monotonic() - silent_since)))
        try:
            if silent.recv(65536) != b"":
                barrage.problems.append("a peer that never said hello got a datagram")
        except TimeoutError:
            barrage.problems.append(f"a peer that never said hello was still connected after {SILENT_PEER_DROP_S} s")
    finally:
        silent.close()
        barrage.close()
    barrage_s = time.monotonic() - started

    try:
        daemon.proc.wait(timeout=1)  # a daemon that crashed on the last attack may still be on its way out
    except subprocess.TimeoutExpired:
        pass
    if not daemon.alive():
        print(f"\nreliability: messages fuzzed={barrage.messages}, clients killed=0, crashes=1 (seed {SEED})")
        fail_with_log(daemon, f"the daemon died during the barrage (exit {daemon.proc.returncode})", barrage.problems)
    try:
        # The attackers' sessions end as the daemon reads their sockets' EOF: let it catch up.
        wait_until(lambda: client.status().num_sessions == 1, timeout=10)
    except AssertionError:
        pass  # what is left is reported below
    status = client.status()
    leaked_fds = fds_leaked(daemon, fds_before)
    leaked_bytes = status.committed_bytes - legit_bytes
    overruns = int(status.committed_bytes > status.budget_bytes)
    print(
        f"\nreliability: messages fuzzed={barrage.messages}, clients killed=0, crashes=0, "
        f"leaked FDs={leaked_fds}, leaked bytes={leaked_bytes}, budget overruns={overruns} "
        f"(barrage {barrage_s:.1f} s, seed {SEED})"
    )

    assert leaked_fds == 0, f"daemon FDs now {fd_links(daemon.pid)}, before {links_before}"
    assert not any("hbmd-garbage-probe" in link for link in fd_links(daemon.pid))
    assert torch.equal(view[: 5 * MiB], pattern[0]) and torch.equal(view[8 * MiB : 13 * MiB], pattern[1])
    assert leaked_bytes == 0 and overruns == 0
    assert status.num_sessions == 1 and status.num_buffers == 1

    fresh = daemon.connect(client_name="after the barrage", lease=False)
    try:
        t = ExtensibleTensor(8 * MiB, "cpu", client=fresh)
        t.resize_(4 * MiB)
        t.full_view()[: 4 * MiB] = 77
        assert filled(t.full_view()[: 4 * MiB], 77)
        assert fresh.status().committed_bytes == legit_bytes + 4 * MiB
        t.free()
    finally:
        fresh.close()
    assert fds_leaked(daemon, fds_before) == 0, f"daemon FDs now {fd_links(daemon.pid)}, before {links_before}"
    log = daemon.log()
    if "Traceback" in log:
        at = log.index("Traceback")
        barrage.problems.append(f"the daemon logged a traceback: {log[max(0, at - 200) : at + 1500]}")
    assert barrage.problems == [], f"{len(barrage.problems)} problems:\n" + "\n".join(barrage.problems[:60])
