"""hbmctl as operators run it: a subprocess, its output and its exit codes."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from hbmd.client import DaemonUnavailable, ExtensibleTensor, PermissionDenied, connect
from hbmd.client.ctl import Column, Output, render
from helpers import MiB, credited, hbmctl, torch, wait_until

pytestmark = pytest.mark.cli


@pytest.mark.torch
def test_json_numbers_match_what_clients_committed(daemon, spawn_worker):
    worker = spawn_worker(
        daemon,
        """
        import sys
        from hbmd.client import ExtensibleTensor, connect
        c = connect("cpu", client_name="engine-a", lease=False)  # one chunk per commit; leases: test_leases.py
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

    [status] = json.loads(hbmctl("--run-dir", rd, "--json", "status").stdout)["instances"]
    # 5 MiB per segment rounds to 6 MiB per segment; 3 MiB rounds to 4 MiB.
    assert status["committed_bytes"] == 16 * MiB
    assert status["reserved_bytes"] == 80 * MiB
    assert status["budget_bytes"] == 256 * MiB and status["budget_left_bytes"] == 240 * MiB
    assert status["device_free_bytes"] > 0
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


@pytest.mark.torch
def test_tables_use_binary_units(daemon):
    client = daemon.connect(client_name="test", lease=False)  # so that the budget left is 256 - 10 MiB
    t = ExtensibleTensor(64 * MiB, "cpu", client=client)
    t.resize_(10 * MiB)
    rd = str(daemon.run_dir)
    status = hbmctl("--run-dir", rd, "status")
    assert status.returncode == 0
    assert "committed:   10.0 MiB" in status.stdout and "budget:      256.0 MiB" in status.stdout
    # What the budget still admits and what the device has free are different figures, named apart.
    assert "budget left: 246.0 MiB" in status.stdout and "device free: " in status.stdout
    buffers = hbmctl("--run-dir", rd, "buffers").stdout.splitlines()
    assert buffers[0].split()[:3] == ["BUFFER", "SESSION", "NAME"]
    assert "10.0 MiB" in buffers[1]
    sessions = hbmctl("--run-dir", rd, "sessions").stdout
    assert "SESSION" in sessions and "test" in sessions


def test_instance_is_chosen_by_name_too(daemon):
    out = hbmctl("--run-dir", str(daemon.run_dir), "--instance", "host", "--json", "status")
    assert out.returncode == 0 and json.loads(out.stdout)["instances"][0]["instance"] == "host"


def test_unreachable_daemon_exits_1_with_a_message(run_dir):
    out = hbmctl("--run-dir", str(run_dir), "status")
    assert out.returncode == 1 and "no hbmd instance" in out.stderr and out.stdout == ""
    out = hbmctl("--run-dir", str(run_dir), "--instance", "gpu3", "status")
    assert out.returncode == 1 and "handles.sock" in out.stderr


def test_where_no_daemon_serves_the_message_says_where_the_run_directory_came_from(run_dir, monkeypatch):
    given = hbmctl("--run-dir", str(run_dir), "status").stderr
    assert f"run directory {run_dir}, as given; choose another with --run-dir" in given
    monkeypatch.setenv("HBMD_RUN_DIR", str(run_dir))
    with pytest.raises(DaemonUnavailable, match=rf"run directory {run_dir}, from \$HBMD_RUN_DIR"):
        connect("cpu")
    monkeypatch.delenv("HBMD_RUN_DIR")
    with pytest.raises(DaemonUnavailable, match="run directory /run/hbmd, the default"):
        connect(instance="no-such-instance")


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


@pytest.mark.parametrize(
    "args",
    [
        ["--timeout", "-1", "status"],
        ["--timeout", "nan", "status"],
        ["--timeout", "1e308", "status"],
        ["watch", "--interval", "-1"],
        ["reclaim", "--session", "1", "--bytes", str(10**30)],
        ["reclaim", "--session", "1", "--bytes", "9" * 400],
        ["reclaim", "--session", str(10**30), "--bytes", "1MiB"],
        ["reclaim", "--pid", "1", "--bytes", "1MiB", "--wait", "inf"],
        ["buffers", "--session", "-2"],
    ],
    ids=lambda args: " ".join(args)[:40],
)
def test_a_number_out_of_range_is_a_usage_error_in_one_line(daemon, args):
    out = hbmctl("--run-dir", str(daemon.run_dir), *args)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert ": error: argument --" in out.stderr.splitlines()[-1]


def test_a_refused_request_exits_3(daemon):
    rd = str(daemon.run_dir)
    out = hbmctl("--run-dir", rd, "buffers", "--session", "999")
    assert out.returncode == 3 and "no session 999" in out.stderr


@pytest.mark.parametrize("command", ["status", "sessions", "buffers", "delete", "reclaim", "watch"])
def test_every_subcommand_has_help_with_an_example(command):
    out = hbmctl(command, "--help")
    assert out.returncode == 0 and "example: hbmctl" in out.stdout


def test_hbmctl_is_an_observer_it_is_neither_counted_nor_listed(daemon, client):
    rd = str(daemon.run_dir)
    [status] = json.loads(hbmctl("--run-dir", rd, "--json", "status").stdout)["instances"]
    assert status["num_sessions"] == 1  # only `client`
    sessions = json.loads(hbmctl("--run-dir", rd, "--json", "sessions").stdout)["sessions"]
    assert [s["session_id"] for s in sessions] == [client.session_id]
    observer = daemon.connect(observer=True)
    with pytest.raises(PermissionDenied, match="observer"):
        ExtensibleTensor(4 * MiB, "cpu", client=observer)
    assert client.status().num_sessions == 1
    observer.close()


def starts_a_frame(line: str) -> bool:
    """Whether ``line`` is the first of a frame of ``hbmctl watch``: a table's header, a JSON line, a csv row."""
    return "Ctrl-C to leave" in line or line.startswith("{") or re.match(r"\d+(\.\d+)?,", line) is not None


def watch_for_a_while(daemon, *args: str) -> tuple[int, str, str]:
    """``hbmctl watch ARGS`` refreshing every 0.1 s, left with Ctrl-C once two frames are whole (a third began):
    its exit status, stdout and stderr."""
    watch = subprocess.Popen(
        [sys.executable, "-m", "hbmd.client.ctl", "--run-dir", str(daemon.run_dir), "watch", *args,
         "--interval", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,  # unbuffered: communicate() reads on from here
    )
    stuck = threading.Timer(60, watch.kill)  # a watch that stops writing ends the readline below
    stuck.start()
    try:
        lines: list[str] = []
        while sum(map(starts_a_frame, lines)) < 3 and (line := watch.stdout.readline()):
            lines.append(line.decode())
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=30)
    finally:
        stuck.cancel()
        if watch.poll() is None:
            watch.kill()
    return watch.returncode, "".join(lines) + out.decode(), err.decode()


@pytest.mark.torch
def test_watch_refreshes_until_ctrl_c(daemon, client):
    ExtensibleTensor(16 * MiB, "cpu", client=client).resize_(6 * MiB)
    returncode, out, err = watch_for_a_while(daemon)
    assert returncode == 0, err
    assert out.count("● hbmd instance host") >= 2 and "committed:   6.0 MiB" in out and "Ctrl-C" in out
    # Not a terminal: no escape codes; and nothing after the last frame on leaving.
    assert "\x1b" not in out and out.rstrip().endswith("6.0 MiB       1  no            0") and err == ""


@pytest.mark.torch
def test_watch_streams_json_lines(daemon, client):
    ExtensibleTensor(16 * MiB, "cpu", client=client).resize_(6 * MiB)
    returncode, out, err = watch_for_a_while(daemon, "--json")
    frames = [json.loads(line) for line in out.splitlines()]
    assert returncode == 0 and err == "" and len(frames) >= 2
    assert frames[-1]["instances"][0]["committed_bytes"] == 6 * MiB
    assert [s["session_id"] for s in frames[-1]["sessions"]] == [client.session_id]


def test_a_reader_that_leaves_early_gets_no_traceback(daemon, client):
    hbmctl_command = f"{sys.executable} -m hbmd.client.ctl --run-dir {daemon.run_dir} watch --interval 0.05"
    out = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {hbmctl_command} 2>{daemon.run_dir}/err | head -n 2"],
        capture_output=True, text=True, timeout=60,
    )
    assert len(out.stdout.splitlines()) == 2 and (daemon.run_dir / "err").read_text() == ""


@pytest.fixture
def two_instances(start_daemon):
    first = start_daemon("--budget", "64MiB")
    second = start_daemon("--budget", "32MiB", "--instance-name", "host2")
    return first, second


def test_status_shows_every_instance_of_a_node(two_instances):
    first, second = two_instances
    rd = str(first.run_dir)
    table = hbmctl("--run-dir", rd, "status")
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[:4] == ["INSTANCE", "BACKEND", "DEVICE", "BUDGET"]
    assert [r.split()[0] for r in rows] == ["host", "host2"]
    assert "64.0 MiB" in rows[0] and "32.0 MiB" in rows[1]

    records = json.loads(hbmctl("--run-dir", rd, "--json", "status").stdout)["instances"]
    assert [(r["instance"], r["budget_bytes"], r["pid"]) for r in records] == [
        ("host", 64 * MiB, first.pid), ("host2", 32 * MiB, second.pid)
    ]
    csv_rows = hbmctl("--run-dir", rd, "-o", "csv", "--no-headers", "status").stdout.splitlines()
    # A host instance has no GPU index: an empty cell, as for every figure that does not exist.
    assert [row.split(",")[:4] for row in csv_rows] == [
        ["host", "host", "", str(64 * MiB)], ["host2", "host", "", str(32 * MiB)]
    ]
    wide = hbmctl("--run-dir", rd, "-o", "wide", "status").stdout
    assert "PID" in wide and str(second.pid) in wide

    os.kill(second.pid, signal.SIGSTOP)  # hung: it does not answer, the row says so and the exit code too
    out = hbmctl("--run-dir", rd, "status", "--timeout", "1")
    assert out.returncode == 1 and "host2: unreachable" in out.stderr and "unreachable" in out.stdout
    out = hbmctl("--run-dir", rd, "--json", "status", "--timeout", "1")
    answered, unreachable = json.loads(out.stdout)["instances"]
    assert out.returncode == 1 and answered["error"] is None and unreachable["error"]
    assert (answered["state"], unreachable["state"]) == ("serving", "unreachable")
    assert set(unreachable) == set(answered) and unreachable["budget_bytes"] is None  # one shape, nulls for the unknown
    second.kill()  # killed, so its instance.json stays behind: not running, which is no failure of this node
    out = hbmctl("--run-dir", rd, "status", "--timeout", "2")
    assert out.returncode == 0 and "host2: not running" in out.stderr and "not running" in out.stdout


def test_a_dead_instance_is_reported_alike_whether_it_is_the_only_one_or_one_of_several(daemon):
    """As test_status_shows_every_instance_of_a_node reports one killed beside another: a row that says so, a line on
    stderr, and exit 1 where no instance answered at all."""
    rd = str(daemon.run_dir)
    daemon.kill()  # killed, so its instance.json stays behind
    out = hbmctl("--run-dir", rd, "--json", "status", "--timeout", "2")
    [record] = json.loads(out.stdout)["instances"]
    assert (record["instance"], record["state"], record["committed_bytes"]) == ("host", "not running", None)
    assert out.returncode == 1 and "hbmctl: host: not running: no hbmd is serving" in out.stderr
    assert "choose another" not in out.stderr  # the run directory is the right one: its daemon is gone
    header, row = hbmctl("--run-dir", rd, "status", "--timeout", "2").stdout.splitlines()
    assert header.split()[:2] == ["INSTANCE", "BACKEND"] and row.split()[:3] == ["host", "not", "running"]
    out = hbmctl("--run-dir", rd, "--json", "sessions", "--timeout", "2")
    assert out.returncode == 1 and out.stdout == "" and "hbmctl: host: not running: " in out.stderr


def deaf_worker(daemon, spawn_worker):
    """A worker that never answers a reclaim, and its session id."""
    worker = spawn_worker(daemon, """
        import sys
        from hbmd.client import connect
        c = connect("cpu", client_name="deaf")
        print(c.session_id, flush=True)
        sys.stdin.readline()
        """)
    return worker, int(worker.readline())


def test_json_has_one_shape_whatever_the_node_and_null_for_what_does_not_exist(daemon, spawn_worker):
    worker, session_id = deaf_worker(daemon, spawn_worker)
    rd = str(daemon.run_dir)
    hbmctl("--run-dir", rd, "reclaim", "--session", str(session_id), "--bytes", "1MiB")
    alone = json.loads(hbmctl("--run-dir", rd, "--json", "status").stdout)
    named = json.loads(hbmctl("--run-dir", rd, "--instance", "host", "--json", "status").stdout)
    assert list(alone) == list(named) == ["instances"] and len(alone["instances"]) == 1
    [status] = alone["instances"]
    assert status["device_index"] is None and status["error"] is None and status["admissible_bytes"] >= 0
    # No GPU, no config: nulls, not "" or a time of 0.
    assert [status[key] for key in ("device_uuid", "config_path", "config_loaded_at", "config_reload_error",
                                    "config_reload_failed_at")] == [None] * 5
    [session] = json.loads(hbmctl("--run-dir", rd, "--json", "sessions").stdout)["sessions"]
    assert session["reclaim_state"] == "pending" and session["reclaim_released_bytes"] is None
    worker.send("done")
    assert worker.wait() == 0


@pytest.mark.torch
def test_json_says_null_of_what_does_not_exist_where_it_said_0_or_nothing(daemon, spawn_worker):
    rd = str(daemon.run_dir)
    with daemon.connect() as engine:
        kv = ExtensibleTensor(8 * MiB, "cpu", client=engine, name="kv", persistent=True)
        kv.resize_(2 * MiB)
        weights = ExtensibleTensor(8 * MiB, "cpu", client=engine, name="weights", persistent=True)
        weights.resize_(2 * MiB)
        weights.seal()
        for orphan in (kv, weights):
            orphan.detach()
    buffers = json.loads(hbmctl("--run-dir", rd, "--json", "buffers").stdout)["buffers"]
    assert [(b["name"], b["session_id"]) for b in buffers] == [("kv", None), ("weights", None)]  # orphans: no session
    [sealed] = json.loads(hbmctl("--run-dir", rd, "--json", "weights").stdout)["weights"]
    assert sealed["session_id"] is None
    worker, session_id = deaf_worker(daemon, spawn_worker)
    [session] = json.loads(hbmctl("--run-dir", rd, "--json", "sessions").stdout)["sessions"]
    assert [session[key] for key in ("reclaim_state", "reclaim_requested_bytes", "reclaim_released_bytes")] == [
        None, None, None]  # never asked
    out = hbmctl("--run-dir", rd, "--json", "reclaim", "--session", str(session_id), "--bytes", "1MiB")
    asked = json.loads(out.stdout)
    assert out.returncode == 0 and (asked["state"], asked["released_bytes"]) == ("pending", None)  # not waited for
    worker.send("done")
    assert worker.wait() == 0


@pytest.mark.torch
def test_watch_writes_status_as_a_csv_time_series(daemon, client):
    ExtensibleTensor(16 * MiB, "cpu", client=client).resize_(6 * MiB)
    returncode, out, err = watch_for_a_while(daemon, "-o", "csv")
    header, *rows = out.splitlines()
    assert returncode == 0 and err == "" and len(rows) >= 2
    assert header.startswith("time,instance,backend,device,budget,committed,")
    times = [float(row.split(",")[0]) for row in rows]
    assert times == sorted(times) and abs(times[-1] - time.time()) < 30
    columns = header.split(",")
    assert all(dict(zip(columns, row.split(",")))["committed"] == str(6 * MiB) for row in rows)


def test_a_command_that_acts_on_one_instance_is_a_usage_error_when_several_run(two_instances):
    rd = str(two_instances[0].run_dir)
    out = hbmctl("--run-dir", rd, "delete", "kv")
    assert out.returncode == 2 and "choose one with --instance" in out.stderr and "host, host2" in out.stderr
    out = hbmctl("--run-dir", rd, "reclaim", "--session", "1", "--bytes", "1MiB")
    assert out.returncode == 2 and "choose one with --instance" in out.stderr
    # Session ids are each instance's own: one of them is no answer on a node of several.
    out = hbmctl("--run-dir", rd, "buffers", "--session", "1")
    assert out.returncode == 2 and "each numbering its own sessions" in out.stderr
    assert hbmctl("--run-dir", rd, "--instance", "host2", "buffers", "--session", "999").returncode == 3


@pytest.mark.torch
def test_sessions_and_buffers_list_every_instance_of_a_node(two_instances):
    first, second = two_instances
    rd = str(first.run_dir)
    engines = [daemon.connect(client_name=f"engine-{daemon.instance}", lease=False) for daemon in two_instances]
    for engine, size in zip(engines, (2, 4)):
        ExtensibleTensor(16 * MiB, "cpu", client=engine).resize_(size * MiB)

    header, *rows = hbmctl("--run-dir", rd, "sessions").stdout.splitlines()
    assert header.split()[:3] == ["INSTANCE", "SESSION", "PID"]
    assert [(row.split()[0], row.split()[4]) for row in rows] == [("host", "engine-host"), ("host2", "engine-host2")]
    sessions = json.loads(hbmctl("--run-dir", rd, "--json", "sessions").stdout)["sessions"]
    assert [(s["instance"], s["session_id"], s["committed_bytes"]) for s in sessions] == [
        ("host", engines[0].session_id, 2 * MiB), ("host2", engines[1].session_id, 4 * MiB)
    ]
    buffers = json.loads(hbmctl("--run-dir", rd, "--json", "buffers").stdout)["buffers"]
    assert [(b["instance"], b["physical_bytes"]) for b in buffers] == [("host", 2 * MiB), ("host2", 4 * MiB)]
    csv_rows = hbmctl("--run-dir", rd, "-o", "csv", "buffers").stdout.splitlines()
    assert csv_rows[0].startswith("instance,buffer,session,")
    assert [r.split(",")[0] for r in csv_rows[1:]] == ["host", "host2"]

    # --instance narrows to one: its rows only, as on a node of one instance, each record still naming it.
    header, *rows = hbmctl("--run-dir", rd, "--instance", "host2", "buffers").stdout.splitlines()
    assert header.split()[0] == "BUFFER" and len(rows) == 1 and "4.0 MiB" in rows[0]
    [buffer] = json.loads(hbmctl("--run-dir", rd, "--instance", "host2", "--json", "buffers").stdout)["buffers"]
    assert buffer["instance"] == "host2"

    engines[1].close()
    second.kill()  # its instance.json stays behind: the listing shows the other and says the killed one is not running
    out = hbmctl("--run-dir", rd, "sessions", "--timeout", "2")
    assert out.returncode == 0 and "hbmctl: host2: not running: no hbmd is serving" in out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split()[0] == "INSTANCE" and [row.split()[0] for row in rows] == ["host"]
    out = hbmctl("--run-dir", rd, "--json", "buffers", "--timeout", "2")
    assert out.returncode == 0 and [b["instance"] for b in json.loads(out.stdout)["buffers"]] == ["host"]
    status = hbmctl("--run-dir", rd, "--json", "status", "--timeout", "2")
    records = json.loads(status.stdout)["instances"]
    assert status.returncode == 0 and [(r["instance"], r["state"]) for r in records] == [
        ("host", "serving"), ("host2", "not running")]
    assert records[1]["committed_bytes"] is None
    assert "not running" in hbmctl("--run-dir", rd, "status").stdout.splitlines()[2]
    first.kill()
    out = hbmctl("--run-dir", rd, "--json", "sessions", "--timeout", "2")
    assert out.returncode == 1 and out.stdout == "" and "host:" in out.stderr and "host2:" in out.stderr
    engines[0].close()


def test_watch_follows_its_instance_through_a_restart_saying_so(start_daemon, run_dir):
    daemon = start_daemon("--budget", "64MiB")
    watch = subprocess.Popen([sys.executable, "-m", "hbmd.client.ctl", "--run-dir", str(run_dir), "--json", "watch",
                              "--interval", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = json.loads(watch.stdout.readline())["instances"][0]["pid"]
        daemon.kill()
        again = start_daemon("--budget", "32MiB")
        while json.loads(watch.stdout.readline())["instances"][0]["pid"] != again.pid:
            pass
        assert watch.poll() is None and first == daemon.pid
        watch.send_signal(signal.SIGINT)
        _, err = watch.communicate(timeout=30)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0
    assert "waiting for hbmd to serve host again" in err and err.rstrip().endswith("hbmd serves host again")


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_watch_stops_on_a_signal_it_inherited_ignored(daemon, stop):
    """A watch started where SIGINT is ignored (``cmd &`` in a script, ``nohup``) still leaves on Ctrl-C or SIGTERM."""
    watch = subprocess.Popen(
        [sys.executable, "-m", "hbmd.client.ctl", "--run-dir", str(daemon.run_dir), "--json", "watch",
         "--interval", "0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert json.loads(watch.stdout.readline())["instances"][0]["pid"] == daemon.pid  # it serves: watching began
        watch.send_signal(stop)
        _, err = watch.communicate(timeout=30)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0 and err == ""


def test_watch_shows_the_sessions_of_every_instance(two_instances):
    first = two_instances[0]
    engines = [daemon.connect(client_name=f"engine-{daemon.instance}", lease=False) for daemon in two_instances]
    returncode, out, err = watch_for_a_while(first, "--json")
    frames = [json.loads(line) for line in out.splitlines()]
    assert returncode == 0 and err == "" and len(frames) >= 2
    assert [r["instance"] for r in frames[-1]["instances"]] == ["host", "host2"]
    assert [(s["instance"], s["client_name"]) for s in frames[-1]["sessions"]] == [
        ("host", "engine-host"), ("host2", "engine-host2")
    ]
    assert frames[-1]["buffers"] == []
    returncode, out, err = watch_for_a_while(first)
    assert returncode == 0 and "engine-host2" in out and "no buffers" in out
    for engine in engines:
        engine.close()


def test_versions_agree():
    ctl = hbmctl("--version")
    daemon = subprocess.run([sys.executable, "-m", "hbmd.daemon", "--version"],
                            capture_output=True, text=True, timeout=60)
    assert ctl.returncode == 0 and daemon.returncode == 0
    assert ctl.stdout.split()[1] == daemon.stdout.split()[1] != ""


def test_reclaim_finds_a_session_by_pid_or_client_name(daemon, spawn_worker):
    worker = spawn_worker(
        daemon,
        """
        import sys
        from hbmd.client import connect
        c = connect("cpu", client_name="engine-a")
        print(c.session_id, flush=True)
        sys.stdin.readline()
        """,
    )
    session_id = int(worker.readline())
    rd = str(daemon.run_dir)
    by_pid = json.loads(
        hbmctl("--run-dir", rd, "--json", "reclaim", "--pid", str(worker.proc.pid), "--bytes", "1MiB").stdout
    )
    by_name = json.loads(hbmctl("--run-dir", rd, "--json", "reclaim", "--name", "engine-a", "--bytes", "1MiB").stdout)
    assert by_pid["session_id"] == by_name["session_id"] == session_id
    out = hbmctl("--run-dir", rd, "reclaim", "--name", "nobody", "--bytes", "1MiB")
    assert out.returncode == 3 and "no session with client name 'nobody'" in out.stderr
    assert hbmctl("--run-dir", rd, "reclaim", "--pid", "1", "--name", "x", "--bytes", "1MiB").returncode == 2
    worker.send("done")
    assert worker.wait() == 0


@pytest.mark.torch
def test_no_headers_leaves_rows_only(daemon, client):
    ExtensibleTensor(16 * MiB, "cpu", client=client).resize_(2 * MiB)
    rows = hbmctl("--run-dir", str(daemon.run_dir), "buffers", "--no-headers").stdout.splitlines()
    assert len(rows) == 1 and rows[0].split()[0] == "1"
    raw = hbmctl("--run-dir", str(daemon.run_dir), "-o", "csv", "sessions").stdout.splitlines()
    assert raw[0].startswith("session,pid,uid") and raw[1].split(",")[8] == str(2 * MiB)


@pytest.mark.parametrize("fmt", ["table", "csv"])
def test_control_characters_from_a_peer_are_shown_escaped(fmt):
    # A daemon older than the hello's name check passes any client_name on: hbmctl must not emit it raw.
    forged = "eng\x1b[2J\x1b]0;owned\x07\x1b[31mFAKE\r\nx"
    listing = Output(data={}, columns=[Column("NAME", lambda r: r["name"], lambda r: r["name"])],
                     items=[{"name": forged}])
    text = render(listing, fmt, with_headers=True)
    assert text.splitlines()[1] == r"eng\x1b[2J\x1b]0;owned\x07\x1b[31mFAKE\r\nx"
    assert all(c.isprintable() for c in text.replace("\n", ""))



@pytest.mark.torch
def test_buffers_add_up_to_status_while_a_preserving_defragment_holds_old_and_new_chunks(daemon):
    rd = str(daemon.run_dir)
    with daemon.connect(client_name="engine", lease=False) as engine:  # one chunk per commit
        kv = ExtensibleTensor(16 * MiB, "cpu", client=engine)
        kv.resize_(2 * MiB)
        kv.resize_(4 * MiB)
        with engine.defragment(kv.buffer_id, True) as delivery:
            new_chunks = list(delivery)  # held by the daemon beside the old ones until told to drop either
        assert len(new_chunks) == 1
        [status] = json.loads(hbmctl("--run-dir", rd, "--json", "status").stdout)["instances"]
        [buffer] = json.loads(hbmctl("--run-dir", rd, "--json", "buffers").stdout)["buffers"]
        assert buffer["physical_bytes"] == buffer["pending_bytes"] == 4 * MiB
        assert status["committed_bytes"] == 8 * MiB
        [row] = hbmctl("--run-dir", rd, "-o", "csv", "--no-headers", "buffers").stdout.splitlines()
        assert str(8 * MiB) in row.split(",")
        wide = hbmctl("--run-dir", rd, "-o", "wide", "buffers").stdout.splitlines()
        assert "PENDING" in wide[0].split() and "8.0 MiB" in wide[1] and "4.0 MiB" in wide[1]
        engine.finish_defragment(kv.buffer_id, keep_new=False)
        [buffer] = json.loads(hbmctl("--run-dir", rd, "--json", "buffers").stdout)["buffers"]
        assert buffer["pending_bytes"] == 0 and buffer["physical_bytes"] == 4 * MiB


@pytest.mark.torch
def test_weights_lists_what_is_sealed_with_its_readers_and_delete_waits_for_none(daemon, client):
    from hbmd.client.weights import load_weights, store_weights

    rd = str(daemon.run_dir)
    name = "vllm-weights:LlamaForCausalLM:bfloat16:tp0of1:pp0of1:5dca4800d5f6a217"
    store_weights({"w": torch.ones(1024)}, name, "cpu", client=client).detach()
    ExtensibleTensor(4 * MiB, "cpu", client=client, name="kv", persistent=True).resize_(MiB)
    reader = connect(run_dir=daemon.run_dir, instance="host", client_name="engine")
    load_weights(name, "cpu", client=reader)

    table = hbmctl("--run-dir", rd, "weights").stdout.splitlines()
    assert table[0].split() == ["NAME", "SIZE", "READERS", "HELD-BY", "BUFFER"]
    assert len(table) == 2 and table[1].split()[:4] == [name, "2.0", "MiB", "1"] and "nobody (orphan)" in table[1]
    (listed,) = json.loads(hbmctl("--run-dir", rd, "weights", "-o", "json").stdout)["weights"]
    assert listed["name"] == name and listed["readers"] == 1 and listed["physical_bytes"] == 2 * MiB

    refused = hbmctl("--run-dir", rd, "delete", name)
    assert refused.returncode == 3 and "is read by session" in refused.stderr
    reader.close()
    assert hbmctl("--run-dir", rd, "delete", name).returncode == 0
    assert hbmctl("--run-dir", rd, "weights").stdout.strip() == "no sealed weights"


@pytest.mark.torch
def test_status_says_what_holds_budget_left_below_the_uncommitted_budget(start_daemon, run_dir):
    config = run_dir / "tenants.toml"
    config.write_text('[[tenants]]\nname = "large"\nguaranteed = "96MiB"\n')
    daemon = start_daemon("--budget", "256MiB", "--config", str(config))
    with daemon.connect(client_name="engine", lease=False) as engine:
        ExtensibleTensor(64 * MiB, "cpu", client=engine).resize_(16 * MiB)
        [status] = json.loads(hbmctl("--run-dir", str(run_dir), "--json", "status").stdout)["instances"]
        # Nobody of "large" is here, and its guarantee is held for it all the same.
        assert status["held_for_guarantees_bytes"] == 96 * MiB and status["leased_bytes"] == 0
        assert status["budget_left_bytes"] == (256 - 16 - 96) * MiB
        text = hbmctl("--run-dir", str(run_dir), "status").stdout
        assert ("budget left: 144.0 MiB "
                "(240.0 MiB uncommitted, less 96.0 MiB held for other tenants' guaranteed minimums)") in text
        wide = hbmctl("--run-dir", str(run_dir), "-o", "csv", "status").stdout.splitlines()
        row = dict(zip(wide[0].split(","), wide[1].split(",")))
        assert row["held-for-guarantees"] == str(96 * MiB) and row["budget-left"] == str(144 * MiB)


@pytest.mark.torch
def test_status_shows_leases_granules_and_credit_apart(start_daemon, run_dir):
    daemon = start_daemon("--budget", "2GiB")
    with daemon.connect() as engine:
        credited(engine, ExtensibleTensor(1 << 30, "cpu", client=engine), 64 * MiB, 128 * MiB)
        wait_until(lambda: engine.status().leased_bytes == 128 * MiB)
        [status] = json.loads(hbmctl("--run-dir", str(run_dir), "--json", "status").stdout)["instances"]
        assert status["credit_bytes"] == status["leased_bytes"] == 128 * MiB
        assert status["held_for_guarantees_bytes"] == 0
        text = hbmctl("--run-dir", str(run_dir), "status").stdout
        assert "leased:      128.0 MiB (0 B granules, 128.0 MiB credit: " in text
        assert "budget left: 1.8 GiB (1.9 GiB uncommitted, less 128.0 MiB leased)" in text


def test_status_says_when_your_own_tenant_maximum_caps_the_budget_left(start_daemon, run_dir):
    config = run_dir / "tenants.toml"
    config.write_text(f'[[tenants]]\nuid = {os.getuid()}\nmax = "32MiB"\n')  # hbmctl's own tenant
    start_daemon("--budget", "256MiB", "--config", str(config))
    text = hbmctl("--run-dir", str(run_dir), "status").stdout
    assert "budget left: 32.0 MiB (256.0 MiB uncommitted, less 224.0 MiB beyond your tenant's maximum)" in text


def test_a_reclaim_wait_that_ends_unanswered_exits_4(daemon, spawn_worker):
    worker, session_id = deaf_worker(daemon, spawn_worker)
    rd = str(daemon.run_dir)
    out = hbmctl("--run-dir", rd, "--json", "reclaim", "--session", str(session_id), "--bytes", "1MiB", "--wait", "0.5")
    assert out.returncode == 4 and json.loads(out.stdout)["state"] == "pending"
    assert f"session {session_id} (pid {worker.proc.pid}) has not answered the reclaim after 0.5s" in out.stderr
    out = hbmctl("--run-dir", rd, "reclaim", "--session", str(session_id), "--bytes", "1MiB", "--wait", "0.2")
    assert out.returncode == 4 and out.stdout.strip().endswith("; pending")
    # Without --wait nothing is waited for, and nothing is missing.
    assert hbmctl("--run-dir", rd, "reclaim", "--session", str(session_id), "--bytes", "1MiB").returncode == 0
    worker.send("done")
    assert worker.wait() == 0


@pytest.mark.parametrize("name", ["=HYPERLINK(\"http://x\",\"y\")", "+1+1", "-2+3", "@SUM(A1)", " =1+1", "  @A1",
                                  "\uff1dHYPERLINK(\"http://x\")", "\uff20SUM(A1)", "\uff0b1"])
def test_a_name_a_spreadsheet_would_run_as_a_formula_is_quoted_in_csv(daemon, name):
    with daemon.connect(client_name=name, lease=False):
        out = hbmctl("--run-dir", str(daemon.run_dir), "-o", "csv", "sessions")
        rows = list(csv.DictReader(io.StringIO(out.stdout)))
        assert out.returncode == 0 and [row["name"] for row in rows] == ["'" + name]
        as_json = json.loads(hbmctl("--run-dir", str(daemon.run_dir), "--json", "sessions").stdout)
        assert [s["client_name"] for s in as_json["sessions"]] == [name]  # JSON is data, not a sheet: as it is
