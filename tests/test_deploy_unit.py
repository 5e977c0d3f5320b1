"""The systemd unit: its sandbox score, and that the daemon's system calls all pass its filter."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from hbmd.client import ExtensibleTensor, OutOfBudget, connect
from helpers import MiB, wait_until
from test_metrics import free_port

UNIT = Path(__file__).parent.parent / "deploy" / "hbmd@.service"
needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")


def unit_values(key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in UNIT.read_text().splitlines() if line.startswith(f"{key}=")]


@pytest.mark.unit
@needs_analyze
def test_the_unit_is_rated_at_most_4_5(tmp_path):
    # --offline needs the file under its own name; the instance is what gets rated.
    shutil.copy(UNIT, tmp_path / UNIT.name)
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", "hbmd@0.service"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )
    score = float(re.search(r"Overall exposure level for hbmd@0.service: ([\d.]+)", out.stdout).group(1))
    assert score <= 4.5, out.stdout


@pytest.mark.unit
def test_the_unit_keeps_gpu_access_and_peer_uids():
    assert unit_values("DeviceAllow") == ["char-nvidia* rw"] and unit_values("DevicePolicy") == ["closed"]
    assert not unit_values("PrivateUsers") and not unit_values("PrivateDevices")
    assert unit_values("CapabilityBoundingSet") == [""]
    assert unit_values("Documentation")


@pytest.mark.unit
def test_a_reload_checks_the_config_first_and_a_bad_one_at_boot_is_not_restarted_in_a_loop():
    (start,) = unit_values("ExecStart")
    assert unit_values("ExecReload") == [f"{start} --check-config", "/bin/kill -HUP $MAINPID"]
    assert unit_values("RestartPreventExitStatus") == ["2"]


@pytest.mark.ipc
def test_check_config_says_whether_a_start_would_take_the_config_and_serves_nothing(run_dir):
    good, bad = run_dir / "good.toml", run_dir / "bad.toml"
    good.write_text('[[tenants]]\nname = "serving"\nmax = "6GiB"\nguaranteed = "1GiB"\n')
    bad.write_text('[[tenants]]\nname = "serving"\nmax = "six"\n')
    command = [sys.executable, "-m", "hbmd.daemon", "--backend", "host", "--budget", "8GiB", "--run-dir", str(run_dir),
               "--check-config", "--config"]
    ok = subprocess.run([*command, str(good)], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"{good}: valid for the host backend; budget 8.0 GiB of ")
    assert ok.stdout.endswith(", 1 tenants guaranteed 1.0 GiB in all\n")
    refused = subprocess.run([*command, str(bad)], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "tenants[0].max: bad size 'six'" in refused.stderr
    assert "Traceback" not in refused.stderr and not (run_dir / "host").exists()


def allowed_syscalls(group: str) -> set[str]:
    """The system calls a ``SystemCallFilter=`` group allows, nested groups expanded."""
    out = subprocess.run(["systemd-analyze", "syscall-filter", group],
                         capture_output=True, text=True, timeout=60).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        names |= allowed_syscalls(entry) if entry.startswith("@") else {entry}
    return names


@pytest.mark.torch
@pytest.mark.ipc
@needs_analyze
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
@pytest.mark.system
def test_every_system_call_of_the_daemon_passes_the_units_filter(run_dir):
    (allowed,) = unit_values("SystemCallFilter")
    config = run_dir / "tenants.toml"
    config.write_text('[[tenants]]\nname = "a"\nmax = "64MiB"\n')
    trace = run_dir / "trace"
    port = free_port()
    # Not the start_daemon fixture: the daemon is strace's child here, so instance.json names another pid.
    with open(run_dir / "hbmd.log", "wb") as log:
        traced = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", str(trace), sys.executable, "-m", "hbmd.daemon", "--backend", "host",
             "--run-dir", str(run_dir), "--device-lock-dir", str(run_dir), "--budget", "128MiB",
             "--config", str(config), "--metrics-addr", f"127.0.0.1:{port}"],
            stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        instance_json = run_dir / "host" / "instance.json"
        info = wait_until(lambda: instance_json.is_file() and instance_json, 30)
        daemon_pid = json.loads(info.read_text())["pid"]
        # Everything a daemon does in service: sessions, commits and FD passing, a refusal, a scrape, a reload.
        with connect(run_dir=run_dir, instance="host", tenant="a") as client:
            kv = ExtensibleTensor(96 * MiB, "cpu", client=client, name="kv", persistent=True)
            kv.resize_(32 * MiB)
            kv.defragment(preserve=True)
            with pytest.raises(OutOfBudget):
                kv.resize_(96 * MiB)
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
            os.kill(daemon_pid, signal.SIGHUP)
            wait_until(lambda: "SIGHUP: reloaded" in (run_dir / "hbmd.log").read_text())
            kv.free()
        os.kill(daemon_pid, signal.SIGTERM)
        assert traced.wait(30) == 0
    finally:
        if traced.poll() is None:
            traced.kill()
            traced.wait(5)
    called = {m.group(1) for m in re.finditer(r"^\d+\s+([a-z0-9_]+)\(", trace.read_text(), re.M)}
    # Calls strace itself or Python's start-up makes before the daemon's code runs are in the set too: all must pass.
    assert {"sendmsg", "fallocate", "memfd_create"} <= called and called - allowed_syscalls(allowed) == set()
