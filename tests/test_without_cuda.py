"""A node without cuda-bindings (they are an extra): the host backend, the client and hbmctl still work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hbmd.client import ExtensibleTensor
from helpers import MiB

pytestmark = pytest.mark.ipc

# Run a module with every `cuda` import failing, as on a machine where the package is absent.
WITHOUT_CUDA = """
import runpy, sys
sys.modules["cuda"] = None
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def test_auto_falls_back_to_host_memory_and_says_why(start_daemon, run_dir):
    launcher = run_dir / "without_cuda.py"
    launcher.write_text(WITHOUT_CUDA)
    daemon = start_daemon(
        "--budget", "64MiB", backend="auto", command=[sys.executable, str(launcher), "-m", "hbmd.daemon"]
    )
    assert daemon.instance == "host"
    assert "auto: CUDA unusable (cuda-bindings is not installed" in daemon.log().splitlines()[0]
    with daemon.connect() as client:
        ExtensibleTensor(8 * MiB, "cpu", client=client).resize_(4 * MiB)
        status = subprocess.run(
            [sys.executable, str(launcher), "-m", "hbmd.client.ctl", "--run-dir", str(run_dir), "--json", "status"],
            capture_output=True, text=True, timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["committed_bytes"] == 4 * MiB


def test_asking_for_cuda_without_the_bindings_is_a_clear_error(run_dir):
    launcher = run_dir / "without_cuda.py"
    launcher.write_text(WITHOUT_CUDA)
    out = subprocess.run(
        [sys.executable, str(launcher), "-m", "hbmd.daemon", "--backend", "cuda", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1 and "cuda-bindings is not installed" in out.stderr and "Traceback" not in out.stderr
