"""A daemon restart keeps persistent buffers and their data, through a systemd-like FD store."""

from __future__ import annotations

import os
import re
import signal

import msgpack
import pytest
from hbmd.client import ExtensibleTensor, OutOfBudget
from hbmd.daemon.restart.persist import JOURNAL_VERSION, Journal
from hbmd.testing.spawn import DaemonProcess
from helpers import MiB, filled, parked_names, torch, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]

WRITER = """
import torch
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu", lease=False)  # one chunk per commit (leased granules are parked too: test_leases.py)
kv = ExtensibleTensor(64 << 20, "cpu", num_segments=2, client=c, name="kv", persistent=True)
for step in range(1, 4):
    kv.resize_per_segment_(step * (4 << 20))
g = torch.Generator().manual_seed(11)
kv.full_view()[: 12 << 20] = torch.randint(0, 256, (12 << 20,), dtype=torch.uint8, generator=g)
kv.full_view()[32 << 20 : 44 << 20] = 200
scratch = ExtensibleTensor(16 << 20, "cpu", client=c)
scratch.resize_(8 << 20)
print(kv.buffer_id, flush=True)
"""


@pytest.mark.system
def test_a_restart_keeps_persistent_buffers_and_their_data(start_daemon, spawn_worker, run_dir, systemd):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    first = start_daemon("--budget", "256MiB", "--state-dir", str(state_dir), env={"NOTIFY_SOCKET": str(systemd.path)})
    wait_until(lambda: systemd.saw("READY=1"))
    writer = spawn_worker(first, WRITER)
    writer.readline()  # the buffer id: it is ready
    assert writer.wait() == 0
    # One sealed memfd parked per chunk: 3 commits of 2 segments.
    wait_until(lambda: len(systemd.names()) == 6)
    assert systemd.names() == parked_names(state_dir, "kv")

    assert first.stop() == 0
    assert systemd.saw("STOPPING=1")
    second = start_daemon(
        "--budget", "256MiB", "--state-dir", str(state_dir), **systemd.relaunch()
    )
    assert "restored: 0 sessions (resuming within 30s), 1 buffers" in second.log()
    client = second.connect()
    assert client.status().committed_bytes == 24 * MiB  # the persistent buffer, not the anonymous one
    kv = ExtensibleTensor.attach("kv", "cpu", client=client)
    g = torch.Generator().manual_seed(11)
    assert torch.equal(kv.full_view()[: 12 * MiB], torch.randint(0, 256, (12 * MiB,), dtype=torch.uint8, generator=g))
    assert filled(kv.full_view()[32 * MiB : 44 * MiB], 200)
    assert (kv.num_segments, kv.bytes_per_segment, kv.num_chunks) == (2, 12 * MiB, 6)

    # It keeps working after the restart: it grows, and it can be deleted, which unparks it.
    kv.resize_per_segment_(16 * MiB)
    assert kv.num_chunks == 8
    kv.free()
    wait_until(lambda: systemd.names() == set())
    client.close()


def test_without_a_service_manager_nothing_is_parked(start_daemon, run_dir):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    daemon = start_daemon("--state-dir", str(state_dir))
    assert "parked" not in daemon.log()
    assert not any(state_dir.iterdir())


def test_unclaimed_fds_are_closed_and_unparked(start_daemon, run_dir, systemd):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    stray_r, stray_w = os.pipe()
    os.close(stray_w)
    stray = f"pipe:[{os.fstat(stray_r).st_ino}]"
    systemd.store["hbmd-a999"] = [stray_r]  # parked by an earlier run, absent from the journal
    daemon = start_daemon("--state-dir", str(state_dir), **systemd.relaunch())
    assert "restored: 0 sessions (resuming within 30s), 0 buffers" in daemon.log()
    wait_until(lambda: systemd.names() == set())
    held = {os.readlink(f"/proc/{daemon.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{daemon.pid}/fd")}
    assert stray not in held


@pytest.mark.system
def test_a_persistent_buffer_freed_before_any_commit_does_not_come_back(start_daemon, run_dir, systemd):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    first = start_daemon("--state-dir", str(state_dir), env={"NOTIFY_SOCKET": str(systemd.path)})
    client = first.connect()
    empty = ExtensibleTensor(8 * MiB, "cpu", client=client, name="empty", persistent=True)
    journal = Journal(state_dir / "host.journal")
    journaled = lambda: [b["name"] for b in journal.read()["buffers"].values()]  # noqa: E731
    wait_until(lambda: journaled() == ["empty"])
    assert systemd.names() == set()  # no chunk, nothing to park
    empty.free()
    wait_until(lambda: journaled() == [])
    client.close()
    # Its end is journaled once the daemon has read the hang-up; a stop before that would restore it, resuming.
    wait_until(lambda: journal.read()["sessions"] == {})
    assert first.stop() == 0
    second = start_daemon("--state-dir", str(state_dir), **systemd.relaunch())
    assert "restored: 0 sessions (resuming within 30s), 0 buffers" in second.log()
    with second.connect() as again:
        assert again.buffers() == []


@pytest.mark.parametrize("lease", [False, True])
@pytest.mark.system
def test_a_daemon_that_stops_leaves_its_live_clients_pages_alone(start_daemon, lease):
    daemon = start_daemon("--budget", "128MiB")
    client = daemon.connect(lease=lease, resume_timeout=0.5)  # no successor comes: the session is lost
    kv = ExtensibleTensor(64 * MiB, "cpu", num_segments=2, client=client)
    for step in range(1, 5):  # small steps: with a lease, placed granules among them
        kv.resize_per_segment_(step * (2 << 20))
    view = kv.full_view()
    view[: 8 * MiB] = 7
    view[32 * MiB : 40 * MiB] = 9

    assert daemon.stop() == 0
    # The engine's KV cache is still there to read and write: the daemon went, its pages did not.
    assert filled(view[: 8 * MiB], 7) and filled(view[32 * MiB : 40 * MiB], 9)
    view[: 8 * MiB] = 11
    assert filled(view[: 8 * MiB], 11)
    assert "stopping with 1 session(s) connected" in daemon.log()
    del view
    kv.free()  # the session is gone with the daemon: only the mappings are left to drop
    kv.free()
    with pytest.raises(ValueError, match="freed"):
        kv.full_view()


@pytest.mark.system
def test_the_default_client_goes_on_once_the_daemon_came_back(start_daemon, run_dir, monkeypatch):
    monkeypatch.setenv("HBMD_RUN_DIR", str(run_dir))
    first = start_daemon("--budget", "64MiB")
    before = ExtensibleTensor(8 * MiB, "cpu")  # client=None: the process-wide default client
    before.resize_(2 * MiB)
    assert first.stop() == 0
    second = start_daemon("--budget", "64MiB")
    after = ExtensibleTensor(8 * MiB, "cpu")  # not SessionLost
    after.resize_(4 * MiB)
    # The default client started its session over, declaring what the first tensor maps: both count.
    assert after.client is before.client and after.client.status().committed_bytes == 6 * MiB
    before.free()
    after.free()
    assert second.stop() == 0
    start_daemon("--budget", "64MiB")
    # One that mapped nothing when its daemon came back without its session is replaced by a new one.
    lone = ExtensibleTensor(8 * MiB, "cpu")
    lone.resize_(2 * MiB)
    assert lone.client is not before.client and lone.client.status().committed_bytes == 2 * MiB
    lone.client.close()


def test_a_journal_of_a_newer_daemon_is_left_alone_and_the_older_one_does_not_start(run_dir, systemd):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    journal = state_dir / "host.journal"
    journal.write_bytes(msgpack.packb(["image", {"meta": {"version": 99}, "sessions": {}, "buffers": {}}]))
    before = journal.read_bytes()
    daemon = DaemonProcess(run_dir, "--backend", "host", "--state-dir", str(state_dir),
                           env={"NOTIFY_SOCKET": str(systemd.path)})
    with pytest.raises(RuntimeError, match="hbmd exited with 1"):
        daemon.start()
    assert f"it is of version 99, newer than this daemon's {JOURNAL_VERSION}: run the newer hbmd" in daemon.log()
    assert journal.read_bytes() == before  # a downgrade loses nothing: the newer daemon finds it all again


@pytest.mark.parametrize("lost", ["every chunk", "the anonymous buffer's"])
@pytest.mark.system
def test_a_journal_back_without_its_chunks_never_leaves_memory_uncounted(start_daemon, run_dir, systemd, lost):
    """``systemctl stop`` then ``start`` within the resume window: the journal is there, the FD store is not (or only
    part of it). The session whose buffers cannot come back is not resumed: its client starts over and declares what
    it maps, so the new daemon counts it and admits nobody into it."""
    state_dir = run_dir / "state"
    state_dir.mkdir()
    args = ("--budget", "256MiB", "--state-dir", str(state_dir))
    first = start_daemon(*args, env={"NOTIFY_SOCKET": str(systemd.path)})
    client = first.connect(lease=False)
    kv = ExtensibleTensor(128 * MiB, "cpu", client=client)
    kv.resize_(96 * MiB)
    kv.full_view()[: 96 * MiB] = 5
    weights = ExtensibleTensor(32 * MiB, "cpu", client=client, name="weights", persistent=True)
    weights.resize_(32 * MiB)
    weights.full_view()[: 32 * MiB] = 9
    wait_until(lambda: len(systemd.names()) == 2)

    assert first.stop() == 0
    if lost == "every chunk":
        systemd.drop_store()
    else:
        for name in systemd.names() - parked_names(state_dir, "weights"):
            for fd in systemd.store.pop(name):
                os.close(fd)
    second = start_daemon(*args, **systemd.relaunch())
    assert "is not restored: a buffer of it did not come back whole" in second.log()

    kv.resize_(128 * MiB)  # the engine's next call goes on: no NotFound, no exception
    assert filled(kv.full_view()[: 96 * MiB], 5)
    assert filled(weights.full_view()[: 32 * MiB], 9)
    with second.connect(lease=False) as newcomer:
        assert newcomer.status().committed_bytes == 160 * MiB  # all that this process maps
        with pytest.raises(OutOfBudget):
            ExtensibleTensor(128 * MiB, "cpu", client=newcomer).resize_(128 * MiB)
        room = ExtensibleTensor(96 * MiB, "cpu", client=newcomer)
        room.resize_(96 * MiB)  # what is left of the budget, and no more
        room.free()
    kv.free()
    weights.free()
    with second.connect(observer=True) as look:
        wait_until(lambda: look.status().committed_bytes == 0 and look.buffers() == [])
    client.close()


def read_weights(daemon):
    """Sealed weights (6 MiB of 4s), left an orphan by their loader, and a reader mapping them: (reader, mapping)."""
    with daemon.connect(lease=False) as loader:
        weights = ExtensibleTensor(8 * MiB, "cpu", client=loader, name="weights", persistent=True)
        weights.resize_(6 * MiB)
        weights.full_view()[: 6 * MiB] = 4
        weights.seal()
        weights.detach()  # an orphan its readers map
    reader = daemon.connect(lease=False)
    return reader, ExtensibleTensor.attach("weights", "cpu", client=reader, readonly=True)


@pytest.mark.system
def test_a_reader_of_sealed_weights_lost_with_the_store_declares_them_again(start_daemon, run_dir, systemd):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    args = ("--budget", "64MiB", "--state-dir", str(state_dir))
    first = start_daemon(*args, env={"NOTIFY_SOCKET": str(systemd.path)})
    reader, mapped = read_weights(first)
    assert first.stop() == 0
    systemd.drop_store()
    second = start_daemon(*args, **systemd.relaunch())
    assert reader.status().committed_bytes == 6 * MiB  # counted again: declared by the process that reads them
    assert filled(mapped.full_view()[: 6 * MiB], 4)
    mapped.free()
    with second.connect(observer=True) as look:
        wait_until(lambda: look.status().committed_bytes == 0)
    reader.close()


@pytest.mark.system
def test_weights_held_by_a_reader_alone_leave_no_orphan_when_the_store_is_lost_twice(start_daemon, run_dir, systemd):
    """Issue #51: the FD store lost at two restarts in a row. After the first, a reader declares the sealed weights
    it maps, held by it alone, beside its KV cache, which then grows on chunks the daemon parks. After the second its
    KV cache cannot come back whole, so it is not resumed: the weights must not stay behind as an orphan nobody maps
    (``--check-invariants`` exited 70 on every start, and without it they were charged for good). They are lost,
    logged, and counted again as the reader declares them."""
    state_dir = run_dir / "state"
    state_dir.mkdir()
    args = ("--budget", "64MiB", "--state-dir", str(state_dir))
    first = start_daemon(*args, env={"NOTIFY_SOCKET": str(systemd.path)})
    reader, mapped = read_weights(first)
    kv = ExtensibleTensor(16 * MiB, "cpu", client=reader)
    kv.resize_(4 * MiB)
    kv.full_view()[: 4 * MiB] = 7
    assert first.stop() == 0
    systemd.drop_store()

    second = start_daemon(*args, **systemd.relaunch())
    assert reader.status().committed_bytes == 10 * MiB  # both declared again, held by the reader alone
    kv.resize_(8 * MiB)  # on a chunk the daemon makes and parks
    wait_until(lambda: len(systemd.names()) == 1)
    assert second.stop() == 0
    systemd.drop_store()

    third = start_daemon(*args, **systemd.relaunch())
    with third.connect(observer=True) as look:
        look.status()  # a request: the daemon checks its invariants after it
    assert third.alive()
    assert re.search(r"WARNING .*buffer \d+ 'weights' \(6.0 MiB\) is lost: no session that maps it came back",
                     third.log())
    assert reader.status().committed_bytes == 14 * MiB  # declared again: counted once, not twice
    assert filled(mapped.full_view()[: 6 * MiB], 4) and filled(kv.full_view()[: 4 * MiB], 7)
    mapped.free()
    kv.free()
    with third.connect(observer=True) as look:
        wait_until(lambda: look.status().committed_bytes == 0)
    reader.close()


@pytest.mark.system
def test_a_session_whose_leased_granule_did_not_come_back_starts_over_and_keeps_what_it_placed(
        start_daemon, run_dir, systemd):
    """A granule leased to a session may be placed in its buffer without a round trip, a placement the daemon may
    stop before reading; where the granule did not come back (``systemctl stop``, the FD store gone), the session is
    not resumed over a record that lacks it: its client starts over and declares what it maps."""
    state_dir = run_dir / "state"
    state_dir.mkdir()
    args = ("--budget", "256MiB", "--state-dir", str(state_dir))
    first = start_daemon(*args, env={"NOTIFY_SOCKET": str(systemd.path)})
    client = first.connect(lease=True)
    kv = ExtensibleTensor(64 * MiB, "cpu", client=client, name="kv", persistent=True)
    kv.resize_(2 * MiB)  # one granule through the daemon: a lease follows it
    kv.full_view()[: 2 * MiB] = 3
    wait_until(lambda: client.leased_granules >= 1 and len(systemd.names() - parked_names(state_dir, "kv")) > 0)
    os.kill(first.pid, signal.SIGSTOP)  # a daemon that does not get to read the placement before it stops
    kv.resize_(4 * MiB)  # onto a leased granule, placed without a round trip
    kv.full_view()[2 * MiB : 4 * MiB] = 4
    os.kill(first.pid, signal.SIGTERM)
    os.kill(first.pid, signal.SIGCONT)
    assert first.proc.wait(30) == 0
    for name in systemd.names() - parked_names(state_dir, "kv"):  # the leased granules, and only those, are gone
        for fd in systemd.store.pop(name):
            os.close(fd)
    second = start_daemon(*args, **systemd.relaunch())
    assert "is not restored: a granule leased to it did not come back" in second.log()

    kv.resize_(8 * MiB)
    assert filled(kv.full_view()[: 2 * MiB], 3) and filled(kv.full_view()[2 * MiB : 4 * MiB], 4)
    with second.connect(observer=True) as look:
        assert look.status().committed_bytes == kv.physical_bytes == 8 * MiB
