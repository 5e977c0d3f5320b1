"""A node without cuda-bindings (they are an extra): the host backend, the client and hbmctl still work."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import pytest
from hbmd.client import ExtensibleTensor
from hbmd.driver import bindings_to_install
from helpers import MiB

pytestmark = pytest.mark.ipc

# Run a module with every `cuda` import failing, as on a machine where the package is absent.
WITHOUT_CUDA = """
import runpy, sys
sys.modules["cuda"] = None
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


# The same, on a node whose NVIDIA driver says the version given (none: no driver loaded), whatever this one's is.
WITHOUT_CUDA_ON_A_NODE = """
import runpy, sys
import hbmd.driver
sys.modules["cuda"] = None
hbmd.driver.DRIVER_VERSION_FILE = sys.argv[1]
sys.argv = sys.argv[3:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""
R580 = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16)\n"


def auto_on_a_node(start_daemon, run_dir, driver_version: str | None):
    """A daemon of ``--backend auto`` without cuda-bindings, on a node with that driver (None: no driver at all)."""
    launcher = run_dir / "without_cuda.py"
    launcher.write_text(WITHOUT_CUDA_ON_A_NODE)
    version_file = run_dir / "nvidia-version"
    if driver_version is not None:
        version_file.write_text(driver_version)
    return start_daemon("--budget", "64MiB", backend="auto",
                        command=[sys.executable, str(launcher), str(version_file), "-m", "hbmd.daemon"])


@pytest.mark.torch
def test_auto_without_a_driver_serves_host_memory_saying_so_in_one_plain_info_line(start_daemon, run_dir):
    """As on any machine without a GPU: nothing is wrong, and nothing is to install."""
    daemon = auto_on_a_node(start_daemon, run_dir, None)
    assert daemon.instance == "host"
    first = daemon.log().splitlines()[0]
    assert " INFO " in first and "backend host (auto: no NVIDIA driver is loaded here)," in first
    depths = itertools.accumulate({"(": 1, ")": -1}.get(c, 0) for c in first)
    assert "cuda-bindings" not in first and max(depths) == 1  # it said why in parentheses three deep
    launcher = run_dir / "plain_without_cuda.py"
    launcher.write_text(WITHOUT_CUDA)
    with daemon.connect() as client:
        ExtensibleTensor(8 * MiB, "cpu", client=client).resize_(4 * MiB)
        status = subprocess.run(
            [sys.executable, str(launcher), "-m", "hbmd.client.ctl", "--run-dir", str(run_dir), "--json", "status"],
            capture_output=True, text=True, timeout=60,
        )
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["instances"][0]["committed_bytes"] == 4 * MiB


def test_auto_on_a_gpu_node_without_the_bindings_warns_naming_what_to_install(start_daemon, run_dir):
    daemon = auto_on_a_node(start_daemon, run_dir, R580)
    first = daemon.log().splitlines()[0]
    assert " WARNING " in first and "auto: CUDA unusable: cuda-bindings is not installed" in first
    assert "pip install 'cuda-bindings>=13,<14' (this node's driver is R580" in first


def test_asking_for_cuda_without_the_bindings_is_a_clear_error(run_dir):
    launcher = run_dir / "without_cuda.py"
    launcher.write_text(WITHOUT_CUDA)
    out = subprocess.run(
        [sys.executable, str(launcher), "-m", "hbmd.daemon", "--backend", "cuda", "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1 and "cuda-bindings is not installed" in out.stderr and "Traceback" not in out.stderr
    assert bindings_to_install() in out.stderr  # the extra to install


def test_a_gpu_named_without_cuda_is_refused_not_served_as_host_memory(run_dir):
    launcher = run_dir / "without_cuda.py"
    launcher.write_text(WITHOUT_CUDA)
    out = subprocess.run(
        [sys.executable, str(launcher), "-m", "hbmd.daemon", "--device", "0", "--budget", "90%", "--run-dir",
         str(run_dir)], capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "--device 0 names a GPU, so host memory is not served instead" in out.stderr
    assert bindings_to_install() in out.stderr
    assert not (run_dir / "host").exists()


def test_a_gpu_client_without_the_bindings_is_told_what_to_install_and_of_the_host_instance(start_daemon, run_dir):
    start_daemon("--budget", "64MiB")
    code = ("import sys; sys.modules['cuda'] = None\nfrom hbmd.client import connect\n"
            "connect('cuda:0', run_dir=sys.argv[1])")
    out = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, timeout=60)
    message = out.stderr.strip().splitlines()[-1]
    assert message.startswith("hbmd.driver.CudaUnavailable: cuda-bindings is not installed"), out.stderr
    assert bindings_to_install() in message
    assert f"an hbmd host instance serves under {run_dir}: device 'cpu' uses it" in message


@pytest.mark.unit
@pytest.mark.parametrize(
    "version, advice",
    [
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16)",
         "pip install 'cuda-bindings>=13,<14' (this node's driver is R580; from an hbmd checkout, pip install "
         "'.[cuda13]')"),
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024",
         "pip install 'cuda-bindings>=12,<13' (this node's driver is R535"),
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  470.256.02  Thu May  2 14:37:44 UTC 2024",
         "driver R470 is older than any cuda-bindings hbmd takes"),
        (None,
         "pip install 'cuda-bindings>=13,<14' for R580 and newer, 'cuda-bindings>=12,<13' for R525 and newer (no "
         "NVIDIA driver is loaded here)"),
    ],
)
def test_the_extra_to_install_follows_the_nodes_driver(tmp_path, version, advice):
    path = tmp_path / "version"
    if version is not None:
        path.write_text(version + "\nGCC version:  gcc version 12.3.0\n")
    assert advice in bindings_to_install(str(path))
