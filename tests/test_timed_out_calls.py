"""A call the client gave up on may still be done by the daemon; the client never holds a tensor that says more than
it maps (issue #61).

A commit timed out while the daemon was stalled; once back, the daemon did
it, its chunks delivered to nobody. The client's next commit grew from its
own record, the daemon's answer from the daemon's: the tensor said 16 MiB
with the 6 MiB between unmapped, and a write there faulted (SIGSEGV in 2 of
3 runs of the adversarial test). The daemon does no request of a session
older than one it has answered, and a tensor whose change timed out is
mapped again as the daemon records it before its next step.
"""

from __future__ import annotations

import os
import signal

import pytest
import zmq
from hbmd import proto
from hbmd.proto.errors import InvalidRequest
from helpers import wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]

WORKER = """
from hbmd.client import DaemonUnavailable, ExtensibleTensor, connect

client = connect("cpu", lease=False, timeout=1)
kv = ExtensibleTensor(64 << 20, "cpu", client=client)
kv.resize_(2 << 20)
kv.full_view()[: 2 << 20] = 1
print("ready", flush=True)
input()  # the daemon is stopped
try:
    kv.resize_(8 << 20)
    print("answered", flush=True)
except DaemonUnavailable:
    print("timed out", flush=True)
input()  # the daemon is back, and has done the commit given up on
kv.resize_(16 << 20)
mapped = sorted(kv._reservation.mapped)
covered = 0
for offset, size in mapped:
    covered = offset + size if offset <= covered else covered
print(kv.num_bytes >> 20, covered >> 20, flush=True)
kv.full_view()[: kv.num_bytes] = 7  # faults where the tensor says more than is mapped
print(kv.full_view()[: 16 << 20].eq(7).all().item(), kv.num_chunks, client.buffers()[0].num_chunks, flush=True)
"""


def given_up_on_while_stalled(daemon, worker) -> None:
    """Stall the daemon (SIGSTOP) while ``worker`` makes its call, until the worker gives up on it; then let it go
    on, to do that call late."""
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        worker.send("")
        assert worker.readline() == "timed out"
    finally:
        os.kill(daemon.pid, signal.SIGCONT)


def test_a_commit_given_up_on_and_done_later_leaves_the_tensor_as_mapped(daemon, spawn_worker):
    worker = spawn_worker(daemon, WORKER)
    assert worker.readline() == "ready"
    given_up_on_while_stalled(daemon, worker)
    with daemon.connect(observer=True) as look:
        wait_until(lambda: look.buffers()[0].physical_bytes == 8 << 20)  # the daemon did the commit given up on
    worker.send("")
    assert worker.readline() == "16 16"  # it says 16 MiB, and maps all of it
    said, chunks, recorded = worker.readline().split()
    assert said == "True" and chunks == recorded
    assert worker.wait() == 0


DEFRAGMENT = """
from hbmd.client import DaemonUnavailable, ExtensibleTensor, connect

client = connect("cpu", lease=False, timeout=1)
kv = ExtensibleTensor(64 << 20, "cpu", client=client)
for size in (2, 4, 6):
    kv.resize_(size << 20)
kv.full_view()[: 6 << 20] = 3
print(kv.num_chunks, flush=True)
input()  # the daemon is stopped
try:
    kv.defragment(preserve=True)
    print("answered", flush=True)
except DaemonUnavailable:
    print("timed out", flush=True)
input()  # the daemon is back, and has made the new chunks of the defragment given up on
kv.resize_(8 << 20)
print(kv.num_chunks, kv.full_view()[: 6 << 20].eq(3).all().item(), client.buffers()[0].pending_bytes, flush=True)
"""


def test_a_defragment_given_up_on_and_done_later_is_dropped(daemon, spawn_worker):
    """The daemon made the new chunks of a preserving defragment the client gave up on, and kept them pending beside
    the old ones, refusing the buffer's growth until the end of the session: they are dropped at the next step."""
    worker = spawn_worker(daemon, DEFRAGMENT)
    assert worker.readline() == "3"
    given_up_on_while_stalled(daemon, worker)
    with daemon.connect(observer=True) as look:
        wait_until(lambda: look.buffers()[0].pending_bytes == 6 << 20)
    worker.send("")
    assert worker.readline() == "4 True 0"  # its 3 chunks and the growth's, its bytes kept, nothing pending
    assert worker.wait() == 0


def test_a_request_older_than_one_answered_is_not_done(daemon, client):
    """A request of a session that comes after a later one of the same session was answered (its client gave up on
    it, and the daemon read it late, on the connection the client had closed) is refused, changing nothing."""
    client.create_buffer(16 << 20, 1)
    control = client._core.control
    client.status()
    client.status()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(control.endpoint)
    try:
        older = control.requests_sent - 1  # the first status's: not the session's last change, which is answered again
        dealer.send_multipart(proto.encode_frames(proto.CreateBuffer(8 << 20), older, control.token))
        assert dealer.poll(10_000)
        envelope = proto.decode_frames(dealer.recv_multipart())
    finally:
        dealer.close(linger=0)
    assert envelope.request_id == older and isinstance(envelope.body, proto.ErrorReply)
    refusal = envelope.body.exception()
    assert isinstance(refusal, InvalidRequest) and f"request {older + 1}" in refusal.message, refusal
    assert len(client.buffers()) == 1
    assert client.status().num_sessions == 1  # the session goes on
