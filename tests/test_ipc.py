"""End to end on the host backend: a real daemon subprocess, real sockets, real memory."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from hbmd import proto
from hbmd.client import (
    DaemonUnavailable,
    ExtensibleKVCacheBuffers,
    ExtensibleTensor,
    ForkedClient,
    OutOfBudget,
    PermissionDenied,
    VersionMismatch,
    connect,
)
from hbmd.client.transport import ControlChannel
from hbmd.proto.instance import InstancePaths
from helpers import GRANULE, MiB, chunks_held, filled, torch, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]


def test_first_log_line_names_backend_instance_and_sockets(daemon):
    first = daemon.log().splitlines()[0]
    paths = InstancePaths.of(daemon.run_dir, "host")
    assert "backend host" in first and "instance host" in first
    assert paths.endpoint in first and str(paths.handles) in first


def test_sigterm_exits_zero_and_removes_the_sockets(daemon):
    paths = InstancePaths.of(daemon.run_dir, "host")
    assert paths.control.exists() and paths.handles.exists()
    assert daemon.stop() == 0
    assert not paths.control.exists() and not paths.handles.exists() and not paths.info.exists()


def test_a_second_daemon_on_the_same_instance_refuses_to_start(daemon):
    out = subprocess.run(
        [sys.executable, "-m", "hbmd.daemon", "--backend", "host", "--run-dir", str(daemon.run_dir)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1
    assert "already serving" in out.stderr and "Traceback" not in out.stderr
    assert daemon.alive()


def test_growth_keeps_bytes_and_the_base_pointer(client):
    t = ExtensibleTensor(64 * MiB, "cpu", client=client)
    view = t.full_view()
    base = view.data_ptr()
    assert base == t.base_ptr and view.dtype == torch.uint8 and view.numel() == 64 * MiB
    t.resize_(3 * MiB)
    pattern = torch.arange(3 * MiB, dtype=torch.int64).remainder(251).to(torch.uint8)
    view[: 3 * MiB] = pattern
    t.resize_(40 * MiB)
    assert t.full_view().data_ptr() == base
    assert torch.equal(view[: 3 * MiB], pattern)
    view[39 * MiB : 40 * MiB] = 5
    assert t.num_bytes == 40 * MiB and t.physical_bytes == 40 * MiB
    assert t.tensor.numel() == 40 * MiB and t.tensor.data_ptr() == base


def test_segments_grow_in_lockstep_and_keep_their_data(client):
    t = ExtensibleTensor(64 * MiB, "cpu", num_segments=2, client=client)
    view = t.full_view()
    t.resize_per_segment_(MiB)
    view[:MiB] = 1
    view[32 * MiB : 33 * MiB] = 2
    t.resize_per_segment_(10 * MiB, zero_new=True)
    assert t.bytes_per_segment == 10 * MiB and t.num_bytes == 20 * MiB
    assert int(view[:MiB].sum()) == MiB and int(view[32 * MiB : 33 * MiB].sum()) == 2 * MiB
    assert int(view[MiB : 10 * MiB].sum()) == 0 and int(view[33 * MiB : 42 * MiB].sum()) == 0
    (info,) = client.buffers(client.session_id)
    assert info.bytes_per_segment == 10 * MiB and info.physical_bytes == 20 * MiB and info.num_chunks == 4


def test_a_granule_straddling_two_segments_is_mapped_once_and_shared(client):
    # Two 3 MiB segments: the granule [2, 4) MiB holds the tail of one and the head of the other.
    t = ExtensibleTensor(6 * MiB, "cpu", num_segments=2, client=client)
    view = t.full_view()
    t.resize_per_segment_(MiB)
    view[3 * MiB : 4 * MiB] = 3
    t.resize_per_segment_(3 * MiB, zero_new=False)
    view[: 3 * MiB] = 1
    assert filled(view[3 * MiB : 4 * MiB], 3)
    assert t.physical_bytes == 6 * MiB and t.num_chunks == 2


def test_zero_new_zeroes_the_newly_committed_bytes_of_a_reused_granule(client):
    t = ExtensibleTensor(8 * MiB, "cpu", client=client)
    view = t.full_view()
    t.resize_(MiB)
    # Bytes past the committed prefix but inside the backed granule: dirty them, then grow with zero_new.
    view[: 2 * MiB] = 9
    t.resize_(2 * MiB, zero_new=True)
    assert filled(view[:MiB], 9) and int(view[MiB : 2 * MiB].sum()) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_num_bytes=-1), "non-negative"),
        (dict(max_num_bytes=0), "positive"),
        (dict(max_num_bytes=MiB, num_segments=0), "num_segments"),
        (dict(max_num_bytes=MiB, num_segments=-1), "num_segments"),
        (dict(max_num_bytes=MiB + 1, num_segments=2), "divisible"),
        (dict(max_num_bytes=MiB, device="meta"), "unsupported device"),
        (dict(max_num_bytes=MiB, device="cuda:x"), "unsupported device"),
    ],
)
def test_constructor_value_errors(client, kwargs, match):
    kwargs.setdefault("device", "cpu")
    with pytest.raises(ValueError, match=match):
        ExtensibleTensor(client=client, **kwargs)
    assert client.buffers(client.session_id) == []


def test_a_cuda_tensor_on_the_host_instance_is_a_value_error(client):
    with pytest.raises(ValueError, match="cannot be served"):
        ExtensibleTensor(MiB, "cuda:0", client=client)


def test_resize_value_errors_change_nothing(client):
    t = ExtensibleTensor(16 * MiB, "cpu", num_segments=2, client=client)
    t.resize_per_segment_(2 * MiB)
    with pytest.raises(ValueError, match="grow-only"):
        t.resize_per_segment_(MiB)
    with pytest.raises(ValueError, match=r"8.0 MiB \(8388609 B\) per segment exceeds the segment capacity 8.0 MiB\."):
        t.resize_per_segment_(8 * MiB + 1)
    for op in (lambda: t.resize_(4 * MiB), lambda: t.tensor, lambda: t.append(MiB)):
        with pytest.raises(ValueError, match="single-segment"):
            op()
    t.resize_per_segment_(2 * MiB)  # same size: a no-op
    assert t.bytes_per_segment == 2 * MiB and t.physical_bytes == 4 * MiB
    assert client.status().committed_bytes == 4 * MiB


def test_append_grows_and_returns_the_new_bytes(client):
    t = ExtensibleTensor(8 * MiB, "cpu", client=client)
    first = t.append(MiB, zero_new=True)
    second = t.append(MiB, zero_new=True)
    assert first.data_ptr() == t.base_ptr and second.data_ptr() == t.base_ptr + MiB
    assert t.num_bytes == 2 * MiB


def test_release_physical_then_recommit_through_kv_buffers(client):
    k = ExtensibleTensor(32 * MiB, "cpu", num_segments=2, client=client)
    v = ExtensibleTensor(16 * MiB, "cpu", client=client)
    kv = ExtensibleKVCacheBuffers([(k, MiB), (v, MiB)], num_blocks_capacity=16)
    assert kv.num_blocks_committed == 0 and kv.physical_bytes == 0
    kv.commit(4)
    kv.commit(2)  # smaller: ignored
    assert kv.num_blocks_committed == 4 and kv.physical_bytes == 12 * MiB
    k.full_view()[: 4 * MiB] = 7
    base = k.full_view().data_ptr()
    kv.release_physical()
    assert kv.physical_bytes == 0 and client.status().committed_bytes == 0
    kv.recommit()
    assert kv.num_blocks_committed == 4 and client.status().committed_bytes == 12 * MiB
    assert k.full_view().data_ptr() == base and int(k.full_view()[: 4 * MiB].sum()) == 0
    kv.free()
    kv.free()
    assert client.status().num_buffers == 0


def test_a_tensor_recommits_the_sizes_it_held_before_its_release_zeroed(client):
    t = ExtensibleTensor(32 * MiB, "cpu", segment_capacities=[8 * MiB, 24 * MiB], client=client)
    t.resize_segments_([2 * MiB, 6 * MiB])
    t.segment_view(0)[:] = 7
    t.segment_view(1)[:] = 7
    base = t.base_ptr
    t.release_physical()
    t.release_physical()  # a second sleep forgets nothing
    assert t.segment_sizes == [0, 0] and client.status().committed_bytes == 0
    t.recommit()
    assert t.segment_sizes == [2 * MiB, 6 * MiB] and client.status().committed_bytes == 8 * MiB
    assert t.base_ptr == base and int(t.segment_view(0).sum()) == 0 and int(t.segment_view(1).sum()) == 0
    t.recommit()  # nothing released since: a no-op
    assert t.segment_sizes == [2 * MiB, 6 * MiB]
    t.release_physical()
    t.resize_segments_([4 * MiB, 0])  # grown while asleep: recommit does not shrink it
    t.recommit()
    assert t.segment_sizes == [4 * MiB, 6 * MiB]


@pytest.mark.system
def test_a_recommit_refused_for_budget_can_be_tried_again(client):
    t = ExtensibleTensor(192 * MiB, "cpu", client=client)
    t.resize_(128 * MiB)
    t.release_physical()
    other = ExtensibleTensor(192 * MiB, "cpu", client=client)
    other.resize_(192 * MiB)  # the daemon's 256 MiB budget leaves 64 MiB
    with pytest.raises(OutOfBudget):
        t.recommit()
    assert t.segment_sizes == [0]
    other.free()
    t.recommit()
    assert t.segment_sizes == [128 * MiB]


def test_kv_buffers_refuse_more_blocks_than_capacity(client):
    t = ExtensibleTensor(8 * MiB, "cpu", client=client)
    with pytest.raises(ValueError):
        ExtensibleKVCacheBuffers([(t, MiB)], num_blocks_capacity=9)
    kv = ExtensibleKVCacheBuffers([(t, MiB)], num_blocks_capacity=8)
    with pytest.raises(ValueError):
        kv.commit(9)


def test_free_is_idempotent_and_returns_everything(client):
    t = ExtensibleTensor(8 * MiB, "cpu", client=client)
    t.resize_(4 * MiB)
    t.free()
    t.free()
    status = client.status()
    assert status.committed_bytes == 0 and status.num_buffers == 0
    with pytest.raises(ValueError, match="freed"):
        t.resize_(6 * MiB)


def test_budget_refusal_is_whole_and_clear(client):
    t = ExtensibleTensor(512 * MiB, "cpu", client=client)
    t.resize_(200 * MiB)
    with pytest.raises(OutOfBudget, match="budget") as info:
        t.resize_(300 * MiB)
    assert info.value.details == {"budget": 256 * MiB, "used": 200 * MiB, "requested": 100 * MiB, "held": 0}
    assert t.num_bytes == 200 * MiB and client.status().committed_bytes == 200 * MiB
    t.resize_(256 * MiB)


WORKER = """
import os, sys, torch
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu", client_name="worker")
t = ExtensibleTensor(64 << 20, "cpu", num_segments=2, client=c)
t.resize_per_segment_(int(sys.argv[1]) << 20 if len(sys.argv) > 1 else 6 << 20)
t.full_view()[:1 << 20] = 42
print(os.getpid(), t.physical_bytes, flush=True)
sys.stdin.readline()
print(t.full_view()[:1 << 20].unique().tolist(), flush=True)
"""


@pytest.mark.system
def test_several_worker_processes_share_one_daemon(daemon, client, spawn_worker):
    workers = [spawn_worker(daemon, WORKER) for _ in range(3)]
    held = [int(w.readline().split()[1]) for w in workers]
    assert held == [12 * MiB] * 3
    assert client.status().committed_bytes == 36 * MiB
    assert len([s for s in client.sessions() if s.client_name == "worker"]) == 3
    for w in workers:
        w.send("go")
        assert w.readline() == "[42]"
        assert w.wait() == 0
    wait_until(lambda: client.status().committed_bytes == 0)


@pytest.mark.system
def test_a_sigkilled_worker_returns_its_memory_at_once(daemon, client, spawn_worker):
    client.status()  # our own control connection is accepted asynchronously: settle it first
    fds_before = daemon.open_fds()
    worker = spawn_worker(daemon, WORKER)
    pid = int(worker.readline().split()[0])
    assert client.status().committed_bytes == 12 * MiB
    os.kill(pid, signal.SIGKILL)
    worker.wait()
    wait_until(lambda: client.status().committed_bytes == 0, timeout=5)
    status = client.status()
    assert status.num_buffers == 0 and status.num_sessions == 1
    assert all(s.pid != pid for s in client.sessions())
    assert daemon.open_fds() == fds_before
    assert daemon.alive()


@pytest.mark.system
def test_many_chunks_cost_the_daemon_one_file_descriptor_each_and_no_more(start_daemon):
    # 1,500 chunks in one commit: more than the default soft RLIMIT_NOFILE of 1,024 and six FD batches.
    daemon = start_daemon("--budget", "4GiB")
    client = daemon.connect()
    client.status()
    fds_before = daemon.open_fds()
    own_chunks = chunks_held()
    t = ExtensibleTensor(1500 * 4 * MiB, "cpu", num_segments=1500, client=client)
    t.resize_per_segment_(GRANULE)
    assert t.num_chunks == 1500 and client.status().num_chunks == 1500
    assert daemon.open_fds() == fds_before + 1500  # each chunk's sealed memfd; the exported copies are closed
    wait_until(lambda: chunks_held() <= own_chunks)  # every received FD is closed after mapping
    view = t.full_view()
    view[1499 * 4 * MiB] = 1
    t.free()
    assert daemon.open_fds() == fds_before
    client.close()


def status_while_stopped(daemon, client, match: str) -> tuple[float, float]:
    """Ask ``client`` for a status while its daemon is stopped, which must fail with ``DaemonUnavailable`` matching
    ``match``; the seconds it took, on the clock and on this thread's CPU."""
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        wall, cpu = time.monotonic(), time.thread_time()
        with pytest.raises(DaemonUnavailable, match=match):
            client.status()
        return time.monotonic() - wall, time.thread_time() - cpu
    finally:
        os.kill(daemon.pid, signal.SIGCONT)


@pytest.mark.system
def test_a_call_on_a_stopped_daemon_fails_within_its_timeout_naming_the_socket(daemon):
    client = daemon.connect(timeout=1.0)
    wall, _ = status_while_stopped(daemon, client, "control.sock")
    assert wall < 3
    assert client.status().num_sessions == 1  # the rebuilt socket works again


@pytest.mark.system
def test_a_call_polls_for_its_reply_then_sleeps_within_its_timeout(daemon, monkeypatch):
    monkeypatch.setenv("HBMD_SPIN_US", "50000")
    client = daemon.connect(timeout=1.0)
    assert client.status().num_sessions == 1  # answered while it polled
    wall, cpu = status_while_stopped(daemon, client, "control.sock")
    # 50 ms of polling at most, then asleep for the rest of the second: a call that polled throughout would have
    # spent the whole second on the CPU.
    assert 1.0 <= wall < 3 and cpu < 0.5
    assert client.status().num_sessions == 1


@pytest.mark.system
def test_a_call_polling_longer_than_its_timeout_still_ends_at_the_timeout(daemon, monkeypatch):
    monkeypatch.setenv("HBMD_SPIN_US", str(60 * 10**6))
    client = daemon.connect(timeout=0.5)
    wall, _ = status_while_stopped(daemon, client, "within 0.5s")
    assert wall < 2


@pytest.mark.parametrize("value", ["soon", "-1", "inf"])
@pytest.mark.system
def test_a_bad_hbmd_spin_us_is_a_value_error_naming_it(daemon, monkeypatch, value):
    monkeypatch.setenv("HBMD_SPIN_US", value)
    with pytest.raises(ValueError, match=rf"HBMD_SPIN_US='{value}' is not a number of microseconds, 0 or more"):
        daemon.connect()
    monkeypatch.delenv("HBMD_SPIN_US")
    assert daemon.connect().status().num_sessions == 1  # refused before it connected: no session was opened


def test_connecting_where_no_daemon_runs_names_the_socket(run_dir):
    with pytest.raises(DaemonUnavailable, match=r"handles\.sock"):
        connect("cpu", run_dir=run_dir, timeout=1.0)


@pytest.mark.system
def test_a_dead_daemon_is_reported_not_hung(daemon):
    client = daemon.connect(timeout=1.0, resume_timeout=1.0)
    daemon.kill()
    started = time.monotonic()
    with pytest.raises(DaemonUnavailable, match=r"did not come back within 1s \(HBMD_RESUME_TIMEOUT\)"):
        client.status()
    assert time.monotonic() - started < 2.5


def test_the_client_refuses_use_after_fork(client):
    pid = os.fork()
    if pid == 0:
        try:
            client.status()
        except ForkedClient:
            os._exit(0)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.status().num_sessions == 1


def test_a_forked_child_growing_its_parents_tensor_from_the_lease_is_told_it_is_forked(client):
    kv = ExtensibleTensor(32 * MiB, "cpu", client=client)
    kv.resize_(GRANULE)  # through the daemon: the lease grows from this demand
    wait_until(lambda: client.leased_granules >= 2)
    pid = os.fork()
    if pid == 0:
        try:
            kv.resize_(2 * GRANULE)  # a granule the lease holds: no request, the placement goes on the handle socket
        except ForkedClient:
            os._exit(0)
        except BaseException:
            os._exit(2)
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    kv.resize_(2 * GRANULE)  # the parent's session and lease are as they were
    assert [b.segment_sizes for b in client.buffers()] == [[2 * GRANULE]]


def test_a_forged_token_is_refused(daemon, client):
    paths = InstancePaths.of(daemon.run_dir, "host")
    forged = ControlChannel(paths, "0" * 32, timeout=5)
    try:
        with pytest.raises(PermissionDenied):
            forged.call(proto.Status())
    finally:
        forged.close()


def test_a_different_major_version_is_refused(daemon):
    paths = InstancePaths.of(daemon.run_dir, "host")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5)
    sock.connect(str(paths.handles))
    sock.send(proto.encode_datagram(proto.Hello([99, 0], os.getpid())))
    reply = proto.decode_datagram(sock.recv(65536))
    assert isinstance(reply, proto.Refused) and reply.code == VersionMismatch.code.wire
    assert sock.recv(65536) == b""  # and the connection is closed
    sock.close()
    assert daemon.alive()


@pytest.mark.system
def test_a_session_that_never_says_hello_is_dropped(daemon):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(str(InstancePaths.of(daemon.run_dir, "host").handles))
    assert sock.recv(65536) == b""
    sock.close()


def test_the_chunk_fds_a_client_receives_are_not_inherited_by_what_it_spawns(client):
    buffer = client.create_buffer(8 * MiB, 2)
    with client.commit(buffer.buffer_id, 2 * MiB) as delivery:
        flags = [fcntl.fcntl(fd, fcntl.F_GETFD) for _, fd in delivery]
    assert len(flags) == 2 and all(f & fcntl.FD_CLOEXEC for f in flags)
