"""hbmctl as operators run it: a subprocess, its output and its exit codes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hbmd.client import ExtensibleTensor, PermissionDenied
from helpers import MiB, hbmctl

pytestmark = pytest.mark.cli


def test_json_numbers_match_what_clients_committed(daemon, spawn_worker):
    worker = spawn_worker(
        daemon,
        """
        import sys
        from hbmd.client import ExtensibleTensor, connect
        c = connect("cpu", client_name="engine-a")
        k = ExtensibleTensor(64 << 20, "cpu", num_segments=2, client=c, name="kv")
        k.resize_per_segment_(5 << 20)
        s = ExtensibleTensor(16 << 20, "cpu", client=c)
        s.resize_(3 << 20)
        print(c.session_id, flush=True)
        sys.stdin.readline()
        """,
    )
    session_id = int(worker.readline())
    rd = str(daemon.run_dir)

    status = json.loads(hbmctl("--run-dir", rd, "--json", "status").stdout)
    # 5 MiB per segment rounds to 6 MiB per segment; 3 MiB rounds to 4 MiB.
    assert status["committed_bytes"] == 16 * MiB
    assert status["reserved_bytes"] == 80 * MiB
    assert status["budget_bytes"] == 256 * MiB and status["free_bytes"] == 240 * MiB
    assert status["num_sessions"] == 1 and status["num_buffers"] == 2 and status["num_chunks"] == 3
    assert status["backend"] == "host" and status["instance"] == "host" and status["pid"] == daemon.pid

    sessions = json.loads(hbmctl("--run-dir", rd, "sessions", "--json").stdout)["sessions"]
    assert [(s["session_id"], s["client_name"], s["committed_bytes"], s["num_buffers"]) for s in sessions] == [
        (session_id, "engine-a", 16 * MiB, 2)
    ]

    buffers = json.loads(hbmctl("--run-dir", rd, "--json", "buffers", "--session", str(session_id)).stdout)["buffers"]
    by_name = {b["name"]: b for b in buffers}
    assert by_name["kv"]["bytes_per_segment"] == 5 * MiB and by_name["kv"]["physical_bytes"] == 12 * MiB
    assert by_name["kv"]["num_segments"] == 2 and by_name["kv"]["num_chunks"] == 2
    assert by_name[""]["physical_bytes"] == 4 * MiB
    worker.send("done")
    assert worker.wait() == 0


def test_tables_use_binary_units(daemon, client):
    t = ExtensibleTensor(64 * MiB, "cpu", client=client)
    t.resize_(10 * MiB)
    rd = str(daemon.run_dir)
    status = hbmctl("--run-dir", rd, "status")
    assert status.returncode == 0
    assert "committed: 10.0 MiB" in status.stdout and "budget:    256.0 MiB" in status.stdout
    buffers = hbmctl("--run-dir", rd, "buffers").stdout.splitlines()
    assert buffers[0].split()[:3] == ["BUFFER", "SESSION", "NAME"]
    assert "10.0 MiB" in buffers[1]
    sessions = hbmctl("--run-dir", rd, "sessions").stdout
    assert "SESSION" in sessions and "test" in sessions


def test_instance_is_chosen_by_name_too(daemon):
    out = hbmctl("--run-dir", str(daemon.run_dir), "--instance", "host", "--json", "status")
    assert out.returncode == 0 and json.loads(out.stdout)["instance"] == "host"


def test_unreachable_daemon_exits_1_with_a_message(run_dir):
    out = hbmctl("--run-dir", str(run_dir), "status")
    assert out.returncode == 1 and "no hbmd instance" in out.stderr and out.stdout == ""
    out = hbmctl("--run-dir", str(run_dir), "--instance", "gpu3", "status")
    assert out.returncode == 1 and "handles.sock" in out.stderr


def test_a_silent_daemon_exits_1_within_the_timeout(daemon):
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        out = hbmctl("--run-dir", str(daemon.run_dir), "--timeout", "1", "status", timeout=30)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert out.returncode == 1 and "hbmctl:" in out.stderr


def test_usage_errors_exit_2(daemon):
    assert hbmctl("--run-dir", str(daemon.run_dir), "frobnicate").returncode == 2
    assert hbmctl("--run-dir", str(daemon.run_dir), "buffers", "--session", "x").returncode == 2
    assert hbmctl().returncode == 2


def test_a_refused_request_exits_3(daemon):
    rd = str(daemon.run_dir)
    out = hbmctl("--run-dir", rd, "buffers", "--session", "999")
    assert out.returncode == 3 and "no session 999" in out.stderr
    out = hbmctl("--run-dir", rd, "buffers", "--session", str(2**70))
    assert out.returncode == 3 and "cannot be encoded" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("command", ["status", "sessions", "buffers", "delete", "reclaim", "watch"])
def test_every_subcommand_has_help_with_an_example(command):
    out = hbmctl(command, "--help")
    assert out.returncode == 0 and "example: hbmctl" in out.stdout


def test_hbmctl_is_an_observer_it_is_neither_counted_nor_listed(daemon, client):
    rd = str(daemon.run_dir)
    assert json.loads(hbmctl("--run-dir", rd, "--json", "status").stdout)["num_sessions"] == 1  # only `client`
    sessions = json.loads(hbmctl("--run-dir", rd, "--json", "sessions").stdout)["sessions"]
    assert [s["session_id"] for s in sessions] == [client.session_id]
    observer = daemon.connect(observer=True)
    with pytest.raises(PermissionDenied, match="observer"):
        ExtensibleTensor(4 * MiB, "cpu", client=observer)
    assert client.status().num_sessions == 1
    observer.close()


def test_watch_refreshes_until_ctrl_c(daemon, client):
    ExtensibleTensor(16 * MiB, "cpu", client=client).resize_(6 * MiB)
    watch = subprocess.Popen(
        [sys.executable, "-m", "hbmd.client.ctl", "--run-dir", str(daemon.run_dir), "watch", "--interval", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        time.sleep(3)  # start-up plus several 0.1 s refreshes, even on a loaded machine
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=30)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0, err
    assert out.count("● hbmd instance host") >= 2 and "committed: 6.0 MiB" in out and "Ctrl-C" in out
