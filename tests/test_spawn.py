"""The test harness: a daemon whose test process dies goes with it; a helper process's lines, each handed on."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
from hbmd.testing.spawn import LineProcess, ended, wait_until

pytestmark = pytest.mark.ipc

STARTER = """
import sys
from hbmd.testing.spawn import DaemonProcess

daemon = DaemonProcess(sys.argv[1], "--backend", "host", "--device-lock-dir", sys.argv[1]).start()
print(daemon.pid, flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux's setpriv is not installed")
def test_a_daemon_whose_test_process_is_killed_stops_with_it(run_dir):
    starter = LineProcess(["-c", STARTER, str(run_dir)])
    pid = int(starter.readline())
    assert not ended(pid)
    os.kill(starter.proc.pid, signal.SIGKILL)
    starter.wait()
    try:
        wait_until(lambda: ended(pid), timeout=10)
    finally:
        if not ended(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_line_process_hands_on_every_line_it_printed_two_that_came_in_one_read_included():
    """Two lines printed at once come in one read of the pipe: the second waited in the reader's buffer, where a
    ``select`` on the pipe does not see it, and its ``readline`` timed out."""
    helper = LineProcess(["-c", "import sys; sys.stdout.write('a\\nb\\n'); sys.stdout.flush(); sys.stdin.readline()"])
    try:
        assert [helper.readline(timeout=30), helper.readline(timeout=5)] == ["a", "b"]
        helper.send("")
        assert helper.rest(timeout=30) == []
        with pytest.raises(RuntimeError, match="exited with 0"):
            helper.readline(timeout=5)
    finally:
        helper.kill()
