"""Nothing lost (issue #14): persistent buffers outlive their holder however it lets go or dies.

A session detaches a buffer and another process attaches it with its data; a
worker SIGKILLed while a forked child still holds its sockets releases its
session at once; an attach right after a SIGKILL finds the buffer free; a
client whose daemon went away learns it at its next call; a restart that
does not get every parked FD back skips what is missing and serves the rest.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import pytest
from hbmd import proto
from hbmd.client import (
    DaemonUnavailable,
    ExtensibleTensor,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    SessionLost,
)
from hbmd.client.transport import ControlChannel
from hbmd.proto.instance import InstancePaths
from helpers import MiB, attach_within, filled, hbmctl, parked_names, spawn_holder, torch, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]

WRITER = """
import sys
import torch
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu", client_name="writer")
kv = ExtensibleTensor(32 << 20, "cpu", num_segments=2, client=c, name="kv", persistent=True)
kv.resize_per_segment_(6 << 20)
kv.full_view()[: 6 << 20] = torch.arange(6 << 20, dtype=torch.int64).remainder(251).to(torch.uint8)
kv.full_view()[16 << 20 : 22 << 20] = 77
detached = c.detach(kv.buffer_id)
print(detached.buffer.buffer_id, detached.buffer.session_id, detached.freed_bytes, c.session_id, flush=True)
sys.stdin.readline()
"""


@pytest.mark.system
def test_a_detached_buffer_is_attached_by_another_process_with_its_data(daemon, client, spawn_worker):
    client.status()  # our own handle connection is accepted asynchronously: settle it first
    fds_before = daemon.open_fds()
    writer = spawn_worker(daemon, WRITER)
    buffer_id, owner_after, freed, writer_session = map(int, writer.readline().split())
    assert (owner_after, freed) == (0, 0)

    # The writer is still connected, yet the buffer is an orphan that hbmctl shows as such.
    assert any(s.session_id == writer_session for s in client.sessions())
    rd = str(daemon.run_dir)
    listed = {b["buffer_id"]: b for b in json.loads(hbmctl("--run-dir", rd, "--json", "buffers").stdout)["buffers"]}
    assert listed[buffer_id]["session_id"] is None and listed[buffer_id]["physical_bytes"] == 12 * MiB
    row = next(line for line in hbmctl("--run-dir", rd, "buffers").stdout.splitlines() if " kv " in line)
    assert row.split()[:3] == [str(buffer_id), "orphan", "kv"]

    kv = ExtensibleTensor.attach("kv", "cpu", client=client)
    expected = torch.arange(6 * MiB, dtype=torch.int64).remainder(251).to(torch.uint8)
    assert torch.equal(kv.full_view()[: 6 * MiB], expected)
    assert filled(kv.full_view()[16 * MiB : 22 * MiB], 77)
    assert kv.buffer_id == buffer_id and kv.bytes_per_segment == 6 * MiB

    writer.send("done")
    assert writer.wait() == 0
    wait_until(lambda: all(s.session_id != writer_session for s in client.sessions()))
    assert client.status().committed_bytes == 12 * MiB  # the writer's end took nothing it had detached
    kv.free()
    assert client.status().committed_bytes == 0 and client.status().num_buffers == 0
    assert daemon.open_fds() == fds_before
    assert daemon.alive()


def test_detach_refuses_an_anonymous_buffer_and_another_sessions_buffer(daemon, client):
    anonymous = client.create_buffer(8 * MiB)
    with pytest.raises(InvalidRequest, match="anonymous"):
        client.detach(anonymous.buffer_id)
    with daemon.connect() as other:
        named = other.create_buffer(8 * MiB, name="theirs", persistent=True)
        with pytest.raises(NotFound):  # another session's id is answered as a missing one
            client.detach(named.buffer_id)
        assert {b.buffer_id: b.session_id for b in client.buffers()} == {
            anonymous.buffer_id: client.session_id,
            named.buffer_id: other.session_id,
        }
    assert daemon.alive()


def process_alive(pid: int) -> bool:
    """Running: neither gone nor a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("helper", ["fork", "inherit"])
def test_a_session_ends_with_its_worker_even_while_a_child_lives(daemon, client, spawn_worker, helper):
    client.status()
    fds_before = daemon.open_fds()
    worker, pid, child, session_id, buffer_id = spawn_holder(spawn_worker, daemon, helper)
    try:
        assert process_alive(child)
        os.kill(pid, signal.SIGKILL)
        assert attach_within(client, 1.0) < 1.0
        assert process_alive(child)  # the helper still runs, and still holds nothing
        assert all(s.session_id != session_id for s in client.sessions())
        assert [b.buffer_id for b in client.buffers(client.session_id)] == [buffer_id]
    finally:
        os.kill(child, signal.SIGKILL)
    worker.wait()
    client.free(buffer_id)
    assert client.status().committed_bytes == 0
    # A forked child also held the worker's ZeroMQ connection (not a session): the daemon drops it once the child is
    # gone.
    wait_until(lambda: daemon.open_fds() == fds_before, timeout=5)
    assert daemon.alive()


@pytest.mark.system
def test_an_attach_right_after_a_sigkill_never_meets_conflict(daemon, client, spawn_worker):
    """On even rounds the daemon is paused across the kill, so the attach reaches it with the death unnoticed."""
    client.status()
    fds_before = daemon.open_fds()
    for attempt in range(20):
        worker, _, _, session_id, buffer_id = spawn_holder(spawn_worker, daemon)
        paused = attempt % 2 == 0
        if paused:
            os.kill(daemon.pid, signal.SIGSTOP)
        try:
            worker.kill()
            if paused:
                threading.Timer(0.05, os.kill, (daemon.pid, signal.SIGCONT)).start()
            with client.attach("kv") as delivery:
                attached = delivery.reply
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert attached.buffer.buffer_id == buffer_id and attached.buffer.physical_bytes == 4 * MiB
        assert all(s.session_id != session_id for s in client.sessions())
        client.detach(buffer_id)  # for the next round's worker
    client.delete("kv")
    assert client.status().committed_bytes == 0
    assert daemon.open_fds() == fds_before
    assert daemon.alive()


@pytest.mark.system
def test_a_stopped_daemon_that_does_not_come_back_is_a_lost_session_once_the_client_stops_waiting(daemon):
    client = daemon.connect(timeout=10.0, resume_timeout=0.5)
    client.status()
    assert daemon.stop() == 0
    started = time.monotonic()
    with pytest.raises(SessionLost, match=r"did not come back within 0\.5s") as lost:
        client.status()
    assert time.monotonic() - started < 1.5  # the listener began waiting when the daemon went
    assert lost.value.retryable and isinstance(lost.value, DaemonUnavailable)
    with pytest.raises(SessionLost):
        client.create_buffer(8 * MiB)  # and it stays lost
    client.close()


@pytest.mark.system
def test_a_call_in_flight_when_the_daemon_dies_waits_for_it_no_longer_than_the_resume_timeout(daemon):
    client = daemon.connect(timeout=10.0, resume_timeout=0.5)
    client.status()
    os.kill(daemon.pid, signal.SIGSTOP)  # the request is sent, and never answered
    threading.Timer(0.2, os.kill, (daemon.pid, signal.SIGKILL)).start()
    started = time.monotonic()
    with pytest.raises(SessionLost):
        client.status()
    assert time.monotonic() - started < 1.5  # not the 10 s call timeout
    client.close()


def test_after_a_cold_restart_the_old_session_is_lost_at_once_and_a_new_one_works(start_daemon, run_dir):
    first = start_daemon("--budget", "256MiB")
    client = first.connect(timeout=10.0)
    token = client.welcome.token
    assert first.stop() == 0
    second = start_daemon("--budget", "256MiB")
    started = time.monotonic()
    with pytest.raises(SessionLost):
        client.status()
    assert time.monotonic() - started < 1.0
    client.close()

    # The stale token on its own: refused, flagged so that a client reads it as its session's end.
    stale = ControlChannel(InstancePaths.of(run_dir, "host"), token, timeout=5)
    try:
        with pytest.raises(PermissionDenied) as refused:
            stale.call(proto.Status())
        assert refused.value.details == {"token": "unknown"}
    finally:
        stale.close()

    with second.connect(timeout=10.0) as again:
        assert again.status().num_sessions == 1


TWO_PERSISTENT = """
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu")
kept = ExtensibleTensor(16 << 20, "cpu", client=c, name="kept", persistent=True)
kept.resize_(6 << 20)
kept.full_view()[: 6 << 20] = 42
lost = ExtensibleTensor(16 << 20, "cpu", client=c, name="lost", persistent=True)
lost.resize_(10 << 20)
print(kept.buffer_id, lost.buffer_id, flush=True)
"""


@pytest.mark.system
def test_a_restart_skips_a_buffer_whose_parked_fd_did_not_come_back(start_daemon, spawn_worker, run_dir, systemd):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    first = start_daemon("--budget", "256MiB", "--state-dir", str(state_dir), env={"NOTIFY_SOCKET": str(systemd.path)})
    writer = spawn_worker(first, TWO_PERSISTENT)
    writer.readline()  # their ids: they are ready
    assert writer.wait() == 0
    # Each chunk is parked on its own: one name per chunk of each buffer.
    wait_until(lambda: systemd.names() == parked_names(state_dir, "kept") | parked_names(state_dir, "lost") != set())
    assert first.stop() == 0
    with systemd.lock:  # the store lets one go, as on FileDescriptorStoreMax or an operator's cleanup
        dropped = min(parked_names(state_dir, "lost"))
        for fd in systemd.store.pop(dropped):
            os.close(fd)

    second = start_daemon("--budget", "256MiB", "--state-dir", str(state_dir), **systemd.relaunch())
    log = second.log()
    assert "restored: 0 sessions (resuming within 30s), 1 buffers" in log
    assert re.search(r"WARNING .*buffer \d+ 'lost' \(10.0 MiB\) is lost", log)
    with second.connect() as client:
        assert client.status().committed_bytes == 6 * MiB
        kept = ExtensibleTensor.attach("kept", "cpu", client=client)
        assert filled(kept.full_view()[: 6 * MiB], 42)
        with pytest.raises(NotFound):
            client.attach("lost").close()
        again = ExtensibleTensor(16 * MiB, "cpu", client=client, name="lost", persistent=True)
        again.resize_(2 * MiB)
        assert client.status().committed_bytes == 8 * MiB
        kept.free()
        again.free()
    wait_until(lambda: systemd.names() == set())
    assert second.alive()
