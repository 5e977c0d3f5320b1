"""Nothing lost (issue #14): persistent buffers outlive their holder however it lets go or dies.

A session detaches a buffer and another process attaches it with its data; a
worker SIGKILLed while a forked child still holds its sockets releases its
session at once; an attach right after a SIGKILL finds the buffer free; a
client whose daemon went away learns it at its next call; a restart that
does not get every parked FD back skips what is missing and serves the rest.
"""

from __future__ import annotations

import json

import pytest
from hbmd.client import ExtensibleTensor, InvalidRequest, PermissionDenied
from helpers import MiB, hbmctl

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.ipc

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
    assert listed[buffer_id]["session_id"] == 0 and listed[buffer_id]["physical_bytes"] == 12 * MiB
    row = next(line for line in hbmctl("--run-dir", rd, "buffers").stdout.splitlines() if " kv " in line)
    assert row.split()[:3] == [str(buffer_id), "orphan", "kv"]

    kv = ExtensibleTensor.attach("kv", "cpu", client=client)
    expected = torch.arange(6 * MiB, dtype=torch.int64).remainder(251).to(torch.uint8)
    assert torch.equal(kv.full_view()[: 6 * MiB], expected)
    assert int(kv.full_view()[16 * MiB : 22 * MiB].float().mean()) == 77
    assert kv.buffer_id == buffer_id and kv.bytes_per_segment == 6 * MiB

    writer.send("done")
    assert writer.wait() == 0
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
        with pytest.raises(PermissionDenied):
            client.detach(named.buffer_id)
        assert {b.buffer_id: b.session_id for b in client.buffers()} == {
            anonymous.buffer_id: client.session_id,
            named.buffer_id: other.session_id,
        }
    assert daemon.alive()
