"""Credit on a real daemon: a client commits in chunks it makes itself, with no round trip; the daemon checks every
such chunk, keeps it past the client and across a restart, takes the credit back under pressure, and refuses a
chunk that is not what it claims, unchanged and without a leaked descriptor."""

from __future__ import annotations

import collections
import ctypes
import fcntl
import os
import signal
import socket
import sys
import threading

import pytest
from hbmd import memfd, proto
from hbmd.client import ExtensibleTensor, OutOfBudget
from hbmd.client.host import HostMapper
from hbmd.client.lease import Credit
from hbmd.client.recovery import MAX_KEPT_FDS
from helpers import GRANULE, MiB, chunks_held, credited, daemon_view, wait_until

pytestmark = pytest.mark.ipc


@pytest.mark.torch
@pytest.mark.system
def test_a_commit_on_credit_costs_no_round_trip_and_the_daemon_records_it(start_daemon):
    daemon = start_daemon("--budget", "2GiB")
    with daemon.connect() as client:
        assert client.welcome.credit_bytes == 16 << 30
        t = ExtensibleTensor(1 << 30, "cpu", client=client)
        credited(client, t, 64 * MiB, 128 * MiB)
        assert client.status().leased_bytes == 128 * MiB  # charged from the grant on
        t.full_view()[: 64 * MiB].fill_(1)
        sent = client.requests_sent
        t.resize_(192 * MiB, zero_new=True)
        assert client.requests_sent == sent
        assert int(t.full_view()[64 * MiB : 192 * MiB].sum()) == 0 and int(t.full_view()[64 * MiB - 1]) == 1
        info = daemon_view(client, t)
        assert info.segment_sizes == [192 * MiB] and info.physical_bytes == 192 * MiB and info.num_chunks == 2
        assert t.num_chunks == 2
        status = client.status()
        assert status.committed_bytes == 192 * MiB
        # The spent credit is granted again, up to twice the last commit the daemon made.
        wait_until(lambda: client.status().leased_bytes == 128 * MiB)


@pytest.mark.torch
def test_a_daemon_without_credit_serves_every_larger_commit_itself(start_daemon):
    daemon = start_daemon("--budget", "1GiB", "--credit", "0")
    with daemon.connect() as client:
        assert client.welcome.credit_bytes == 0
        t = ExtensibleTensor(512 * MiB, "cpu", client=client)
        t.resize_(64 * MiB)
        sent = client.requests_sent
        t.resize_(128 * MiB)
        assert client.requests_sent == sent + 1 and client.status().leased_bytes == 0


GROWS_ON_CREDIT = """\
import ctypes, os, signal, time
from hbmd.client import ExtensibleTensor, connect
c = connect("cpu")
t = ExtensibleTensor(256 << 20, "cpu", client=c, name="kv", persistent=True)
t.resize_(8 << 20)
while not c.leasing.credit_covers(16 << 20):
    time.sleep(0.001)
sent = c.requests_sent
t.resize_(24 << 20)
ctypes.memset(t.base_ptr + (8 << 20), {fill}, 16 << 20)
assert c.requests_sent == sent
"""
"""A worker that grows a persistent buffer "kv" on credit from 8 to 24 MiB, with no round trip, and fills what it
gained with ``fill``; what it does next is added after."""


@pytest.mark.torch
@pytest.mark.system
def test_chunks_made_on_credit_outlive_their_maker(start_daemon, spawn_worker):
    """The bind and its FDs are in the daemon's socket before the commit returns: a SIGKILL right after loses none."""
    daemon = start_daemon("--budget", "1GiB")
    worker = spawn_worker(daemon, GROWS_ON_CREDIT.format(fill=7) + "os.kill(os.getpid(), signal.SIGKILL)\n")
    worker.wait()
    with daemon.connect() as client:
        wait_until(lambda: client.status().num_sessions == 1)
        t = ExtensibleTensor.attach("kv", "cpu", client=client)
        assert t.num_bytes == 24 * MiB
        assert set(ctypes.string_at(t.base_ptr + 8 * MiB, 16 * MiB)) == {7}
        assert client.status().leased_bytes == 0  # the dead session's credit went with it


@pytest.mark.torch
@pytest.mark.system
def test_chunks_made_on_credit_are_parked_across_a_restart(start_daemon, spawn_worker, run_dir, systemd):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    env = {"NOTIFY_SOCKET": str(systemd.path)}
    first = start_daemon("--budget", "1GiB", "--state-dir", str(state_dir), env=env)
    wait_until(lambda: systemd.saw("READY=1"))
    writer = spawn_worker(first, GROWS_ON_CREDIT.format(fill=5) + "print(t.num_chunks, flush=True)\n")
    chunks = int(writer.readline())
    assert writer.wait() == 0 and chunks == 2
    wait_until(lambda: len(systemd.names()) == chunks)
    first.stop()
    second = start_daemon("--budget", "1GiB", "--state-dir", str(state_dir), **systemd.relaunch())
    with second.connect() as client:
        t = ExtensibleTensor.attach("kv", "cpu", client=client)
        assert t.num_bytes == 24 * MiB and set(ctypes.string_at(t.base_ptr + 8 * MiB, 16 * MiB)) == {5}


@pytest.mark.torch
@pytest.mark.system
def test_a_bind_the_daemon_never_read_is_sent_again_to_its_successor(start_daemon, run_dir, systemd):
    """The daemon is stopped while the client grows on credit, then killed: the bind and its FDs die unread in its
    socket. The successor restores the journaled credit, and the resumed client sends the bind again."""
    state_dir = run_dir / "state"
    state_dir.mkdir()
    args = ("--budget", "256MiB", "--state-dir", str(state_dir))
    first = start_daemon(*args, env={"NOTIFY_SOCKET": str(systemd.path)})
    wait_until(lambda: systemd.saw("READY=1"))
    client = first.connect()
    t = ExtensibleTensor(64 * MiB, "cpu", client=client, name="kv", persistent=True)
    credited(client, t, 8 * MiB, 16 * MiB)
    os.kill(first.pid, signal.SIGSTOP)
    sent = client.requests_sent
    t.resize_(24 * MiB)
    ctypes.memset(t.base_ptr + 8 * MiB, 9, 16 * MiB)
    assert client.requests_sent == sent
    first.kill()
    second = start_daemon(*args, **systemd.relaunch())
    info = daemon_view(client, t)  # this call resumes the session, and the bind goes first
    assert info.segment_sizes == [24 * MiB] and info.physical_bytes == 24 * MiB and info.num_chunks == 2
    client.close()
    with second.connect() as reader:
        again = ExtensibleTensor.attach("kv", "cpu", client=reader)
        assert set(ctypes.string_at(again.base_ptr + 8 * MiB, 16 * MiB)) == {9}


ONE_DATAGRAM_PER_TURN = (
    "import importlib, sys; from hbmd.daemon.main import main; "
    "importlib.import_module('hbmd.daemon.server.handles').WORK_PER_TURN_S = 1e-9; sys.exit(main(sys.argv[1:]))"
)
"""The daemon with each session's share of a turn's work so small that it reads one datagram per turn."""


@pytest.mark.torch
@pytest.mark.system
def test_a_request_waits_for_the_binds_its_client_sent_before_it(start_daemon):
    """Binds queue up while the daemon is stopped, and a commit the credit cannot cover follows them. The daemon
    reads one datagram per turn, so the commit arrives with binds still unread: it waits for them, and neither the
    bytes written on credit nor the daemon's record of them are lost."""
    daemon = start_daemon("--budget", "2GiB", command=[sys.executable, "-c", ONE_DATAGRAM_PER_TURN])
    binds, run = 24, 2 * GRANULE  # runs of two granules: the credit's, not the lease's
    with daemon.connect() as client:
        t = ExtensibleTensor(256 * MiB, "cpu", client=client)
        credited(client, t, 64 * MiB, binds * run)
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            sent = client.requests_sent
            for step in range(binds):
                t.resize_(64 * MiB + (step + 1) * run)
                ctypes.memset(t.base_ptr + 64 * MiB + step * run, step + 1, run)
            assert client.requests_sent == sent
            grown = threading.Thread(target=t.resize_, args=(256 * MiB,))  # beyond the credit: through the daemon
            grown.start()
            wait_until(lambda: client.requests_sent == sent + 1)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        grown.join(30)
        assert not grown.is_alive() and t.num_bytes == 256 * MiB
        for step in range(binds):
            assert set(ctypes.string_at(t.base_ptr + 64 * MiB + step * run, run)) == {step + 1}, step
        info = daemon_view(client, t)
        assert info.segment_sizes == [256 * MiB] and info.num_chunks == t.num_chunks == binds + 2


@pytest.mark.torch
@pytest.mark.parametrize("attach_at_once", [False, True], ids=["after-the-session-ends", "at-once"])
@pytest.mark.system
def test_a_worker_killed_with_binds_unread_keeps_what_it_committed(start_daemon, spawn_worker, attach_at_once):
    """A worker grows a persistent buffer in 24 binds while the daemon is stopped, and is killed. The daemon, reading
    one datagram per turn, sees the worker's exit with binds still unread: it reads them all before the session ends,
    and a new process attaches every byte the worker committed, also when its attach comes first (sent while the
    daemon is stopped)."""
    daemon = start_daemon("--budget", "2GiB", command=[sys.executable, "-c", ONE_DATAGRAM_PER_TURN])
    binds, run = 24, 2 * GRANULE
    worker = spawn_worker(
        daemon,
        f"""
        import ctypes, sys, time
        from hbmd.client import ExtensibleTensor, connect
        c = connect("cpu")
        t = ExtensibleTensor(256 << 20, "cpu", client=c, name="kv", persistent=True)
        t.resize_(64 << 20)
        while not c.leasing.credit_covers({binds * run}):
            time.sleep(0.001)
        print("credited", flush=True)
        sys.stdin.readline()
        sent = c.requests_sent
        for step in range({binds}):
            t.resize_((64 << 20) + (step + 1) * {run})
            ctypes.memset(t.base_ptr + (64 << 20) + step * {run}, step + 1, {run})
        print("done" if c.requests_sent == sent else "round trips", flush=True)
        time.sleep(600)
        """,
    )
    assert worker.readline(30).strip() == "credited"
    replacement = daemon.connect()
    attached: list[ExtensibleTensor] = []

    def attach_kv() -> None:
        attached.append(ExtensibleTensor.attach("kv", "cpu", client=replacement))

    attach = threading.Thread(target=attach_kv)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        worker.send("go")
        assert worker.readline(30).strip() == "done"
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(10)
        if attach_at_once:
            attach.start()
            wait_until(lambda: replacement.requests_sent == 1)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    with replacement:
        if attach_at_once:
            attach.join(30)
        else:
            wait_until(lambda: replacement.status().num_sessions == 1)
            attach_kv()
        (t,) = attached
        assert t.num_bytes == 64 * MiB + binds * run and t.num_chunks == binds + 1
        for step in range(binds):
            assert set(ctypes.string_at(t.base_ptr + 64 * MiB + step * run, run)) == {step + 1}, step


@pytest.mark.torch
def test_a_worker_that_only_grows_on_credit_keeps_few_descriptors(start_daemon):
    daemon = start_daemon("--budget", "8GiB")
    with daemon.connect() as client:
        t = ExtensibleTensor(1 << 30, "cpu", client=client)
        credited(client, t, 256 * MiB, 512 * MiB)
        own_chunks = chunks_held()
        sent = client.requests_sent
        for step in range(1, 81):
            t.resize_(256 * MiB + step * 2 * GRANULE)  # a run of two granules: the credit's, not the lease's
            # Those confirmed are closed on the client's closer thread, a moment after the answer that confirmed them.
            wait_until(lambda: chunks_held() <= own_chunks + MAX_KEPT_FDS + 2, timeout=5)
        assert client.requests_sent == sent + 1  # one answer, past MAX_KEPT_FDS, confirmed what was kept
        assert daemon_view(client, t).num_chunks == 81


@pytest.mark.torch
def test_credit_is_asked_back_for_a_commit_that_needs_the_room(start_daemon):
    daemon = start_daemon("--budget", "1GiB")
    with daemon.connect(client_name="holder") as holder, daemon.connect(client_name="needy", lease=False) as needy:
        t = ExtensibleTensor(512 * MiB, "cpu", client=holder)
        credited(holder, t, 64 * MiB, 128 * MiB)
        big = ExtensibleTensor(1 << 30, "cpu", client=needy)
        with pytest.raises(OutOfBudget):
            big.resize_(900 * MiB)  # the holder's 128 MiB of credit stands in the way until it is given back
        wait_until(lambda: needy.status().leased_bytes == 0)
        assert not holder.leasing.credit_covers(GRANULE)
        big.resize_(900 * MiB)
        assert needy.status().committed_bytes == 964 * MiB


class TracingMapper(HostMapper):
    """A host mapper that records which thread made each chunk and which chunks it still holds."""

    def __init__(self) -> None:
        super().__init__(GRANULE)
        self.makers: list[str] = []
        self.held: set[int] = set()
        self.events: list[str] = []

    def make(self, size: int) -> int:
        fd = super().make(size)
        self.makers.append(threading.current_thread().name)
        self.held.add(fd)
        return fd

    def discard(self, prepared: int) -> None:
        self.held.discard(prepared)
        self.events.append("discard")
        super().discard(prepared)


@pytest.mark.torch
@pytest.mark.system
def test_the_listener_makes_the_next_chunk_ahead_and_a_commit_of_its_size_takes_it(start_daemon):
    daemon = start_daemon("--budget", "2GiB")
    mapper = TracingMapper()
    with daemon.connect(mapper=mapper) as client:
        t = ExtensibleTensor(1 << 30, "cpu", client=client)
        credited(client, t, 64 * MiB, 128 * MiB)
        t.resize_(96 * MiB)  # 32 MiB on credit, made by the commit
        wait_until(lambda: mapper.makers[1:] == ["hbmd-listener"])
        assert mapper.makers[0] == threading.current_thread().name
        t.full_view()[: 96 * MiB].fill_(3)
        sent = client.requests_sent
        t.resize_(128 * MiB, zero_new=True)  # takes the chunk made ahead
        assert mapper.makers[1:] in (["hbmd-listener"], ["hbmd-listener"] * 2)  # and made none
        wait_until(lambda: mapper.makers[1:] == ["hbmd-listener"] * 2)  # the next, ahead again
        assert client.requests_sent == sent
        view = t.full_view()
        assert int(view[96 * MiB : 128 * MiB].sum()) == 0 and int(view[: 96 * MiB].sum()) == 3 * 96 * MiB
        view[96 * MiB : 128 * MiB].fill_(5)
        t.resize_(144 * MiB)  # another size: made by the commit, the one made ahead kept for its own
        assert mapper.makers[3] == threading.current_thread().name
        info = daemon_view(client, t)
        assert info.segment_sizes == [144 * MiB] and info.num_chunks == 4 and info.physical_bytes == 144 * MiB
        assert client.status().committed_bytes == 144 * MiB
        other = ExtensibleTensor(32 * MiB, "cpu", client=client, name="reader", shareable=True)
        other.resize_(32 * MiB)
        assert int(t.full_view()[96 * MiB : 128 * MiB].sum()) == 5 * 32 * MiB
    wait_until(lambda: not mapper.held)  # closing lets go of the chunk made ahead


@pytest.mark.torch
@pytest.mark.system
def test_a_chunk_made_ahead_goes_before_its_credit_is_given_back(start_daemon):
    daemon = start_daemon("--budget", "1GiB")
    mapper = TracingMapper()
    with (daemon.connect(client_name="holder", mapper=mapper) as holder,
          daemon.connect(client_name="needy", lease=False) as needy):
        t = ExtensibleTensor(512 * MiB, "cpu", client=holder)
        credited(holder, t, 64 * MiB, 128 * MiB)
        t.resize_(96 * MiB)
        wait_until(lambda: len(mapper.held) == 1)  # made ahead: no mapping holds it
        big = ExtensibleTensor(1 << 30, "cpu", client=needy)
        with pytest.raises(OutOfBudget):
            big.resize_(900 * MiB)  # the holder's credit stands in the way until it is given back
        wait_until(lambda: needy.status().leased_bytes == 0)
        assert not mapper.held
        big.resize_(900 * MiB)
        assert needy.status().committed_bytes == (96 + 900) * MiB


def test_a_chunk_made_ahead_stays_within_the_credit_and_a_return_waits_for_one_being_made():
    """:class:`Credit` alone, with a real host mapper: the datagrams it would send are recorded."""
    mapper = TracingMapper()
    making, made = threading.Event(), threading.Event()
    make = mapper.make

    def slow_make(size: int) -> int:
        making.set()
        made.wait(5)
        return make(size)

    sent: list[proto.Message] = []
    credit = Credit(lambda msg: (mapper.events.append("send"), sent.append(msg)), lambda: mapper)
    credit.serve(collections.deque([proto.CreditGrant(128 * MiB)]))
    assert credit.spend(32 * MiB, lambda: None, ahead=32 * MiB) and credit.bytes == 96 * MiB
    credit.make_spare()
    assert credit.take_spare(16 * MiB) is None and len(mapper.held) == 1
    assert credit.spend(8 * MiB, lambda: None, ahead=8 * MiB) and len(mapper.held) == 1
    credit.make_spare()  # commits of another size now: the one made ahead goes, one of theirs comes
    assert credit.take_spare(32 * MiB) is None and len(mapper.held) == 1
    assert credit.spend(8 * MiB, lambda: None, ahead=32 * MiB)
    credit.make_spare()
    assert credit.take_spare(8 * MiB) is None and len(mapper.held) == 1 and credit.bytes == 80 * MiB
    assert credit.spend(64 * MiB, lambda: None, ahead=64 * MiB) and credit.bytes == 16 * MiB
    assert not mapper.held  # 32 MiB made ahead on 16 MiB of credit: let go of
    credit.make_spare()
    assert not mapper.held  # 64 MiB would not fit either
    credit.serve(collections.deque([proto.CreditGrant(112 * MiB)]))
    mapper.make = slow_make
    maker = threading.Thread(target=credit.make_spare, name="hbmd-listener")
    maker.start()
    assert making.wait(5)
    giver = threading.Thread(target=credit.give_back)
    giver.start()
    giver.join(0.2)
    assert giver.is_alive() and not sent  # the return waits for the chunk being made
    made.set()
    maker.join(5)
    giver.join(5)
    assert sent == [proto.CreditReturn(128 * MiB)] and not mapper.held
    assert mapper.events[-2:] == ["discard", "send"]  # the memory went before the return told the daemon


class Forger:
    """Sends :class:`~hbmd.proto.OwnChunks` as a hostile client would, on a session that holds credit."""

    def __init__(self, daemon, client) -> None:
        self.daemon = daemon
        self.client = client
        self.tensor = ExtensibleTensor(1 << 30, "cpu", client=client)
        credited(client, self.tensor, 32 * MiB, 64 * MiB)

    def send(self, offsets: list[int], chunk_sizes: list[int], fds: list[int], grow_to: int) -> None:
        msg = proto.OwnChunks(self.tensor.buffer_id, [grow_to], offsets, chunk_sizes)
        socket.send_fds(self.client._core.handles.sock, [proto.encode_datagram(msg)], fds)

    def accounts(self) -> tuple:
        status = self.client.status()
        return daemon_view(self.client, self.tensor), status.committed_bytes, status.leased_bytes, status.num_chunks


def sealed_chunk(size: int) -> int:
    return memfd.sealed_memfd(size)


def unsealed_chunk(size: int) -> int:
    fd = os.memfd_create("forged", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    return fd


def read_only_chunk(size: int) -> int:
    fd = sealed_chunk(size)
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(fd)


def a_pipe(size: int) -> int:
    read, write = os.pipe()
    os.close(write)
    return read


@pytest.mark.parametrize(
    "what, make, offsets, sizes, claimed",
    [
        ("a pipe", a_pipe, [32 * MiB], [16 * MiB], 16 * MiB),
        ("a memfd of another size", lambda n: sealed_chunk(n // 2), [32 * MiB], [16 * MiB], 16 * MiB),
        ("an unsealed memfd", unsealed_chunk, [32 * MiB], [16 * MiB], 16 * MiB),
        ("a read-only descriptor", read_only_chunk, [32 * MiB], [16 * MiB], 16 * MiB),
        ("more than the credit", sealed_chunk, [32 * MiB], [256 * MiB], 256 * MiB),
        ("a run in two chunks", sealed_chunk, [32 * MiB, 40 * MiB], [8 * MiB, 8 * MiB], 16 * MiB),
        ("a chunk where the growth needs none", sealed_chunk, [0], [16 * MiB], 16 * MiB),
    ],
)
@pytest.mark.torch
def test_a_bind_the_daemon_cannot_trust_is_refused_and_changes_nothing(start_daemon, what, make, offsets, sizes,
                                                                        claimed):
    daemon = start_daemon("--budget", "2GiB")
    with daemon.connect() as client:
        forger = Forger(daemon, client)
        before, fds_before = forger.accounts(), daemon.open_fds()
        fds = [make(size) for size in sizes]
        try:
            forger.send(offsets, sizes, fds, 32 * MiB + claimed)
        finally:
            for fd in fds:
                os.close(fd)
        assert forger.accounts() == before, what
        assert daemon.open_fds() == fds_before, what
        assert "sent a datagram that was refused" in daemon.log()
        forger.tensor.resize_(96 * MiB)  # the session goes on, and its credit still serves it
        assert daemon_view(client, forger.tensor).physical_bytes == 96 * MiB


@pytest.mark.torch
def test_a_bind_with_more_descriptors_than_allowed_is_dropped_whole(start_daemon):
    daemon = start_daemon("--budget", "2GiB")
    with daemon.connect() as client:
        forger = Forger(daemon, client)
        before, fds_before = forger.accounts(), daemon.open_fds()
        count = proto.MAX_OWN_CHUNKS + 1
        fds = [sealed_chunk(GRANULE) for _ in range(count)]
        try:
            forger.send([32 * MiB + i * GRANULE for i in range(count)], [GRANULE] * count, fds,
                        32 * MiB + count * GRANULE)
        finally:
            for fd in fds:
                os.close(fd)
        assert forger.accounts() == before
        assert daemon.open_fds() == fds_before
        assert "oversized datagram" in daemon.log()


def test_a_sealed_chunk_is_told_apart_from_what_only_looks_like_one():
    fd = sealed_chunk(GRANULE)
    try:
        assert memfd.is_sealed_chunk(fd, GRANULE) and not memfd.is_sealed_chunk(fd, 2 * GRANULE)
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & memfd.SEALS == memfd.SEALS
    finally:
        os.close(fd)
    for make in (unsealed_chunk, read_only_chunk, a_pipe):
        fd = make(GRANULE)
        try:
            assert not memfd.is_sealed_chunk(fd, GRANULE), make.__name__
        finally:
            os.close(fd)


@pytest.mark.torch
@pytest.mark.system
def test_a_takeover_of_a_session_that_committed_on_credit_warns_of_nothing(start_daemon):
    """The client sends its binds the daemon has not confirmed again to the successor, which has them from its
    predecessor: it used to refuse each at WARNING ("the growth needs one chunk per run"), changing nothing."""
    first = start_daemon("--budget", "256MiB")
    client = first.connect()
    t = ExtensibleTensor(64 * MiB, "cpu", client=client, name="kv", persistent=True)
    credited(client, t, 8 * MiB, 16 * MiB)
    sent = client.requests_sent
    t.resize_(24 * MiB)  # on credit: the bind goes with no reply, so the client keeps it to send again
    ctypes.memset(t.base_ptr + 8 * MiB, 4, 16 * MiB)
    assert client.requests_sent == sent
    second = start_daemon("--budget", "256MiB", "--takeover")
    info = daemon_view(client, t)  # this call resumes the session, and the bind goes again first
    assert info.segment_sizes == [24 * MiB] and info.physical_bytes == 24 * MiB and info.num_chunks == 2
    assert set(ctypes.string_at(t.base_ptr + 8 * MiB, 16 * MiB)) == {4}
    assert [line for line in second.log().splitlines() if " WARNING " in line] == []
    assert client.status().committed_bytes == 24 * MiB
    client.close()
