"""Leased granules on a real daemon: commits without a round trip, accounted at grant time, given back under
pressure and at the session's end, and a daemon that stays whole whatever a client says it placed.

The kill loop (``test_kill_loop.py``) checks the other half of the promise: a persistent buffer grown from
leases and re-attached after a SIGKILL holds every granule whose commit returned.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import select
import signal
import sys
import threading
import time

import pytest
from hbmd import proto
from hbmd.client import ExtensibleTensor, OutOfBudget
from hbmd.client import recovery as client_recovery
from hbmd.daemon.state.leases import LEASE_RETURN_PATIENCE_S
from helpers import GRANULE, MiB, daemon_view, hbmctl, wait_until

pytestmark = pytest.mark.ipc


ONE_GRANULE_PER_TURN = (
    "import importlib, sys; from hbmd.daemon.main import main; "
    "importlib.import_module('hbmd.daemon.server.session').TOP_UP_WORK_PER_TURN_S = 1e-9; sys.exit(main(sys.argv[1:]))"
)
"""The daemon with the lease top-ups' share of a turn so small that it makes one granule per turn."""


def leased_at_least(client, granules: int, timeout: float = 10) -> None:
    """Wait until the client holds ``granules`` imported leased granules."""
    wait_until(lambda: client.leased_granules >= granules, timeout=timeout)


@pytest.mark.torch
def test_once_leased_small_commits_take_no_round_trip_and_the_daemon_records_them(daemon, client):
    t = ExtensibleTensor(64 * MiB, "cpu", num_segments=2, client=client, name="kv", persistent=True)
    t.resize_per_segment_(GRANULE)  # through the daemon: the lease starts growing from this demand
    leased_at_least(client, 4)
    sent = client.requests_sent
    for step in (2, 3):
        t.resize_per_segment_(step * GRANULE)
        t.segment_view(0)[-GRANULE:] = step
        t.segment_view(1)[-GRANULE:] = 10 + step
    assert client.requests_sent == sent, "a commit the lease covered went to the daemon"
    info = daemon_view(client, t)
    assert info.segment_sizes == t.segment_sizes == [3 * GRANULE] * 2
    assert info.physical_bytes == t.physical_bytes == 6 * GRANULE and info.num_chunks == t.num_chunks == 6
    # Anyone asking right after the commits returned sees them: the daemon reads placements before it answers.
    assert client.status().committed_bytes == 6 * GRANULE
    wait_until(lambda: client.status().leased_bytes >= 2 * GRANULE)  # refilled after the placements
    t.detach()
    again = ExtensibleTensor.attach("kv", "cpu", client=client)
    assert [int(again.segment_view(0)[(s - 1) * GRANULE]) for s in (2, 3)] == [2, 3]
    assert [int(again.segment_view(1)[(s - 1) * GRANULE]) for s in (2, 3)] == [12, 13]


@pytest.mark.torch
@pytest.mark.system
def test_credit_stands_behind_the_granules_of_a_session_that_outruns_its_lease(start_daemon):
    """A session stepping one granule at a time is granted credit as well as granules: with the daemon stopped, so
    that nothing is refilled, the steps past its two granules are made in the client, with no round trip."""
    daemon = start_daemon("--budget", "256MiB", "--lease", "4MiB")
    with daemon.connect() as client:
        t = ExtensibleTensor(64 * MiB, "cpu", client=client)
        t.resize_(GRANULE)  # through the daemon: the lease and the credit grow from this demand
        wait_until(lambda: client.leased_granules == 2 and client.leasing.credit_covers(2 * GRANULE), timeout=10)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            sent = client.requests_sent
            for step in range(2, 6):
                t.resize_(step * GRANULE)
                t.full_view()[(step - 1) * GRANULE : step * GRANULE] = step
            assert client.requests_sent == sent, "a step past the granules went to the daemon"
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        info = daemon_view(client, t)
        assert info.segment_sizes == [5 * GRANULE] and info.num_chunks == t.num_chunks == 5
        assert [int(t.full_view()[step * GRANULE - 1]) for step in range(2, 6)] == [2, 3, 4, 5]


@pytest.mark.torch
@pytest.mark.system
def test_growth_inside_backed_granules_and_uneven_segments_place_exactly_what_is_needed(daemon, client):
    # Segments of 3 MiB: the granule at 2-4 MiB straddles both, so growing segment 0 past 2 MiB backs part of 1.
    t = ExtensibleTensor(6 * MiB, "cpu", segment_capacities=[3 * MiB, 3 * MiB], client=client)
    t.resize_segments_([MiB, 0])
    leased_at_least(client, 2)
    sent = client.requests_sent
    for sizes in ([MiB + 4096, 0],  # inside the granule already backed: a placement of nothing
                  [3 * MiB, 0],  # the straddling granule
                  [3 * MiB, MiB],  # inside it again, for segment 1
                  [3 * MiB, 3 * MiB]):  # the last granule
        t.resize_segments_(sizes)
        assert daemon_view(client, t).segment_sizes == t.segment_sizes == sizes
    assert client.requests_sent == sent + 4  # the four daemon_view calls: no commit went to the daemon
    assert daemon_view(client, t).physical_bytes == t.physical_bytes == 6 * MiB and t.num_chunks == 3
    t.full_view()[:] = 9  # every committed byte is mapped
    assert int(t.full_view().sum()) == 9 * 6 * MiB


def test_a_run_of_several_granules_is_one_chunk_from_the_daemon_as_without_a_lease(daemon, client):
    """What vLLM's defragment relies on: after a release, growing a segment back gives it one chunk."""
    t = ExtensibleTensor(32 * MiB, "cpu", num_segments=2, client=client)
    t.resize_per_segment_(GRANULE)
    leased_at_least(client, 4)
    t.release_physical()
    t.resize_per_segment_(3 * GRANULE)
    assert t.num_chunks == 2 and t.segments_backed_by_one_chunk([3 * GRANULE] * 2) == [True, True]


@pytest.mark.torch
@pytest.mark.system
def test_leased_bytes_are_charged_at_grant_shown_apart_and_returned_when_the_session_ends(daemon, client):
    worker = daemon.connect(client_name="engine")
    t = ExtensibleTensor(64 * MiB, "cpu", client=worker)
    t.resize_(GRANULE)
    leased_at_least(worker, 2)
    status = client.status()
    leased = status.leased_bytes
    assert leased >= 2 * GRANULE and status.committed_bytes == GRANULE
    (tenant,) = status.tenants
    assert tenant.used_bytes == GRANULE + leased  # the tenant's limits count the lease
    assert status.admissible_bytes == status.budget_bytes - GRANULE - leased
    (session,) = [s for s in client.sessions() if s.session_id == worker.session_id]
    assert session.leased_bytes == leased and session.committed_bytes == GRANULE
    [shown] = json.loads(hbmctl("--run-dir", str(daemon.run_dir), "--json", "status").stdout)["instances"]
    assert shown["leased_bytes"] == leased and shown["budget_left_bytes"] == 256 * MiB - GRANULE - leased
    assert "LEASED" in hbmctl("--run-dir", str(daemon.run_dir), "sessions").stdout
    worker.close()
    wait_until(lambda: client.status().leased_bytes == 0 and client.status().committed_bytes == 0)


@pytest.mark.torch
@pytest.mark.parametrize("lease_option, lease", [("0", True), ("64MiB", False)])
@pytest.mark.system
def test_a_daemon_with_leases_off_or_a_client_without_commits_through_the_daemon(start_daemon, lease_option, lease):
    daemon = start_daemon("--budget", "256MiB", "--lease", lease_option, "--credit", "0")
    with daemon.connect(lease=lease) as client:
        assert client.welcome.lease_bytes == 0
        t = ExtensibleTensor(16 * MiB, "cpu", client=client)
        for size in (1, 2, 3):
            sent = client.requests_sent
            t.resize_(size * GRANULE)
            assert client.requests_sent == sent + 1
        assert client.status().leased_bytes == 0 and t.num_chunks == 3


def test_a_lease_made_one_granule_a_turn_fills_without_the_loop_waiting_between(start_daemon):
    """Each turn makes a share of the granules due, and the next turn follows at once while any are due: a lease
    made one granule a turn fills in moments, not one granule per poll timeout (a second), and requests are
    answered meanwhile."""
    daemon = start_daemon("--budget", "1GiB", command=[sys.executable, "-c", ONE_GRANULE_PER_TURN])
    with daemon.connect() as client:
        t = ExtensibleTensor(64 * MiB, "cpu", num_segments=8, client=client)
        t.resize_per_segment_(GRANULE)  # eight granules through the daemon: a lease of 16 is due
        assert client.status().committed_bytes == 8 * GRANULE
        leased_at_least(client, 16, timeout=5)
        sent = client.requests_sent
        t.resize_per_segment_(2 * GRANULE)
        assert client.requests_sent == sent and client.status().leased_bytes >= 8 * GRANULE


@pytest.mark.torch
@pytest.mark.system
def test_a_worker_that_only_grows_from_its_lease_keeps_a_bounded_record(daemon, client, monkeypatch):
    """Placements are kept to send again after a restart until an answer confirms them; a worker that sends no
    request asks for one past MAX_UNCONFIRMED, so what it keeps stays bounded, however long it runs."""
    monkeypatch.setattr(client_recovery, "MAX_UNCONFIRMED", 8)
    t = ExtensibleTensor(64 * MiB, "cpu", client=client)
    t.resize_(GRANULE)  # through the daemon: the lease grows from this demand
    sent = client.requests_sent
    for step in range(2, 29):
        leased_at_least(client, 1)  # each step a placement
        t.resize_(step * GRANULE)
        t.full_view()[(step - 1) * GRANULE : step * GRANULE] = step
        assert len(client._recovery.unconfirmed) <= 8
    assert client.requests_sent == sent + 3  # at the 9th, 18th and 27th placement
    assert daemon_view(client, t).num_chunks == 28
    assert [int(t.full_view()[step * GRANULE - 1]) for step in range(2, 29)] == list(range(2, 29))


@pytest.mark.torch
def test_a_lease_is_never_granted_into_a_tight_budget(start_daemon):
    daemon = start_daemon("--budget", "64MiB")  # no grant may leave a tenant's room under 4 MiB, a 16th
    with daemon.connect() as client:
        t = ExtensibleTensor(64 * MiB, "cpu", client=client)
        most_leased = 0
        for size in range(1, 31):
            t.resize_(size * GRANULE)
            status = client.status()
            most_leased = max(most_leased, status.leased_bytes)
            assert status.committed_bytes + status.leased_bytes <= max(60 * MiB, status.committed_bytes)
        assert most_leased > 0  # it was leased while there was room
        status = client.status()
        assert status.committed_bytes == 60 * MiB and status.leased_bytes == 0


@pytest.mark.torch
def test_another_sessions_commit_asks_leases_back_and_succeeds_on_retry(daemon, client):
    holder = daemon.connect(client_name="holder")
    ExtensibleTensor(64 * MiB, "cpu", num_segments=4, client=holder).resize_per_segment_(GRANULE)
    leased_at_least(holder, 4)
    leased = client.status().leased_bytes
    big = ExtensibleTensor(256 * MiB, "cpu", client=client, shareable=True)  # shareable: never from a lease
    room = client.status().budget_bytes - 4 * GRANULE
    with pytest.raises(OutOfBudget, match="leased"):
        big.resize_(room)
    # The holder's listener gave its unplaced granules back; the commit now fits.
    wait_until(lambda: client.status().leased_bytes == 0)
    big.resize_(room)
    assert holder.leased_granules == 0 and client.status().committed_bytes == 256 * MiB
    assert leased > 0
    holder.close()


@pytest.mark.torch
def test_a_sessions_own_lease_makes_room_for_its_own_commit(daemon, client):
    t = ExtensibleTensor(256 * MiB, "cpu", client=client)
    t.resize_(GRANULE)
    leased_at_least(client, 2)
    room = client.device_memory().budget_left  # counts this session's own lease as room
    assert room == 256 * MiB - GRANULE
    sent = client.requests_sent
    # More than the lease covers, and more than fits beside it: refused once, the client gives its lease back
    # (the daemon reads the return before the retry) and the retry fits.
    t.resize_(256 * MiB)
    assert client.requests_sent == sent + 2
    assert client.leased_granules == 0 and client.status().leased_bytes == 0
    assert daemon_view(client, t).physical_bytes == 256 * MiB
    assert "refused buffer.commit" in daemon.log()


@pytest.mark.system
def test_hbmctl_reclaim_takes_the_lease_back_first(daemon, client):
    worker = daemon.connect(client_name="engine")
    ExtensibleTensor(64 * MiB, "cpu", num_segments=2, client=worker).resize_per_segment_(GRANULE)
    leased_at_least(worker, 2)
    out = hbmctl("--run-dir", str(daemon.run_dir), "reclaim", "--session", str(worker.session_id), "--bytes", "8MiB")
    assert out.returncode == 0, out.stderr
    wait_until(lambda: client.status().leased_bytes == 0)
    assert worker.leased_granules == 0
    worker.close()


@pytest.mark.torch
@pytest.mark.system
def test_a_lease_its_session_does_not_give_back_is_not_promised_to_a_retry(daemon, spawn_worker):
    deaf = spawn_worker(
        daemon,
        """
        import time
        from hbmd.client import ExtensibleTensor, connect
        c = connect("cpu", client_name="deaf")
        ExtensibleTensor(64 << 20, "cpu", client=c).resize_(2 << 20)
        while c.leased_granules < 2 or not c.leasing.credit_covers(4 << 20):  # granules, and credit behind them
            time.sleep(0.01)
        print("leased", flush=True)
        time.sleep(600)
        """,
    )
    assert deaf.readline().strip() == "leased"
    # It reads nothing more, the daemon's requests to give the lease back included.
    os.kill(deaf.proc.pid, signal.SIGSTOP)
    with daemon.connect(client_name="engine", lease=False) as engine:
        leased = engine.status().leased_bytes
        assert leased >= 2 * GRANULE + 4 * MiB
        big = engine.create_buffer(256 * MiB, 1)
        with pytest.raises(OutOfBudget, match=r"leased \(being asked back: retry\)"):
            engine.commit(big.buffer_id, 256 * MiB - 2 * MiB)
        time.sleep(LEASE_RETURN_PATIENCE_S + 0.5)  # the daemon's patience runs out: the thing under test
        with pytest.raises(OutOfBudget) as refused:
            engine.commit(big.buffer_id, 256 * MiB - 2 * MiB)
        assert "retry" not in refused.value.message
        assert f"{leased >> 20}.0 MiB of it leased to sessions that have not given it back" in refused.value.message
        os.kill(deaf.proc.pid, signal.SIGCONT)  # it reads the request at last, and gives the lease back
        wait_until(lambda: engine.status().leased_bytes == 0)
        engine.commit(big.buffer_id, 256 * MiB - 2 * MiB).close()


def test_placements_a_client_was_not_leased_change_nothing(daemon, client):
    """Hostile or stale placements on the handle socket: refused one by one, the daemon's accounting whole."""
    t = ExtensibleTensor(64 * MiB, "cpu", num_segments=2, client=client)
    t.resize_per_segment_(GRANULE)
    leased_at_least(client, 2)
    other = daemon.connect(client_name="other")
    theirs = ExtensibleTensor(16 * MiB, "cpu", client=other)
    before = (daemon_view(client, t), client.status().leased_bytes)
    sock = client._core.handles.sock
    bad = [
        proto.LeasePlace(t.buffer_id, [2 * GRANULE] * 2, [10**9, 10**9 + 1], [GRANULE, 5 * GRANULE]),  # not leased
        proto.LeasePlace(t.buffer_id, [2 * GRANULE] * 2, [1], [GRANULE]),  # too few granules
        proto.LeasePlace(t.buffer_id, [GRANULE] * 2, [], []),  # the same sizes: allowed, a no-op
        proto.LeasePlace(t.buffer_id, [GRANULE, 0], [], []),  # shrinking
        proto.LeasePlace(t.buffer_id, [64 * MiB] * 2, [], []),  # beyond the capacity
        proto.LeasePlace(theirs.buffer_id, [GRANULE], [], []),  # another session's buffer
        proto.LeasePlace(t.buffer_id, [2 * GRANULE], [], []),  # one size for two segments
        proto.LeasePlace(t.buffer_id, [GRANULE] * (proto.MAX_PLACED_SEGMENTS + 1), [], []),  # too many sizes
        proto.LeasePlace(t.buffer_id, [9 * GRANULE] * 2, list(range(1, 17)), [i * GRANULE for i in range(1, 17)]),
        proto.LeasePlace(t.buffer_id, [2 * GRANULE] * 2, [1, 2], [GRANULE]),  # an offset short
        proto.LeaseReturn([10**9, -1, 0]),  # nothing of it is leased
    ]
    for msg in bad:
        sock.send(proto.encode_datagram(msg))
    sock.send(b"\x93garbage")
    sock.send(proto.encode_datagram(proto.Status()))  # a request kind on the handle plane: ignored
    assert (daemon_view(client, t), client.status().leased_bytes) == before
    assert "refused" in daemon.log()
    t.resize_per_segment_(3 * GRANULE)  # the session and its lease still work
    assert daemon_view(client, t).segment_sizes == [3 * GRANULE] * 2
    other.close()


@pytest.mark.torch
def test_a_buffer_of_more_segments_than_a_placement_carries_grows_through_the_daemon(daemon, client):
    small = ExtensibleTensor(16 * MiB, "cpu", client=client)
    small.resize_(GRANULE)
    leased_at_least(client, 2)
    segments = proto.MAX_PLACED_SEGMENTS + 1
    wide = ExtensibleTensor(segments * GRANULE, "cpu", num_segments=segments, client=client)
    sent = client.requests_sent
    wide.resize_segments_([GRANULE] + [0] * (segments - 1))  # one granule, which the lease holds
    assert client.requests_sent == sent + 1
    assert daemon_view(client, wide).segment_sizes == wide.segment_sizes
    assert daemon_view(client, wide).physical_bytes == wide.physical_bytes == GRANULE


@pytest.mark.system
def test_a_session_that_dies_with_placements_unread_keeps_them(daemon, client, spawn_worker):
    """The worker's placements reach the daemon's socket before its commits return, and the daemon reads them
    before it ends the session, however fast the death."""
    worker = spawn_worker(
        daemon,
        """
        import ctypes, os, signal, time
        from hbmd.client import ExtensibleTensor, connect
        c = connect("cpu", client_name="dies")
        t = ExtensibleTensor(64 << 20, "cpu", client=c, name="kv", persistent=True)
        t.resize_per_segment_(2 << 20)
        sent = c.requests_sent
        for step in range(2, 10):
            while not c.leased_granules:
                time.sleep(0.001)
            t.resize_per_segment_(step << 21)
            ctypes.memset(t.base_ptr + ((step - 1) << 21), step, 2 << 20)
        assert c.requests_sent == sent  # every one of them from the lease
        os.kill(os.getpid(), signal.SIGKILL)
        """,
    )
    worker.wait()
    wait_until(lambda: client.status().num_sessions == 1)
    t = ExtensibleTensor.attach("kv", "cpu", client=client)
    assert t.num_bytes == 18 * MiB
    assert [ctypes.string_at(t.base_ptr + (step - 1) * GRANULE, 1)[0] for step in range(2, 10)] == list(range(2, 10))


@pytest.mark.torch
@pytest.mark.system
def test_leased_granules_are_parked_across_a_restart(start_daemon, spawn_worker, run_dir, systemd):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    env = {"NOTIFY_SOCKET": str(systemd.path)}
    first = start_daemon("--budget", "256MiB", "--state-dir", str(state_dir), env=env)
    wait_until(lambda: systemd.saw("READY=1"))
    writer = spawn_worker(
        first,
        """
        import time
        from hbmd.client import ExtensibleTensor, connect
        c = connect("cpu")
        t = ExtensibleTensor(32 << 20, "cpu", client=c, name="kv", persistent=True)
        t.resize_per_segment_(2 << 20)
        sent = c.requests_sent
        for step in range(2, 6):
            while not c.leased_granules:
                time.sleep(0.001)
            t.resize_per_segment_(step << 21)
            t.full_view()[(step - 1) << 21 : step << 21] = step
        assert c.requests_sent == sent  # every one of them from the lease
        print(t.num_chunks, flush=True)
        """,
    )
    chunks = int(writer.readline())
    assert writer.wait() == 0 and chunks == 5
    wait_until(lambda: len(systemd.names()) == chunks)
    first.stop()
    second = start_daemon("--budget", "256MiB", "--state-dir", str(state_dir), **systemd.relaunch())
    with second.connect() as client:
        t = ExtensibleTensor.attach("kv", "cpu", client=client)
        assert [int(t.full_view()[(step - 1) * GRANULE]) for step in range(2, 6)] == [2, 3, 4, 5]


@pytest.mark.torch
@pytest.mark.system
def test_a_client_dropped_without_close_ends_its_session(daemon, client):
    dropped = daemon.connect(client_name="dropped")
    ExtensibleTensor(16 * MiB, "cpu", client=dropped, name="kept", persistent=True).resize_(GRANULE)
    leased_at_least(dropped, 2)
    del dropped
    wait_until(lambda: client.status().num_sessions == 1 and client.status().leased_bytes == 0)
    assert [b.session_id for b in client.buffers()] == [0]  # the persistent buffer outlived it, an orphan



def test_a_client_dropped_without_close_leaves_no_descriptor_or_thread_behind(daemon):
    def eventfds() -> int:  # the inbox's, and each ZeroMQ socket's mailbox
        return sum(os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]" for fd in os.listdir("/proc/self/fd")
                   if os.path.exists(f"/proc/self/fd/{fd}"))

    def closers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "hbmd-fd-closer"}

    before = (len(os.listdir("/proc/self/fd")), eventfds())
    others = closers()  # those of clients other tests left to the collector
    dropped = daemon.connect(client_name="dropped", lease=False)
    with dropped.commit(dropped.create_buffer(16 * MiB).buffer_id, 4 * GRANULE):
        pass  # chunks delivered and let go: the FD closer runs
    (closer,) = closers() - others
    del dropped
    gc.collect()
    wait_until(lambda: not closer.is_alive())
    wait_until(lambda: len(os.listdir("/proc/self/fd")) <= before[0] and eventfds() <= before[1])


def test_a_reader_that_finds_its_datagram_taken_does_not_hold_the_socket(daemon, monkeypatch):
    """The listener thread and a commit read the same socket: the one that finds the datagram gone returns at
    once (a blocking read there held the lock that placements are sent under, for the whole timeout)."""
    client = daemon.connect(lease=False)  # no listener thread of its own
    monkeypatch.setattr(select, "select", lambda r, w, x, timeout: (r, [], []))  # "readable", yet nothing waits
    started = time.monotonic()
    assert client._core.handles.inbox.poll(0.2)
    assert time.monotonic() - started < 1
    monkeypatch.undo()
    client.close()


def test_a_placement_claiming_a_petabyte_is_refused_without_the_daemon_counting_to_it(daemon, client):
    buffer = client.create_buffer(1 << 50)  # a petabyte of address space costs the daemon nothing
    client.commit(buffer.buffer_id, GRANULE).close()
    leased_at_least(client, 1)
    client._core.handles.sock.send(proto.encode_datagram(proto.LeasePlace(buffer.buffer_id, [1 << 50], [1], [GRANULE])))
    started = time.monotonic()
    (info,) = [b for b in client.buffers() if b.buffer_id == buffer.buffer_id]
    assert info.segment_sizes == [GRANULE] and info.physical_bytes == GRANULE
    assert time.monotonic() - started < 5 and daemon.alive()


@pytest.mark.system
def test_a_session_flooding_its_socket_does_not_hold_the_daemon(daemon, client, spawn_worker):
    worker = spawn_worker(
        daemon,
        """
        import sys
        from hbmd import proto
        from hbmd.client import connect
        c = connect("cpu", client_name="flood")
        junk = proto.encode_datagram(proto.LeaseReturn([10**9]))
        print("ready", flush=True)
        c._core.handles.sock.settimeout(None)
        while True:
            c._core.handles.sock.send(junk)
        """,
    )
    assert worker.readline() == "ready"
    for _ in range(50):
        started = time.monotonic()
        client.status()
        assert time.monotonic() - started < 2
    assert "sends datagrams faster than they are read" in daemon.log()
    worker.kill()


@pytest.mark.system
def test_a_closed_client_leaves_no_descriptor_behind(daemon, spawn_worker):
    # Counted in a process of its own: in this one, threads that earlier tests left running open and close
    # descriptors of their own meanwhile.
    worker = spawn_worker(
        daemon,
        """
        import os
        from hbmd.client import ExtensibleTensor, connect
        from hbmd.testing.spawn import wait_until

        def held():
            return len(os.listdir("/proc/self/fd"))

        first = connect("cpu")
        first.status()  # ZeroMQ's own descriptors (one context per process) exist from here on
        before = held()
        for _ in range(3):
            client = connect("cpu")
            t = ExtensibleTensor(32 << 20, "cpu", num_segments=2, client=client)
            t.resize_per_segment_(2 << 20)
            wait_until(lambda: client.leased_granules >= 4)  # imported granules held, and maybe grants still unread
            t.free()
            client.close()
        try:
            wait_until(lambda: held() <= before)
        except TimeoutError:
            pass
        print(before, held(), flush=True)
        """,
    )
    before, after = map(int, worker.readline().split())
    assert after <= before
