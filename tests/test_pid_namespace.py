"""A daemon in a pid namespace of its own, as the DaemonSet runs it: the kernel reports pid 0 for every client, and
peers are told apart all the same, by their control connections and their sessions' credentials.
"""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest
import zmq
from hbmd import proto
from hbmd.client.transport import HandleChannel
from hbmd.daemon.server.connection import SO_PEERPIDFD
from hbmd.proto import PROTOCOL_VERSION, ChunkInfo, Hello, Redeclare
from hbmd.proto.errors import PermissionDenied, SessionLost
from hbmd.proto.instance import InstancePaths
from helpers import MiB, attach_within, spawn_holder, wait_until

pytestmark = pytest.mark.ipc

HONEST = """
from hbmd.client import connect
from hbmd.proto.errors import Conflict
client = connect(client_name="honest", lease=False)
print("ready", flush=True)
input()
refused = 0
for _ in range(200):
    try:
        client.status()
    except Conflict:
        refused += 1
print(refused, flush=True)
"""

VICTIM = """
from hbmd.client import ExtensibleTensor, connect
client = connect(client_name="victim", lease=False)
kv = ExtensibleTensor(8 << 20, "cpu", client=client, name="kv", persistent=True)
kv.resize_(4 << 20)
kv.full_view()[: 4 << 20] = 7
print(client.session_id, flush=True)
input()
print(client._recovery.started_over, kv.full_view()[: 4 << 20].unique().tolist(), flush=True)
"""


def in_namespace(start_daemon, *args: str):
    daemon = start_daemon("--budget", "64MiB", *args, pid_namespace=True)
    with daemon.connect(observer=True) as look:
        assert {s.pid for s in look.sessions()} <= {0}  # what the daemon sees of this process
    return daemon


class Flood:
    """Control requests of this process pipelined on ``connections`` connections, ``depth`` in flight on each, until
    stopped; counts the refusals."""

    def __init__(self, client, connections: int = 2, depth: int = 64) -> None:
        self._token, self._endpoint, self._depth = client._core.control.token, client._core.control.endpoint, depth
        self._dealers = []
        for _ in range(connections):
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self._endpoint)
            self._dealers.append(dealer)
        self.refused = self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Flood:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        for dealer in self._dealers:
            dealer.close(linger=0)

    def _send(self, dealer) -> None:
        dealer.send_multipart(proto.encode_frames(proto.Status(), 1, self._token))

    def _run(self) -> None:
        poller = zmq.Poller()
        for dealer in self._dealers:
            poller.register(dealer, zmq.POLLIN)
            for _ in range(self._depth):
                self._send(dealer)
        while not self._stop.is_set():
            for dealer in dict(poller.poll(100)):
                reply = proto.decode_frames(dealer.recv_multipart()).body
                if isinstance(reply, proto.ErrorReply):
                    self.refused += 1
                else:
                    self.answered += 1
                self._send(dealer)


@pytest.mark.system
def test_two_processes_of_one_uid_have_queues_of_their_own(start_daemon, spawn_worker):
    """Every peer reads as pid 0: a queue per pid would be one per uid, whose 32 requests a flood of another process
    of the uid keeps full, and the honest process's calls would be refused (``conflict``). Each connection is a
    queue of its own, read one request a turn, as many as are answered: the flood waits in the kernel."""
    daemon = in_namespace(start_daemon)
    honest = spawn_worker(daemon, HONEST)
    assert honest.readline() == "ready"
    with daemon.connect(client_name="flood", lease=False) as flooder, Flood(flooder) as flood:
        wait_until(lambda: flood.answered > 2 * 64)  # its connections have requests read and waiting all along
        honest.send("go")
        refused = int(honest.readline())
    assert refused == 0, f"{refused} of 200 calls of another process refused"
    assert flood.refused == 0 and flood.answered > 0


@pytest.mark.torch
@pytest.mark.system
def test_after_a_cold_restart_only_the_process_that_held_a_session_declares_what_it_maps(start_daemon, spawn_worker):
    """Another process of the uid, which can read pid 0 as well as any, can neither start the victim's session over
    nor make itself eligible by asking for a session it never held; the victim declares its buffer and goes on."""
    daemon = in_namespace(start_daemon)
    victim = spawn_worker(daemon, VICTIM)
    session_id = int(victim.readline())
    os.kill(victim.proc.pid, signal.SIGSTOP)  # the squatter goes first
    try:
        daemon.kill()
        daemon = in_namespace(start_daemon)
        paths = InstancePaths.of(daemon.run_dir, daemon.instance)
        for credential in ("ab" * 40, "0" * 32):
            asking = HandleChannel(paths, 5)
            with pytest.raises(SessionLost):
                asking.handshake(Hello(list(PROTOCOL_VERSION), os.getpid(), resume_session=session_id,
                                       resume_credential=credential, start_over=True))
            asking.close()
        with daemon.connect(lease=False) as squatter:
            with pytest.raises(PermissionDenied, match="declared again only by a session whose process"):
                squatter.call(Redeclare(
                    capacity=8 * MiB, segment_capacities=[8 * MiB], segment_sizes=[4 * MiB],
                    chunks=[ChunkInfo(0, 0, 2 * MiB), ChunkInfo(0, 2 * MiB, 2 * MiB)], name="kv", persistent=True,
                ))
    finally:
        os.kill(victim.proc.pid, signal.SIGCONT)
    with daemon.connect(observer=True) as look:
        wait_until(lambda: [(b.name, b.held_elsewhere, b.physical_bytes) for b in look.buffers()]
                   == [("kv", True, 4 * MiB)])
    victim.send("go")
    assert victim.readline() == "1 [7]"  # started over once, its bytes where it wrote them


def kernel_names_peers() -> bool:
    """Whether this kernel hands over a pidfd of the process that connected (``SO_PEERPIDFD``, Linux 6.5)."""
    ours, theirs = socket.socketpair(socket.AF_UNIX)
    with ours, theirs:
        try:
            os.close(ours.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
            return True
        except OSError:
            return False


@pytest.mark.skipif(not kernel_names_peers(), reason="the kernel has no SO_PEERPIDFD (Linux 6.5 and later)")
def test_a_session_ends_with_its_worker_though_its_pid_reads_0_and_a_child_holds_its_socket(
        start_daemon, spawn_worker):
    """The kernel names the process that connected, in whatever pid namespace: its exit ends its session and
    orphans its buffer at once, not when the helper holding its socket (``inherit``: a forked child's would be closed
    by the client's fork hook) ends, 30 s on."""
    daemon = in_namespace(start_daemon)
    with daemon.connect(lease=False) as client:
        worker, pid, child, session_id, buffer_id = spawn_holder(spawn_worker, daemon, "inherit")
        try:
            os.kill(pid, signal.SIGKILL)
            assert attach_within(client, 2.0) < 2.0
            assert all(s.session_id != session_id for s in client.sessions())
        finally:
            os.kill(child, signal.SIGKILL)
        worker.wait()
        assert [b.buffer_id for b in client.buffers(client.session_id)] == [buffer_id]
    assert daemon.alive()
