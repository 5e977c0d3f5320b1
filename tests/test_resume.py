"""A daemon restart that the engines do not notice: their sessions, buffers and data come back, calls go on.

The daemon runs under the systemd stand-in (its FD store keeps every chunk,
the state directory the journal); it is killed (SIGKILL, a crash) or stopped
(SIGTERM, an upgrade) and a new one started on what the store passes back,
as ``Restart=`` does. The clients never close: they map what they mapped,
and their next call goes to the new daemon.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from hbmd.client import ExtensibleTensor, connect
from hbmd.client.transport import HandleChannel
from hbmd.daemon.restart.takeover import take_over
from hbmd.proto import PROTOCOL_VERSION, CreateBuffer, Hello, Release
from hbmd.proto.errors import PermissionDenied, SessionLost
from hbmd.proto.instance import InstancePaths
from helpers import GpuKvCache, HostEngine, MiB, cuda_vmm_status, filled, torch, wait_until

GPU_OK, GPU_REASON = cuda_vmm_status()

pytestmark = [pytest.mark.ipc, pytest.mark.torch]


def accounts(client):
    """What ``hbmctl status/buffers/sessions`` show, less what moves by itself (time, free memory)."""
    status = client.status()
    sessions = sorted((s.session_id, s.pid, s.tenant, s.committed_bytes, s.num_buffers, s.num_chunks)
                      for s in client.sessions())
    return status.committed_bytes, status.num_chunks, sessions, sorted(map(repr, client.buffers()))


@pytest.mark.parametrize("how", ["kill", "term"])
@pytest.mark.parametrize("lease", [False, True])
@pytest.mark.system
def test_a_restart_keeps_every_session_and_buffer_and_the_next_call_goes_on(restartable, how, lease):
    client = restartable.daemon.connect(client_name="engine", lease=lease)
    engine = HostEngine(client)
    with restartable.daemon.connect(observer=True) as look:
        before = accounts(look)

    daemon = restartable.restart(how)
    assert "restored: 1 sessions (resuming within 30s), 2 buffers" in daemon.log()
    assert engine.intact()  # the engine's memory was never unmapped: it reads and writes on while the daemon is away
    wait_until(lambda: "session 1 resumed" in daemon.log())  # the listener took it back before any call
    with daemon.connect(observer=True) as look:
        assert accounts(look) == before

    engine.grows_on()  # the next call goes to the new daemon as if nothing happened
    assert client.status().committed_bytes == 24 * MiB + 6 * MiB
    engine.free()
    assert client.status().committed_bytes == 0
    client.close()
    wait_until(lambda: "session 1 ended" in daemon.log())


@pytest.mark.system
def test_a_session_whose_client_does_not_come_back_ends_as_a_dead_one(restartable, spawn_worker):
    worker = spawn_worker(restartable.daemon, """
        from hbmd.client import ExtensibleTensor, connect
        c = connect("cpu")
        kv = ExtensibleTensor(32 << 20, "cpu", client=c)
        kv.resize_(8 << 20)
        keep = ExtensibleTensor(8 << 20, "cpu", client=c, name="keep", persistent=True)
        keep.resize_(2 << 20)
        print("ready", flush=True)
        input()
    """)
    assert worker.readline().strip() == "ready"
    # The "keep" commit may be made on credit, its bind read by the daemon just after it returns: a daemon and a
    # client that both die before that lose it, as no one is left to send it again.
    with restartable.daemon.connect(observer=True) as look:
        wait_until(lambda: look.status().committed_bytes == 10 * MiB)
    os.kill(worker.proc.pid, signal.SIGSTOP)  # so that it cannot resume before it dies
    daemon = restartable.restart("kill", "--resume-timeout", "1")
    worker.kill()  # it dies while the daemon is away: nobody will resume its session
    with daemon.connect(observer=True) as look:
        wait_until(lambda: look.status().committed_bytes == 2 * MiB, timeout=5)
        assert [(b.name, b.session_id) for b in look.buffers()] == [("keep", 0)]  # an orphan, attachable by name
    assert "was not resumed after the restart: ended, freed 8.0 MiB" in daemon.log()


@pytest.mark.system
def test_a_client_gives_up_once_the_daemon_is_not_back_within_its_resume_timeout(start_daemon, monkeypatch):
    monkeypatch.setenv("HBMD_RESUME_TIMEOUT", "0.5")
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect(lease=False)
    kv = ExtensibleTensor(8 * MiB, "cpu", client=client)
    kv.resize_(2 * MiB)
    daemon.kill()
    with pytest.raises(SessionLost, match=r"did not come back within 0.5s \(HBMD_RESUME_TIMEOUT\)"):
        kv.resize_(4 * MiB)


@pytest.mark.system
def test_only_the_process_that_opened_a_session_may_resume_it(restartable, spawn_worker):
    worker = spawn_worker(restartable.daemon, """
        from hbmd.client import ExtensibleTensor, connect
        c = connect("cpu")
        kv = ExtensibleTensor(8 << 20, "cpu", client=c)
        kv.resize_(2 << 20)
        print(c.session_id, c._recovery.credential, flush=True)
        input()
        kv.resize_(4 << 20)
        print(c.status().committed_bytes, c._recovery.credential, flush=True)
    """)
    session_id, credential = worker.readline().split()
    os.kill(worker.proc.pid, signal.SIGSTOP)  # so that the thief comes first
    daemon = restartable.restart("kill")
    thief = HandleChannel(InstancePaths.of(daemon.run_dir, daemon.instance), 5)
    with pytest.raises(PermissionDenied, match=f"session {session_id} belongs to another process"):
        thief.handshake(Hello(list(PROTOCOL_VERSION), os.getpid(), resume_session=int(session_id),
                              resume_credential=credential))
    thief.close()
    os.kill(worker.proc.pid, signal.SIGCONT)
    worker.send("")
    committed, new_credential = worker.readline().split()
    assert int(committed) == 4 * MiB  # the session is still its own
    assert new_credential != credential  # and a credential resumes it once


def test_a_request_sent_again_after_a_restart_is_answered_again_not_done_twice(restartable):
    client = restartable.daemon.connect(lease=False)
    control = client._core.control
    client.status()
    # Done and journaled by the daemon that then died: its reply lost, the client sends it again under its id.
    request_id = control.next_request_id()
    created, _ = control.call_with_id(CreateBuffer(8 * MiB, 1), None, request_id)
    restartable.restart("kill")
    assert client.resumed()
    again, _ = control.call_with_id(CreateBuffer(8 * MiB, 1), None, request_id)
    assert again == created
    assert [b.buffer_id for b in client.buffers()] == [created.buffer.buffer_id]
    client.close()


@pytest.mark.system
def test_a_daemon_taken_over_hands_every_session_and_buffer_to_its_successor(start_daemon):
    first = start_daemon("--budget", "256MiB")
    client = first.connect(client_name="engine")
    kv = ExtensibleTensor(64 * MiB, "cpu", num_segments=2, client=client)
    for step in range(1, 5):
        kv.resize_per_segment_(step * 2 * MiB)
    view = kv.full_view()
    view[: 8 * MiB] = 7
    weights = ExtensibleTensor(8 * MiB, "cpu", client=client, name="weights", persistent=True)
    weights.resize_(4 * MiB)
    weights.full_view()[: 4 * MiB] = 5
    weights.seal()
    with first.connect(observer=True) as look:
        before = accounts(look)

    second = start_daemon("--budget", "256MiB", "--takeover")
    assert first.proc.wait(10) == 0  # it stops once its successor serves
    assert "serves in this daemon's place: stopping" in first.log()
    assert "took over from pid" in second.log()
    wait_until(lambda: "session 1 resumed" in second.log())
    with second.connect(observer=True) as look:
        assert accounts(look) == before
    kv.resize_per_segment_(12 * MiB)
    assert filled(view[: 8 * MiB], 7)
    reader = ExtensibleTensor.attach("weights", "cpu", client=second.connect(), readonly=True)
    assert filled(reader.full_view()[: 4 * MiB], 5)
    assert client.status().committed_bytes == 24 * MiB + 4 * MiB


def test_a_daemon_whose_successor_fails_serves_on_and_its_clients_resume_there(start_daemon):
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect(lease=False)
    kv = ExtensibleTensor(16 * MiB, "cpu", client=client)
    kv.resize_(4 * MiB)
    kv.full_view()[: 4 * MiB] = 3
    paths = InstancePaths.of(daemon.run_dir, daemon.instance)
    handover = take_over(paths.takeover, PROTOCOL_VERSION[0], 5)  # a successor that takes all, then fails
    assert handover.fds
    handover.abandon()
    kv.resize_(8 * MiB)  # the old daemon serves on: the session resumed there
    assert filled(kv.full_view()[: 4 * MiB], 3)
    assert client.status().committed_bytes == 8 * MiB
    assert "did not take over: serving on" in daemon.log() and daemon.alive()


def test_takeover_with_nothing_to_take_over_starts_afresh(start_daemon):
    daemon = start_daemon("--takeover")
    assert "starting afresh" in daemon.log()
    with daemon.connect() as client:
        assert client.status().committed_bytes == 0


def test_a_daemon_that_lingers_stays_until_stopped_once_taken_over(start_daemon):
    first = start_daemon("--budget", "64MiB", "--linger")
    second = start_daemon("--budget", "64MiB", "--takeover")
    wait_until(lambda: "lingering until stopped" in first.log())
    assert first.alive()  # a container's restart policy would start it again: it stays, holding nothing
    with second.connect() as client:
        assert client.status().num_sessions == 1
    assert first.stop() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_OK, reason=GPU_REASON)
@pytest.mark.parametrize("how", ["kill", "takeover"])
def test_a_gpu_kv_cache_stays_in_place_and_grows_on_across_a_restart(start_daemon, run_dir, systemd, how):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    args = ("--device", "0", "--budget", "8GiB", "--state-dir", str(state_dir))
    daemon = start_daemon(*args, backend="cuda", env={"NOTIFY_SOCKET": str(systemd.path)})
    torch.cuda.init()
    client = connect("cuda:0", run_dir=run_dir, client_name="gpu-engine")
    cache = GpuKvCache(client)
    with daemon.connect(observer=True) as look:
        before = accounts(look)

    if how == "kill":
        daemon.kill()
        daemon = start_daemon(*args, backend="cuda", **systemd.relaunch())
    else:
        old = daemon
        daemon = start_daemon(*args, "--takeover", backend="cuda", env={"NOTIFY_SOCKET": str(systemd.path)})
        assert old.proc.wait(30) == 0
    assert cache.intact()  # the device memory never left this process
    wait_until(lambda: "session 1 resumed" in daemon.log())
    with daemon.connect(observer=True) as look:
        assert accounts(look) == before
    cache.grows_on()
    cache.free()
    assert client.status().committed_bytes == 0
    client.close()


def test_a_client_closed_while_its_daemon_is_away_closes_at_once(start_daemon, caplog):
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect()
    ExtensibleTensor(8 * MiB, "cpu", client=client).resize_(2 * MiB)
    daemon.kill()
    wait_until(lambda: "waits up to" in caplog.text)  # its listener is waiting for the daemon to come back
    started = time.monotonic()
    client.close()
    assert time.monotonic() - started < 1  # not the 30 s of HBMD_RESUME_TIMEOUT


def test_a_request_that_only_reads_costs_the_journal_nothing(restartable, run_dir):
    client = restartable.daemon.connect(lease=False)
    ExtensibleTensor(8 * MiB, "cpu", client=client).resize_(2 * MiB)
    journal = run_dir / "state" / "host.journal"
    size = journal.stat().st_size
    for _ in range(20):  # an engine's status polls: sent again after a restart, they are simply answered anew
        client.status()
        client.sessions()
        client.buffers()
    assert journal.stat().st_size == size


def test_a_request_sent_again_and_again_is_answered_each_time_and_logged_once(daemon):
    with daemon.connect(lease=False) as client:
        buffer = client.create_buffer(8 * MiB, 1)
        request_id = client._core.control.next_request_id()
        answers = [client._core.control.call_with_id(Release(buffer.buffer_id), 5, request_id)[0] for _ in range(30)]
        assert all(answer == answers[0] for answer in answers)  # the one answer, given again
    wait_until(lambda: "again after a restart: answered as before" in daemon.log())
    assert daemon.log().count("again after a restart: answered as before") == 1  # a peer cannot flood the log


def warnings_in(log: str) -> list[str]:
    return [line for line in log.splitlines() if " WARNING " in line]


@pytest.mark.torch
def test_what_a_plain_stop_destroys_is_named_and_a_buffer_left_to_nobody_is_logged(start_daemon, run_dir):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    daemon = start_daemon("--budget", "64MiB", "--state-dir", str(state_dir))  # no service manager: no FD store
    (said,) = warnings_in(daemon.log())
    assert f"--state-dir {state_dir}: no service manager to keep the chunks" in said
    with daemon.connect() as engine:
        kv = ExtensibleTensor(8 * MiB, "cpu", client=engine, name="kv-cache", persistent=True)
        kv.resize_(4 * MiB)
        session = engine.session_id
    wait_until(lambda: "is an orphan" in daemon.log())
    assert f"buffer 1 'kv-cache' of session {session} is an orphan: 4.0 MiB kept until attached again" in daemon.log()
    assert daemon.stop() == 0
    (said,) = warnings_in(daemon.log())[1:]
    assert "stopping with nothing to keep the chunks" in said
    assert "1 persistent buffers no process maps are lost (4.0 MiB, 0 sealed): 'kv-cache'" in said


@pytest.mark.torch
def test_a_stop_that_destroys_nothing_kept_warns_of_nothing(start_daemon):
    daemon = start_daemon("--budget", "64MiB")
    with daemon.connect() as engine:
        ExtensibleTensor(8 * MiB, "cpu", client=engine).resize_(4 * MiB)
        assert daemon.stop() == 0
    assert warnings_in(daemon.log()) == []
