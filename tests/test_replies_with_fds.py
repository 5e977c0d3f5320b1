"""A commit's reply rides with its FDs on the handle socket (protocol 1.7), so its reader wakes once for both."""

from __future__ import annotations

import os

import pytest
import zmq
from hbmd import proto
from hbmd.client import ExtensibleTensor
from hbmd.client.transport import ControlChannel, HandleChannel
from hbmd.proto.instance import InstancePaths
from helpers import GRANULE, MiB

pytestmark = [pytest.mark.ipc, pytest.mark.torch]


class RawSession:
    """A session's two channels, raw: its hello asks for replies with FDs or not."""

    def __init__(self, daemon, replies_with_fds: bool) -> None:
        paths = InstancePaths.of(daemon.run_dir, daemon.instance)
        self.handles = HandleChannel(paths, 5)
        hello = proto.Hello(list(proto.PROTOCOL_VERSION), os.getpid(), "raw", replies_with_fds=replies_with_fds)
        welcome = self.handles.handshake(hello)
        self.control = ControlChannel(paths, welcome.token, 5, session=self.handles, replies_with_fds=replies_with_fds)

    def commit(self, buffer_id: int, size: int) -> tuple[proto.Committed, proto.FdBatch, list[int]]:
        reply, request_id = self.control.call_with_id(proto.Commit(buffer_id, size))
        batch, fds = self.handles.inbox.receive_fds(request_id, float("inf"))
        return reply, batch, fds

    def control_socket_is_silent(self) -> bool:
        return not self.control._socket.poll(200, zmq.POLLIN)

    def close(self) -> None:
        self.control.close()
        self.handles.close()


@pytest.fixture
def raw(daemon):
    sessions: list[RawSession] = []
    yield lambda replies_with_fds: sessions.append(RawSession(daemon, replies_with_fds)) or sessions[-1]
    for session in sessions:
        session.close()


def test_a_commit_reply_rides_in_the_first_fd_batch_and_not_on_the_control_socket(raw):
    session = raw(True)
    buffer = session.control.call(proto.CreateBuffer(64 * MiB, 1)).buffer
    reply, batch, fds = session.commit(buffer.buffer_id, 4 * MiB)
    try:
        assert batch.reply == reply and reply.buffer.physical_bytes == 4 * MiB
        assert [c.chunk_id for c in reply.chunks] == batch.chunk_ids and len(fds) == 1
        assert session.control_socket_is_silent()
    finally:
        for fd in fds:
            os.close(fd)


def test_a_session_that_did_not_ask_gets_its_reply_on_the_control_socket(raw):
    session = raw(False)
    buffer = session.control.call(proto.CreateBuffer(64 * MiB, 1)).buffer
    reply, batch, fds = session.commit(buffer.buffer_id, 4 * MiB)
    try:
        assert batch.reply is None and reply.buffer.physical_bytes == 4 * MiB and len(fds) == 1
    finally:
        for fd in fds:
            os.close(fd)


def test_a_refusal_still_comes_on_the_control_socket(raw):
    session = raw(True)
    buffer = session.control.call(proto.CreateBuffer(64 * MiB, 1)).buffer
    with pytest.raises(proto.InvalidRequest, match="exceeds"):
        session.control.call(proto.Commit(buffer.buffer_id, 128 * MiB))


def test_a_reply_too_large_to_ride_with_fds_comes_on_the_control_socket(raw):
    session = raw(True)
    segments = proto.MAX_SEGMENTS_WITH_FDS + 1
    # Small segments: their granules are shared, and the whole buffer takes three.
    buffer = session.control.call(proto.CreateBuffer(segments * 4096, segments)).buffer
    reply, batch, fds = session.commit(buffer.buffer_id, 4096)
    try:
        assert batch.reply is None and reply.buffer.physical_bytes == 3 * GRANULE
    finally:
        for fd in fds:
            os.close(fd)


def test_a_client_commits_through_replies_with_fds_and_keeps_its_bytes(client):
    tensor = ExtensibleTensor(64 * MiB, "cpu", client=client)
    for step in range(1, 9):
        tensor.resize_(step * 4 * MiB, zero_new=True)  # two granules a step: through the daemon, never the lease
        tensor.full_view()[(step - 1) * 4 * MiB : step * 4 * MiB] = step
    assert [int(tensor.full_view()[i * 4 * MiB]) for i in range(8)] == list(range(1, 9))
    assert client._core.control.replies_with_fds
    tensor.free()
