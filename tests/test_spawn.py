"""The test harness's daemons: one whose test process dies goes with it."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
from hbmd.testing.spawn import LineProcess, wait_until

pytestmark = pytest.mark.ipc

STARTER = """
import sys
from hbmd.testing.spawn import DaemonProcess

daemon = DaemonProcess(sys.argv[1], "--backend", "host", "--device-lock-dir", sys.argv[1]).start()
print(daemon.pid, flush=True)
sys.stdin.readline()
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped
    except FileNotFoundError:
        return True


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux's setpriv is not installed")
def test_a_daemon_whose_test_process_is_killed_stops_with_it(run_dir):
    starter = LineProcess(["-c", STARTER, str(run_dir)])
    pid = int(starter.readline())
    assert not gone(pid)
    os.kill(starter.proc.pid, signal.SIGKILL)
    starter.wait()
    try:
        wait_until(lambda: gone(pid), timeout=10)
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
