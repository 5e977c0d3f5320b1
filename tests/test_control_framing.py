"""The control socket speaks ZMTP itself, within bounds: a peer that speaks it by hand cannot make the daemon hold
more than a message's worth, and one that breaks it is cut off, changing nothing (SECURITY.md, issue #51).

A ROUTER held the parts of a message whose MORE flag never ended: empty
parts took the daemon past +64 MiB of RSS at 4 MiB sent (past 1 GiB at 32
MiB), and a peer sending 4 KiB parts was never cut off (libzmq 4.3.5 read
them at 3 MB/s). The ZMTP below is spelled out by hand, from RFC 23 and 37,
not taken from the daemon's own module.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from hbmd import proto
from hbmd.daemon.server import control as control_module
from hbmd.daemon.server import control_socket
from hbmd.daemon.server.control import MAX_QUEUED_PER_PEER, ControlQueue, Peer
from hbmd.daemon.server.control_socket import READ_BYTES_PER_TURN, RECEIVE_BYTES, ControlSocket
from hbmd.daemon.server.zmtp import (
    MAX_COMMAND_BYTES,
    MAX_COMMANDS_PER_FEED,
    MAX_MESSAGE_BYTES,
    MAX_PARTS,
    ZmtpPeer,
    ZmtpViolation,
    error_command,
)
from hbmd.daemon.shares import Shares
from hbmd.proto.instance import InstancePaths
from helpers import MiB, wait_until
from zmq.utils.monitor import recv_monitor_message

ATTACK_BYTES = int(os.environ.get("HBMD_ENDLESS_MESSAGE_MIB", "256")) * MiB
RSS_BOUND = 64 * MiB
"""How much the daemon's RSS may grow under an attack (its peak, ``VmHWM``, over its RSS before)."""
CLOSE_WITHIN_S = 2.0
SEED = 51

GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)


def command(name: bytes, data: bytes = b"") -> bytes:
    body = bytes([len(name)]) + name + data
    return (b"\x04" + bytes([len(body)]) if len(body) < 256 else b"\x06" + struct.pack(">Q", len(body))) + body


def prop(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


READY = command(b"READY", prop(b"Socket-Type", b"DEALER") + prop(b"Identity", b""))
READY_OF_A_ROUTER = command(b"READY", prop(b"Socket-Type", b"ROUTER"))
HANDSHAKE = GREETING + READY


def frame(data: bytes, more: bool = False) -> bytes:
    flags = int(more)
    if len(data) < 256:
        return bytes([flags, len(data)]) + data
    return bytes([flags | 0x02]) + struct.pack(">Q", len(data)) + data


def rss(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for pid {pid}")


def sockets_of(pid: int) -> int:
    """The sockets a process holds: a connection the daemon closed is one fewer (its other descriptors, such as the
    host backend's /proc/meminfo, come and go on their own)."""
    fds = f"/proc/{pid}/fd"
    return sum(os.readlink(f"{fds}/{fd}").startswith("socket:") for fd in os.listdir(fds))


def raw_peer(paths: InstancePaths) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    sock.settimeout(5)
    sock.connect(os.fspath(paths.control))
    return sock


def closed_by_daemon(sock: socket.socket, within: float = CLOSE_WITHIN_S) -> bool:
    """Whether the daemon closes ``sock`` within ``within`` seconds (what it sends first is read and dropped)."""
    deadline = time.monotonic() + within
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        pass
    return False


class Engine:
    """A client asking for status all along, on its own thread: every call timed, every failure kept."""

    def __init__(self, client) -> None:
        self.client = client
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            started = time.monotonic()
            try:
                self.client.status()
            except Exception as exc:
                self.failures.append(repr(exc))
            self.latencies.append(time.monotonic() - started)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


# The parser, on its own.


@pytest.mark.unit
def test_a_real_dealers_handshake_and_request_parse_into_the_frames_a_router_gave():
    peer = ZmtpPeer()
    messages, reply = peer.feed(HANDSHAKE[:30])
    assert (messages, reply) == ([], b"")
    messages, reply = peer.feed(HANDSHAKE[30:] + frame(b"admin.status", more=True) + frame(b"x" * 300))
    assert messages == [[b"admin.status", b"x" * 300]]
    assert reply == READY_OF_A_ROUTER
    assert peer.held == 0
    assert peer.feed(command(b"PING", b"\x00\x0actx")) == ([], command(b"PONG", b"ctx"))
    assert peer.feed(frame(b"a", more=True)) == ([], b"") and peer.held == 1


@pytest.mark.unit
@pytest.mark.parametrize("socket_type", [b"REQ", b"ROUTER", b"PUB", None])
def test_the_daemons_ready_answers_a_dealers_only_and_any_other_socket_type_is_refused_naming_it(socket_type):
    """hbmd's clients are DEALERs: a REQ's requests carry a delimiter the daemon's do not (its client waited out its
    timeout), a ROUTER's an identity. The daemon's READY waits for the peer's, so that a refusal can take its
    place (issue #65)."""
    peer = ZmtpPeer()
    assert peer.feed(GREETING) == ([], b"")  # no READY before the peer's says what it is
    ready = command(b"READY", b"" if socket_type is None else prop(b"Socket-Type", socket_type))
    with pytest.raises(ZmtpViolation) as refused:
        peer.feed(ready)
    shown = "a socket of no type" if socket_type is None else f"a {socket_type.decode()} socket"
    assert str(refused.value).startswith(f"a READY from {shown}: the hbmd control socket serves only DEALER sockets")
    assert not peer.ready
    assert ZmtpPeer().feed(GREETING + READY) == ([], READY_OF_A_ROUTER)


@pytest.mark.unit
def test_an_error_command_carries_its_reason_in_printable_ascii_within_a_byte_of_length():
    assert error_command("a REQ socket") == command(b"ERROR", b"\x0ca REQ socket")
    long = error_command("\u00e9\n" + "x" * 400)
    assert long == command(b"ERROR", b"\xff??" + b"x" * 253)


@pytest.mark.unit
@pytest.mark.parametrize(("what", "data"), [
    ("a part past the parts' bound", frame(b"p", more=True) * (MAX_PARTS + 1)),
    ("empty parts past the parts' bound", frame(b"", more=True) * (MAX_PARTS + 1)),
    ("a message past the bytes' bound, from its header", b"\x03" + struct.pack(">Q", MAX_MESSAGE_BYTES + 1)),
    ("parts past the bytes' bound", frame(b"p" * (MAX_MESSAGE_BYTES // 2), more=True) * 3),
    ("a command past its bound", b"\x06" + struct.pack(">Q", MAX_COMMAND_BYTES + 1)),
    ("a length of 2**64 - 1", b"\x02" + b"\xff" * 8),
    ("reserved flags", b"\x08\x00"),
    ("a command with MORE", b"\x05\x05\x04PING"),
    ("a command of another name", command(b"SUBSCRIBE", b"x")),
    ("a second READY", command(b"READY", prop(b"Socket-Type", b"DEALER"))),
])
def test_the_parser_refuses_what_breaks_a_bound_or_the_protocol_before_it_holds_it(what, data):
    """Fed in chunks of 8 KiB, as libzmq hands them over: it holds a message's bound and a chunk at most."""
    peer = ZmtpPeer()
    peer.feed(HANDSHAKE)
    with pytest.raises(ZmtpViolation):
        for at in range(0, len(data), 8192):
            peer.feed(data[at : at + 8192])
            assert peer.held <= MAX_MESSAGE_BYTES + 8192, what


# The control socket in this process.


def pump(control: ControlSocket, quiet_s: float = 0.3) -> list:
    """Read ``control`` until it has been quiet for ``quiet_s``; the requests it completed."""
    completed = []
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < quiet_s:
        if control.pending or select.select([control.fileno()], [], [], 0.01)[0]:
            completed += control.read(time.perf_counter() + 1)
            quiet_since = time.monotonic()
    return completed


@pytest.mark.unit
def test_a_peer_gone_with_bytes_unread_is_let_go_at_once_with_what_it_held():
    """A peer that hangs up in the middle of a message, the daemon having read part of it and left the rest in the
    kernel: its descriptor closes and what its message held is let go (a STREAM socket kept such a descriptor)."""
    with tempfile.TemporaryDirectory(dir="/tmp") as directory, serving(f"{directory}/control") as control:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(f"{directory}/control")
        sock.sendall(HANDSHAKE)
        pump(control)
        answer = GREETING + READY_OF_A_ROUTER
        assert sock.recv(len(answer), socket.MSG_WAITALL) == answer and len(control) == 1
        sock.setblocking(False)
        sent = 0
        with contextlib.suppress(BlockingIOError):
            sent += sock.send(b"\x02" + struct.pack(">Q", 4 * MiB))
            for _ in range(64):
                sent += sock.send(b"\x00" * 65536)
        list(control.read(time.perf_counter() + 1))
        assert 0 < control.partial_bytes(os.getuid()) <= sent
        sock.send(b"\x00" * 65536)  # left unread in the kernel as the peer hangs up
        sock.close()
        assert pump(control) == [] and len(control) == 0
        assert control.partial_bytes(os.getuid()) == 0


@pytest.mark.unit
def test_the_kernel_names_the_process_behind_a_control_connection():
    with tempfile.TemporaryDirectory(dir="/tmp") as directory, serving(f"{directory}/control") as control:
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        try:
            dealer.connect(f"ipc://{directory}/control")
            dealer.send_multipart([b"status", b""])
            deadline = time.monotonic() + 5
            completed = []
            while not completed and time.monotonic() < deadline:
                completed = pump(control, 0.05)
            ((peer, identity, frames),) = completed
            assert peer == Peer(os.getuid(), os.getpid()) and frames == [b"status", b""]
            control.send(identity, [b"reply", b"x" * 300])
            assert dealer.poll(5000) and dealer.recv_multipart() == [b"reply", b"x" * 300]
        finally:
            dealer.close(linger=0)


@pytest.fixture
def control():
    """A control socket in this process, on a short path, and the path."""
    with tempfile.TemporaryDirectory(dir="/tmp") as directory, serving(f"{directory}/control") as control:
        yield control, f"{directory}/control"


@contextlib.contextmanager
def serving(path: str) -> Iterator[ControlSocket]:
    """A control socket accepting on a listener at ``path``, which stays the caller's, as the daemon's does."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    listener.bind(path)
    listener.listen(socket.SOMAXCONN)
    control = ControlSocket()
    control.listen(listener)
    try:
        yield control
    finally:
        control.close()
        listener.close()


def handshaken(control: ControlSocket, path: str) -> socket.socket:
    """A raw peer past the greeting and READY, the daemon's read."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(HANDSHAKE)
    pump(control, 0.05)
    answer = GREETING + READY_OF_A_ROUTER
    assert sock.recv(len(answer), socket.MSG_WAITALL) == answer
    return sock


@pytest.mark.unit
def test_a_uids_unfinished_messages_are_bounded_and_the_connection_passing_the_bound_is_closed(monkeypatch):
    monkeypatch.setattr(control_socket, "MAX_PARTIAL_BYTES_PER_UID", 96 << 10)
    monkeypatch.setattr(control_socket, "MIN_PARTIAL_BYTES_PER_UID", 16 << 10)
    with tempfile.TemporaryDirectory(dir="/tmp") as directory, serving(f"{directory}/control") as control:
        uids_unfinished_messages_are_bounded(control, f"{directory}/control")


def uids_unfinished_messages_are_bounded(control: ControlSocket, path: str) -> None:
    first, second = handshaken(control, path), handshaken(control, path)
    begun = b"\x03" + struct.pack(">Q", 4096) + b"p" * 4096
    first.sendall(begun * 12)
    pump(control, 0.05)
    assert control.partial_bytes(os.getuid()) >= 48 << 10 and len(control) == 2
    second.sendall(begun * 13)  # 13 parts of 4 KiB: 100 KiB held in all, past 96
    pump(control, 0.05)
    assert len(control) == 1 and closed_by_daemon(second, 0.5) and not closed_by_daemon(first, 0.1)
    assert control.partial_bytes(os.getuid()) == 12 * 4096
    first.close()
    pump(control, 0.05)
    assert len(control) == 0 and control.partial_bytes(os.getuid()) == 0


@pytest.mark.unit
def test_a_uids_connections_are_capped(monkeypatch):
    monkeypatch.setattr(control_socket, "MAX_CONNECTIONS_PER_UID", 2)
    monkeypatch.setattr(control_socket, "MIN_CONNECTIONS_PER_UID", 0)
    with tempfile.TemporaryDirectory(dir="/tmp") as directory, serving(f"{directory}/control") as control:
        uids_connections_are_capped(control, f"{directory}/control")


def uids_connections_are_capped(control: ControlSocket, path: str) -> None:
    peers = [handshaken(control, path) for _ in range(2)]
    third = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    third.connect(path)
    pump(control, 0.05)
    assert len(control) == 2 and closed_by_daemon(third, 0.5)
    peers.pop().close()
    pump(control, 0.05)
    assert handshaken(control, path) and len(control) == 2


@pytest.mark.unit
@pytest.mark.system
def test_replies_a_peer_does_not_read_are_dropped_whole_past_the_bound(control, monkeypatch):
    control, path = control
    monkeypatch.setattr(control_socket, "MAX_UNSENT_BYTES_PER_CONNECTION", 1 << 20)
    sock = handshaken(control, path)
    sock.sendall(frame(b"admin.status", more=True) + frame(b""))
    ((_, identity, _),) = pump(control, 0.05)
    reply = [b"reply", b"r" * 100_000]
    for _ in range(100):  # 10 MB: the kernel takes some, the daemon keeps at most the bound
        control.send(identity, reply)
    kept = control.unsent_bytes(os.getuid())
    assert 0 < kept <= (1 << 20) + len(reply[1])
    received = b""
    sock.settimeout(1)
    with contextlib.suppress(TimeoutError):
        while chunk := sock.recv(1 << 20):
            received += chunk
            pump(control, 0.01)
    whole = frame(b"reply", more=True) + frame(b"r" * 100_000)
    assert received and len(received) % len(whole) == 0 and received == whole * (len(received) // len(whole))
    assert control.unsent_bytes(os.getuid()) == 0


@pytest.mark.unit
def test_a_process_s_requests_waiting_and_a_uids_bytes_waiting_are_bounded(monkeypatch):
    """Past 32 requests of a process waiting for their turn, or a uid's bytes waiting, the next is refused,
    retryably."""
    sent: list[tuple[bytes, list[bytes]]] = []

    class Connections:
        def __init__(self, requests):
            self.read = lambda until: requests
            self.send = lambda identity, frames: sent.append((identity, frames))

    peer = Peer(1000, 7)
    request = proto.encode_frames(proto.Status(), 5, "t")
    queue = ControlQueue()
    queue.read(Connections([(peer, bytes([i]), request) for i in range(MAX_QUEUED_PER_PEER + 2)]))
    assert len(queue) == MAX_QUEUED_PER_PEER and len(sent) == 2
    reply = proto.decode_frames(sent[0][1]).body
    assert (reply.code, reply.retryable, reply.details["waiting"]) == ("conflict", True, MAX_QUEUED_PER_PEER)
    assert queue.peers == 1 and queue.take()[0] == b"\x00"
    monkeypatch.setattr(control_module, "MAX_WAITING_BYTES_PER_UID", 3 * sum(map(len, request)))
    monkeypatch.setattr(control_module, "MIN_WAITING_BYTES_PER_UID", 0)
    sent.clear()
    queue = ControlQueue()
    queue.read(Connections([(Peer(1000, pid), b"c", request) for pid in range(5)]))
    assert len(queue) == 3 and len(sent) == 2 and "MiB" in proto.decode_frames(sent[0][1]).body.message


@pytest.mark.unit
def test_the_parser_stops_at_its_room_or_a_run_of_commands_and_goes_on_from_there():
    """A run of bytes may hold thousands of empty messages or heartbeats: a feed parses what it was given room for,
    or :data:`MAX_COMMANDS_PER_FEED` commands, and keeps the rest for a feed of no bytes."""
    peer = ZmtpPeer()
    peer.feed(HANDSHAKE)
    messages, reply = peer.feed(frame(b"") * 100, room=1)
    assert (messages, reply, peer.stopped_short, peer.held) == ([[b""]], b"", True, 99 * 2)
    assert peer.feed(room=3) == ([[b""]] * 3, b"") and peer.held == 96 * 2
    assert peer.feed()[0] == [[b""]] * 96 and not peer.stopped_short and peer.held == 0
    pings = command(b"PING", b"\x00\x00ctx") * 1000
    messages, reply = peer.feed(pings + frame(b"admin.status"))
    assert messages == [] and reply == command(b"PONG", b"ctx") * MAX_COMMANDS_PER_FEED and peer.stopped_short
    for _ in range((1000 - MAX_COMMANDS_PER_FEED) // MAX_COMMANDS_PER_FEED):
        assert peer.feed()[0] == []
    assert peer.feed() == ([[b"admin.status"]], command(b"PONG", b"ctx") * (1000 % MAX_COMMANDS_PER_FEED))
    assert not peer.stopped_short


@pytest.mark.unit
def test_a_turn_reads_one_request_of_a_connection_and_leaves_the_rest(control):
    """Empty messages, two bytes each: a read of 16 KiB held 8,192 of them, each refused inside that read (issue
    #61). A turn completes one request of a connection; the rest waits, parsed at the next turns without the poll
    finding the socket ready again."""
    control, path = control
    flood, other = handshaken(control, path), handshaken(control, path)
    flood.sendall(frame(b"") * 8192)
    other.sendall(frame(b"admin.status", more=True) + frame(b""))
    wait_until(lambda: select.select([control.fileno()], [], [], 0)[0])
    first = list(control.read(time.perf_counter() + 1))
    assert sorted(frames for _, _, frames in first) == [[b""], [b"admin.status", b""]]
    assert control.pending and not select.select([control.fileno()], [], [], 0.05)[0]
    for turn in range(3):
        assert [frames for _, _, frames in control.read(time.perf_counter() + 1)] == [[b""]], turn
    assert control.partial_bytes(os.getuid()) <= RECEIVE_BYTES


@pytest.mark.unit
def test_a_turn_reads_a_connection_for_a_bounded_number_of_bytes_and_heartbeats(control):
    """What completes no request, read on until one completed, held the loop for as long as the peer sent: PINGs
    (issue #61), or the parts of one message. A turn reads :data:`READ_BYTES_PER_TURN` at most of a connection,
    and answers :data:`MAX_COMMANDS_PER_FEED` heartbeats; the rest waits in the kernel."""
    control, path = control
    parts, pings = handshaken(control, path), handshaken(control, path)
    pings.sendall(command(b"PING", b"\x00\x00") * 8192)
    parts.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            parts.send(frame(b"p" * 4096, more=True) * 16)
    wait_until(lambda: select.select([control.fileno()], [], [], 0)[0])
    assert list(control.read(time.perf_counter() + 1)) == []
    assert control.partial_bytes(os.getuid()) <= READ_BYTES_PER_TURN + 2 * RECEIVE_BYTES
    pongs = command(b"PONG")
    pings.settimeout(1)
    received = pings.recv(65536)
    with contextlib.suppress(TimeoutError):
        while len(received) < (MAX_COMMANDS_PER_FEED + 1) * len(pongs):
            received += pings.recv(65536)
    assert received == pongs * MAX_COMMANDS_PER_FEED


# A real daemon.


def endless_message(daemon, paths: InstancePaths, part: bytes, engine: Engine) -> tuple[int, int, int]:
    """Send the parts of one message forever (MORE always set), reconnecting whenever the daemon cuts the peer off,
    until :data:`ATTACK_BYTES` are sent; fail as soon as the daemon's RSS grows past :data:`RSS_BOUND`. Returns
    ``(bytes sent, connections cut, the RSS it started from)``."""
    block = memoryview(frame(part, more=True) * (MiB // (len(part) + 2)))
    before = rss(daemon.pid)
    sent = cut = 0
    checked = 0
    while sent < ATTACK_BYTES:
        sock = raw_peer(paths)
        try:
            sock.sendall(HANDSHAKE)
            while sent < ATTACK_BYTES:
                sent += sock.send(block)
                if sent - checked >= 4 * MiB:
                    checked = sent
                    grown = rss(daemon.pid) - before
                    assert grown <= RSS_BOUND, (
                        f"the daemon's RSS grew by {grown / MiB:.0f} MiB after {sent / MiB:.0f} MiB sent in parts "
                        f"of {len(part)} bytes on {cut + 1} connection(s); the engine's calls: {len(engine.latencies)}")
        except (BrokenPipeError, ConnectionResetError):
            cut += 1
        finally:
            sock.close()
    return sent, cut, before


@pytest.mark.ipc
@pytest.mark.parametrize("part", [b"p" * 4096, b""], ids=["4 KiB parts", "empty parts"])
def test_an_endless_message_is_cut_off_and_costs_the_daemon_no_more_than_a_message(daemon, client, part):
    paths = InstancePaths.of(daemon.run_dir, "host")
    client.status()
    sockets_before = sockets_of(daemon.pid)
    engine = Engine(client)
    started = time.monotonic()
    try:
        sent, cut, before = endless_message(daemon, paths, part, engine)
    finally:
        engine.stop()
    took = time.monotonic() - started
    peak = rss(daemon.pid, "VmHWM") - before
    latencies = sorted(engine.latencies)
    print(f"\n{len(part)}-byte parts: {sent / MiB:.0f} MiB sent in {took:.1f} s on {cut} connections, each cut off; "
          f"the daemon's RSS {before / MiB:.0f} MiB, its peak {peak / MiB:+.1f} MiB; the engine's {len(latencies)} "
          f"calls p50 {latencies[len(latencies) // 2] * 1000:.1f} ms, max {latencies[-1] * 1000:.1f} ms")
    assert peak <= RSS_BOUND
    assert cut >= sent // (MAX_MESSAGE_BYTES + 8 * MiB), "the daemon let a connection send on past a message's bound"
    assert not engine.failures, engine.failures[:3]
    assert latencies and latencies[-1] < 2.0
    assert client.status().num_sessions == 1
    wait_until(lambda: sockets_of(daemon.pid) == sockets_before, timeout=10)
    closes = [line for line in daemon.log().splitlines() if "closed a control connection" in line]
    assert 1 <= len(closes) <= 1 + took / 10 + 1, "closes are logged once per uid per interval"
    assert f"more than {MAX_PARTS} parts" in closes[0], closes[0]


def fuzz_cases(rng: random.Random) -> list[tuple[str, bytes]]:
    """Streams the daemon must cut off: garbled greetings, bad READYs, bad commands and frames."""
    cases = [(f"random bytes #{i}", bytes([rng.choice([0, 1, 0x7f, 0xfe])]) + rng.randbytes(rng.randint(0, 200)))
             for i in range(20)]
    for at, value, what in [(0, 0x00, "signature"), (9, 0x00, "signature's end"), (10, 2, "ZMTP 2"),
                            (10, 1, "ZMTP 1"), (12, ord("P"), "mechanism")]:
        garbled = bytearray(GREETING)
        garbled[at] = value
        cases.append((f"a greeting with a bad {what}", bytes(garbled)))
    for mechanism in (b"PLAIN", b"CURVE", b"NULL\x01", b"null"):
        cases.append((f"the mechanism {mechanism!r}", GREETING[:12] + mechanism.ljust(20, b"\x00") + GREETING[32:]))
    before_ready = [
        ("a message before READY", frame(b"admin.status")),
        ("READY without a socket type", command(b"READY", prop(b"Identity", b""))),
        ("READY from a PUB", command(b"READY", prop(b"Socket-Type", b"PUB"))),
        ("READY whose value overruns", command(b"READY", b"\x0bSocket-Type" + struct.pack(">I", 999) + b"DEALER")),
        ("READY with an empty property name", command(b"READY", b"\x00" + struct.pack(">I", 0))),
        ("HELLO instead of READY", command(b"HELLO")),
        ("a command without a name", b"\x04\x00"),
        ("a command whose name overruns", b"\x04\x02\x09RE"),
    ]
    cases += [(what, GREETING + data) for what, data in before_ready]
    after_ready = [
        ("SUBSCRIBE", command(b"SUBSCRIBE", b"topic")),
        ("ERROR", command(b"ERROR", b"\x05oops!")),
        ("a second READY", READY),
        ("a PING of one byte", command(b"PING", b"\x00")),
        ("a PING with a 17-byte context", command(b"PING", b"\x00\x00" + b"c" * 17)),
        ("a PONG with a 17-byte context", command(b"PONG", b"c" * 17)),
        ("reserved flags", b"\x10\x01x"),
        ("a command with MORE", b"\x05\x05\x04PING"),
        ("a frame of 2**63 - 1 bytes", b"\x02" + struct.pack(">Q", 2**63 - 1)),
        ("a frame of 2**64 - 1 bytes", b"\x02" + b"\xff" * 8 + b"x" * 100),
        ("a frame just past a message's bound", b"\x02" + struct.pack(">Q", MAX_MESSAGE_BYTES + 1) + b"x" * 100),
        ("a command past its bound", b"\x06" + struct.pack(">Q", MAX_COMMAND_BYTES + 1) + b"x" * 100),
        (f"{MAX_PARTS + 1} parts", frame(b"k", more=True) * MAX_PARTS + frame(b"p")),
    ]
    cases += [(f"after READY, {what}", HANDSHAKE + data) for what, data in after_ready]
    cases += [(f"after READY, the command {name!r}", HANDSHAKE + command(name, rng.randbytes(4)))
              for name in (b"READX", b"PIN", b"PINGPING", rng.randbytes(8), b"\x00" * 5)]
    return cases


@pytest.mark.ipc
@pytest.mark.system
def test_malformed_zmtp_is_cut_off_and_changes_nothing(daemon, client):
    paths = InstancePaths.of(daemon.run_dir, "host")
    before = client.status()
    sockets_before = sockets_of(daemon.pid)
    problems = []
    cases = fuzz_cases(random.Random(SEED))
    for what, data in cases:
        with raw_peer(paths) as sock:
            try:
                sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                continue  # cut off already
            if not closed_by_daemon(sock):
                problems.append(what)
    # Cut short by the peer itself, at every length: the daemon forgets them.
    for length in range(0, len(HANDSHAKE) + 1, 7):
        with raw_peer(paths) as sock:
            sock.sendall(HANDSHAKE[:length])
    # One that stops halfway through its greeting is closed once its time to greet is out.
    with raw_peer(paths) as sock:
        sock.sendall(GREETING[:20])
        if not closed_by_daemon(sock, within=5.0 + 2.5):
            problems.append("half a greeting, then silence")
    assert not problems, f"still connected after: {problems}"
    assert daemon.alive()
    after = client.status()
    assert (after.num_sessions, after.committed_bytes, after.num_buffers) == (
        before.num_sessions, before.committed_bytes, before.num_buffers)
    wait_until(lambda: sockets_of(daemon.pid) == sockets_before, timeout=10)
    closes = [line for line in daemon.log().splitlines() if "closed a control connection" in line]
    assert 1 <= len(closes) <= 3, f"{len(cases)} cut off, logged once per uid per interval: {closes}"
    assert "\n" not in closes[0] and "Traceback" not in daemon.log()


def refusal_to(paths: InstancePaths, data: bytes) -> bytes:
    """What the daemon sends a raw peer that sends ``data``, until it closes the connection."""
    received = b""
    with raw_peer(paths) as sock:
        sock.sendall(data)
        while chunk := sock.recv(4096):
            received += chunk
    return received


def error_reason(data: bytes) -> str:
    """The reason of the ZMTP ERROR command that ``data`` is, spelled out from RFC 37: a command frame, the name
    ERROR, a byte of length, the reason."""
    assert data[:1] == b"\x04" and data[2:8] == b"\x05ERROR", data
    assert data[1] == len(data) - 2 and data[8] == len(data) - 9, data
    return data[9:].decode("ascii")


@pytest.mark.ipc
def test_a_req_peer_is_refused_at_its_handshake_with_a_zmtp_error_naming_why_and_a_dealer_is_served(daemon, client):
    """A REQ socket (a misconfigured client) is refused with ZMTP's ERROR in place of the daemon's READY, naming its
    socket type; libzmq reads that as a protocol error and does not reconnect. A peer of another mechanism is told
    so the same way. The engine's DEALER is served meanwhile (issue #65)."""
    paths = InstancePaths.of(daemon.run_dir, "host")
    req_ready = command(b"READY", prop(b"Socket-Type", b"REQ") + prop(b"Identity", b""))
    refused = refusal_to(paths, GREETING + req_ready)
    assert refused[:64] == GREETING
    assert error_reason(refused[64:]) == \
        "a READY from a REQ socket: the hbmd control socket serves only DEALER sockets (hbmd.client's)"
    plain = GREETING[:12] + b"PLAIN".ljust(20, b"\x00") + GREETING[32:]
    assert error_reason(refusal_to(paths, plain)[64:]).startswith("the mechanism b'PLAIN': only NULL is spoken here")

    context = zmq.Context.instance()
    req = context.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    monitor = req.get_monitor_socket()
    try:
        req.connect(paths.endpoint)
        req.send_multipart(proto.encode_frames(proto.Status(), 1, client._core.control.token))
        events = []
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            if monitor.poll(50):
                events.append(zmq.Event(recv_monitor_message(monitor)["event"]))
            assert isinstance(client.status(), proto.StatusReply)  # the DEALER is served all along
        assert events[:2] == [zmq.Event.CONNECTED, zmq.Event.DISCONNECTED], events
        assert zmq.Event.CONNECT_RETRIED not in events and zmq.Event.HANDSHAKE_SUCCEEDED not in events, events
        assert not req.poll(0)
    finally:
        req.disable_monitor()
        monitor.close(linger=0)
        req.close(linger=0)
    assert "a READY from a REQ socket" in daemon.log()
    assert client.status().num_sessions == 1


@pytest.mark.ipc
@pytest.mark.system
def test_heartbeats_are_answered_and_a_dealer_that_sends_them_is_served(daemon, client):
    """libzmq's heartbeats (``ZMQ_HEARTBEAT_IVL``) and a raw PING: a PONG with the ping's context, nothing more."""
    paths = InstancePaths.of(daemon.run_dir, "host")
    with raw_peer(paths) as sock:
        sock.sendall(HANDSHAKE + command(b"PING", b"\x00\x00" + b"context"))
        expected = GREETING + READY_OF_A_ROUTER + command(b"PONG", b"context")
        received = b""
        while len(received) < len(expected):
            chunk = sock.recv(4096)
            assert chunk, f"closed after {received!r}"
            received += chunk
        assert received == expected
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.HEARTBEAT_IVL, 50)
    dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, 500)
    dealer.connect(paths.endpoint)
    try:
        for request_id in range(1, 6):
            dealer.send_multipart(proto.encode_frames(proto.Status(), request_id, client._core.control.token))
            assert dealer.poll(5000)
            assert isinstance(proto.decode_frames(dealer.recv_multipart()).body, proto.StatusReply)
            time.sleep(0.3)  # idle between requests, the heartbeats alone going: the thing under test
    finally:
        dealer.close(linger=0)
    assert "closed a control connection" not in daemon.log()


@pytest.mark.unit
def test_uids_share_what_the_control_plane_holds_in_all_and_each_may_always_hold_a_message():
    """Bounds per uid added up: four uids at theirs held 500 MiB (issue #61). Past its floor a uid takes at most
    the bound in all split among the uids holding some and one more, while there is room; its floor it may always
    hold."""
    shares = Shares(per_uid=64, total=96, floor=4)
    assert shares.share(1) == 48 and shares.fits(1, 48) and not shares.fits(1, 49)
    shares.add(1, 48)
    assert shares.share(2) == 32 and shares.fits(2, 32)
    shares.add(2, 32)
    assert shares.share(3) == 24 and not shares.fits(3, 17) and shares.fits(3, 16)  # room in all: 16
    shares.add(3, 16)
    assert shares.in_all == 96 and not shares.fits(4, 5) and shares.fits(4, 4)  # its floor, past the bound in all
    shares.add(4, 4)
    assert shares.over(1) and not shares.over(4)  # 1 holds more than its share now: it grows no more
    for uid, held in ((1, 48), (2, 32), (3, 16), (4, 4)):
        shares.add(uid, -held)
    assert shares.in_all == 0 and shares.held(1) == 0
