"""Sealed buffers (issue #18): written once, then read by several sessions at once, read-only, on the host backend.

The writer seals a persistent buffer; from then on the daemon refuses to
change it, any session of the same user attaches it read-only beside the
others, a write through such a mapping faults, the budget counts it once
(to the writer's tenant), its delete waits for its readers, and it outlives
its writer.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import signal

import pytest
from hbmd.client import Conflict, ExtensibleTensor, InvalidRequest, NotFound
from hbmd.daemon.restart.persist import Journal
from helpers import MiB, filled, hbmctl, parked_names, torch, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]

PATTERN_SEED = 18


def pattern(size: int) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(PATTERN_SEED))


WRITER = """
import sys
import torch
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu", client_name="writer", tenant="loader")
w = ExtensibleTensor(16 << 20, "cpu", client=c, name="weights", persistent=True)
w.resize_(6 << 20)
w.full_view()[: 6 << 20] = torch.randint(0, 256, (6 << 20,), dtype=torch.uint8,
                                         generator=torch.Generator().manual_seed(18))
w.seal()
print(w.buffer_id, c.session_id, flush=True)
sys.stdin.readline()
"""

READER = """
import ctypes
import hashlib
import sys
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu", client_name="reader", tenant="engine")
w = ExtensibleTensor.attach("weights", "cpu", client=c, readonly=True)
print(c.session_id, hashlib.sha256(ctypes.string_at(w.base_ptr, w.num_bytes)).hexdigest(), flush=True)
if sys.stdin.readline().strip() == "write":
    w.full_view()[0] = 1
    print("wrote", flush=True)
sys.stdin.readline()
"""


def sealed_writer(daemon, spawn_worker):
    writer = spawn_worker(daemon, WRITER)
    buffer_id, session_id = map(int, writer.readline().split())
    return writer, buffer_id, session_id


def info(client, buffer_id):
    return next(b for b in client.buffers() if b.buffer_id == buffer_id)


@pytest.mark.system
def test_two_processes_read_a_sealed_buffer_at_once_and_see_the_same_bytes(daemon, client, spawn_worker):
    _writer, buffer_id, _ = sealed_writer(daemon, spawn_worker)
    readers = [spawn_worker(daemon, READER) for _ in range(2)]
    lines = [r.readline().split() for r in readers]
    written = pattern(6 * MiB)
    expected = hashlib.sha256(ctypes.string_at(written.data_ptr(), 6 * MiB)).hexdigest()
    assert [digest for _, digest in lines] == [expected, expected]

    # And this process reads it too, beside them and its writer.
    w = ExtensibleTensor.attach("weights", "cpu", client=client, readonly=True)
    assert w.readonly and w.sealed and torch.equal(w.tensor, pattern(6 * MiB))
    buffer = info(client, buffer_id)
    assert buffer.sealed and buffer.readers == 3 and buffer.session_id != 0

    rows = json.loads(hbmctl("--run-dir", str(daemon.run_dir), "--json", "buffers").stdout)["buffers"]
    row = next(r for r in rows if r["buffer_id"] == buffer_id)
    assert row["sealed"] is True and row["readers"] == 3
    table = hbmctl("--run-dir", str(daemon.run_dir), "buffers").stdout.splitlines()
    assert table[0].split()[-2:] == ["SEALED", "READERS"]
    assert next(line for line in table if " weights " in line).split()[-2:] == ["yes", "3"]

    # A reader's end drops its read claim; detaching drops this one.
    readers[0].kill()
    wait_until(lambda: info(client, buffer_id).readers == 2)
    w.detach()
    assert info(client, buffer_id).readers == 1


@pytest.mark.system
def test_a_write_through_a_read_only_mapping_faults_and_hurts_nobody_else(daemon, client, spawn_worker):
    _writer, buffer_id, _ = sealed_writer(daemon, spawn_worker)
    vandal = spawn_worker(daemon, READER)
    vandal_session = int(vandal.readline().split()[0])
    w = ExtensibleTensor.attach("weights", "cpu", client=client, readonly=True)
    vandal.send("write")
    assert vandal.wait() == -signal.SIGSEGV
    # The bytes are untouched, the vandal's claim went with it, the daemon serves on.
    assert torch.equal(w.tensor, pattern(6 * MiB))
    wait_until(lambda: all(s.session_id != vandal_session for s in client.sessions()))
    assert info(client, buffer_id).readers == 1


def test_a_sealed_buffer_refuses_every_change(daemon, client):
    w = ExtensibleTensor(16 * MiB, "cpu", client=client, name="weights", persistent=True)
    w.resize_(4 * MiB)
    w.full_view()[: 4 * MiB] = 9
    assert not w.sealed
    w.seal()
    assert w.sealed and w.seal() is w  # sealing again changes nothing

    # The daemon refuses, whichever way the request comes...
    for refused in (
        lambda: client.commit(w.buffer_id, 8 * MiB).close(),
        lambda: client.release(w.buffer_id),
        lambda: client.defragment(w.buffer_id, True).close(),
        lambda: client.defragment(w.buffer_id, False).close(),
    ):
        with pytest.raises(InvalidRequest, match="sealed: it is immutable"):
            refused()
    # ...and the tensor refuses before it unmaps anything.
    for refused in (lambda: w.resize_(8 * MiB), w.release_physical, w.defragment, lambda: w.defragment(False), w.zero_):
        with pytest.raises(InvalidRequest, match="sealed"):
            refused()
    assert filled(w.tensor, 9) and w.physical_bytes == 4 * MiB
    assert client.status().committed_bytes == 4 * MiB

    # A reader may not change it either, nor drop it.
    reader = ExtensibleTensor.attach("weights", "cpu", client=client, readonly=True)
    for refused in (
        lambda: reader.resize_(8 * MiB), reader.release_physical, reader.defragment, reader.zero_, reader.seal
    ):
        with pytest.raises(ValueError, match="read-only attach"):
            refused()
    reader.free()  # lets go of the read claim, not of the buffer
    assert info(client, w.buffer_id).readers == 0 and client.status().num_buffers == 1


def test_only_a_sealed_persistent_buffer_is_read_only_attached_or_sealed(daemon, client):
    kv = ExtensibleTensor(8 * MiB, "cpu", client=client, name="kv", persistent=True)
    with pytest.raises(InvalidRequest, match="not sealed"):
        ExtensibleTensor.attach("kv", "cpu", client=client, readonly=True)
    with pytest.raises(NotFound):
        ExtensibleTensor.attach("nothing", "cpu", client=client, readonly=True)
    anonymous = ExtensibleTensor(8 * MiB, "cpu", client=client)
    with pytest.raises(InvalidRequest, match="anonymous"):
        anonymous.seal()
    # The unsealed buffer keeps the single-user attach: held, it is a Conflict for another session.
    with daemon.connect() as other:
        with pytest.raises(Conflict):
            ExtensibleTensor.attach("kv", "cpu", client=other)
        with pytest.raises(NotFound):  # another session's buffer is answered as one that does not exist
            other.seal(kv.buffer_id)
    assert client.status().num_buffers == 2 and not any(b.sealed or b.readers for b in client.buffers())


@pytest.mark.system
def test_deleting_a_sealed_buffer_waits_for_its_readers(daemon, client, spawn_worker):
    writer, _buffer_id, _ = sealed_writer(daemon, spawn_worker)
    writer.send("done")
    assert writer.wait() == 0
    reader = spawn_worker(daemon, READER)
    reader_session = int(reader.readline().split()[0])

    with pytest.raises(Conflict, match=f"read by session {reader_session}") as refused:
        client.delete("weights")
    assert refused.value.details["session_id"] == reader_session
    out = hbmctl("--run-dir", str(daemon.run_dir), "delete", "weights")
    assert out.returncode == 3 and str(reader_session) in out.stderr
    assert client.status().committed_bytes == 6 * MiB

    # Once the reader is gone (even killed, its end not yet seen by the daemon), the delete goes through.
    reader.proc.kill()
    reader.wait()
    assert client.delete("weights").freed_bytes == 6 * MiB
    assert client.status().committed_bytes == 0 and client.status().num_buffers == 0


def test_a_refused_free_leaves_the_owners_tensor_whole_until_the_readers_are_gone(daemon, client):
    w = ExtensibleTensor(16 * MiB, "cpu", client=client, name="weights", persistent=True)
    w.resize_(4 * MiB)
    w.full_view()[: 4 * MiB] = pattern(4 * MiB)
    w.seal()
    with daemon.connect() as other:
        reader = ExtensibleTensor.attach("weights", "cpu", client=other, readonly=True)
        for _ in range(2):  # refused again: the first refusal did not forget the buffer
            with pytest.raises(Conflict, match=f"read by session {other.session_id}"):
                w.free()
            assert torch.equal(w.tensor, pattern(4 * MiB))
        reader.free()
    w.free()
    assert client.status().num_buffers == 0 and client.buffers() == []


def test_a_refused_detach_leaves_the_tensor_usable(daemon, client):
    anonymous = ExtensibleTensor(8 * MiB, "cpu", client=client)
    anonymous.resize_(2 * MiB)
    anonymous.tensor[:] = 7
    with pytest.raises(InvalidRequest, match="anonymous"):
        anonymous.detach()
    assert filled(anonymous.tensor, 7)
    anonymous.free()
    assert client.status().num_buffers == 0


def test_a_release_the_daemon_refuses_maps_the_tensor_back(daemon, client, monkeypatch):
    kv = ExtensibleTensor(8 * MiB, "cpu", client=client)
    kv.resize_(2 * MiB)
    kv.tensor[:] = 5

    def refuse(buffer_id):
        raise Conflict(f"buffer {buffer_id} is busy")

    # Every refusal the daemon has for a release the tensor makes first; this one stands for a newer daemon's.
    monkeypatch.setattr(client, "release", refuse)
    with pytest.raises(Conflict, match="busy"):
        kv.release_physical()
    assert kv.num_physical_chunks == kv.num_chunks == 1  # before a read, which would fault were it unmapped
    assert filled(kv.tensor, 5) and kv.physical_bytes == 2 * MiB


@pytest.mark.system
def test_the_budget_counts_a_sealed_buffer_once_to_its_writers_tenant(start_daemon, spawn_worker):
    daemon = start_daemon("--budget", "10MiB")
    _writer, _buffer_id, writer_session = sealed_writer(daemon, spawn_worker)
    readers = [spawn_worker(daemon, READER) for _ in range(3)]
    reader_sessions = [int(r.readline().split()[0]) for r in readers]
    with daemon.connect(tenant="engine") as client:
        status = client.status()
        assert status.committed_bytes == 6 * MiB
        tenants = {t.name: t.used_bytes for t in status.tenants}
        assert tenants["loader"] == 6 * MiB and tenants.get("engine", 0) == 0
        sessions = {s.session_id: s.committed_bytes for s in client.sessions()}
        assert sessions[writer_session] == 6 * MiB
        assert [sessions[s] for s in reader_sessions] == [0, 0, 0]
        # Three readers took nothing: the 4 MiB left are there for a commit.
        kv = ExtensibleTensor(4 * MiB, "cpu", client=client)
        kv.resize_(4 * MiB)
        assert client.status().committed_bytes == 10 * MiB


@pytest.mark.system
def test_the_writers_end_leaves_the_sealed_buffer_to_its_readers(daemon, client, spawn_worker):
    writer, buffer_id, _writer_session = sealed_writer(daemon, spawn_worker)
    w = ExtensibleTensor.attach("weights", "cpu", client=client, readonly=True)
    writer.kill()
    wait_until(lambda: info(client, buffer_id).session_id == 0)
    buffer = info(client, buffer_id)
    assert buffer.sealed and buffer.readers == 1 and buffer.physical_bytes == 6 * MiB
    assert torch.equal(w.tensor, pattern(6 * MiB))
    # A new reader comes after the writer is gone.
    second = spawn_worker(daemon, READER)
    second.readline()
    assert info(client, buffer_id).readers == 2
    # The orphan can be taken over read-write (to delete it, say), still sealed and still read.
    with daemon.connect() as owner:
        taken = ExtensibleTensor.attach("weights", "cpu", client=owner)
        assert taken.sealed
        with pytest.raises(InvalidRequest, match="sealed"):
            taken.resize_(8 * MiB)
        with pytest.raises(Conflict, match="read by"):
            taken.free()


@pytest.mark.system
def test_a_restart_keeps_a_buffer_sealed(start_daemon, spawn_worker, run_dir, systemd):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    first = start_daemon("--budget", "256MiB", "--state-dir", str(state_dir), env={"NOTIFY_SOCKET": str(systemd.path)})
    wait_until(lambda: systemd.saw("READY=1"))
    writer, buffer_id, _ = sealed_writer(first, spawn_worker)
    writer.send("done")
    assert writer.wait() == 0
    # Its one chunk (one commit) parked with the service manager.
    wait_until(lambda: len(systemd.names()) == 1 and systemd.names() == parked_names(state_dir, "weights"))
    journal = Journal(state_dir / "host.journal").read()
    assert [b["sealed"] for b in journal["buffers"].values()] == [True]

    assert first.stop() == 0
    second = start_daemon("--budget", "256MiB", "--state-dir", str(state_dir), **systemd.relaunch())
    with second.connect() as client:
        w = ExtensibleTensor.attach("weights", "cpu", client=client, readonly=True)
        assert w.sealed and torch.equal(w.tensor, pattern(6 * MiB))
        assert info(client, buffer_id).readers == 1


SEALER_WHO_WRITES = """
import sys
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu", client_name="writer")
if sys.argv[1] == "attach":
    w = ExtensibleTensor.attach("weights", "cpu", client=c)
else:
    w = ExtensibleTensor(16 << 20, "cpu", client=c, name="weights", persistent=True)
    w.resize_(4 << 20)
    w.full_view()[: 4 << 20] = 5
    w.seal()
print(int(w.full_view()[0]), flush=True)
w.full_view()[0] = 1
print("wrote", flush=True)
"""


@pytest.mark.parametrize("how", ["seal", "attach"])
@pytest.mark.system
def test_the_owners_own_mapping_of_a_sealed_buffer_is_read_only(daemon, client, spawn_worker, how):
    if how == "attach":
        # The owner who takes over a sealed orphan maps it read-only too.
        w = ExtensibleTensor(16 * MiB, "cpu", client=client, name="weights", persistent=True)
        w.resize_(4 * MiB)
        w.full_view()[: 4 * MiB] = 5
        w.seal()
        w.detach()
    worker = spawn_worker(daemon, SEALER_WHO_WRITES.replace("sys.argv[1]", repr(how)))
    assert worker.readline() == "5"
    assert worker.wait() == -signal.SIGSEGV
    r = ExtensibleTensor.attach("weights", "cpu", client=client, readonly=True)
    assert filled(r.tensor, 5) and r.num_bytes == 4 * MiB
