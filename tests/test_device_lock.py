"""One daemon per GPU, whatever its run directory: the lock keyed by the GPU's UUID.

The daemon's side runs here on the host backend, given a GPU's UUID by a
launcher (no GPU needed): what is checked is the lock and its wiring, which
are the same for the CUDA backend.
"""

from __future__ import annotations

import os
import sys

import pytest
from hbmd.daemon.server.device_lock import DeviceLock, DeviceTaken
from hbmd.testing.spawn import DaemonProcess

UUID = "GPU-0bad0bad-0000-4000-8000-00000000c0de"
AS_A_GPU = f"""
import runpy, sys
from hbmd.daemon.backends.host import HostBackend
HostBackend.device_uuid = {UUID!r}
runpy.run_module("hbmd.daemon", run_name="__main__", alter_sys=True)
"""


@pytest.mark.unit
def test_a_second_holder_is_refused_naming_the_first_and_takes_it_once_let_go(tmp_path):
    first, second = DeviceLock(tmp_path, UUID), DeviceLock(tmp_path, UUID)
    first.acquire("/run/one")
    with pytest.raises(DeviceTaken, match=f"GPU {UUID} is already served by hbmd pid {os.getpid()} "
                                          r"\(run directory /run/one;"):
        second.acquire("/run/two")
    assert not second.held
    first.release()
    second.acquire("/run/two")
    assert second.held
    assert (tmp_path / f"gpu-{UUID}.lock").read_text() == f"{os.getpid()} /run/two\n"
    second.release()
    second.release()


@pytest.mark.unit
def test_a_link_planted_where_the_lock_goes_is_not_followed(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / f"gpu-{UUID}.lock").symlink_to(target)
    with pytest.raises(OSError):
        DeviceLock(tmp_path, UUID).acquire("/run/one")
    assert target.read_text() == "keep"


@pytest.fixture
def gpu_daemons(tmp_path_factory):
    """Start daemons that serve "a GPU" (the host backend given a UUID), each in a run directory of its own."""
    started: list[DaemonProcess] = []
    lock_dir = tmp_path_factory.mktemp("locks")
    launcher = lock_dir / "as_a_gpu.py"
    launcher.write_text(AS_A_GPU)

    def start(run_dir, *args: str) -> DaemonProcess:
        daemon = DaemonProcess(run_dir, "--backend", "host", "--budget", "64MiB", "--device-lock-dir", str(lock_dir),
                               *args, command=[sys.executable, str(launcher)])
        started.append(daemon)
        return daemon.start()

    yield start
    for daemon in started:
        daemon.kill()


@pytest.mark.ipc
@pytest.mark.system
def test_a_second_daemon_of_one_gpu_in_another_run_directory_is_refused_naming_the_first(gpu_daemons, run_dir):
    first = gpu_daemons(run_dir / "a")
    with pytest.raises(RuntimeError, match=f"(?s)hbmd exited with 1:.*GPU {UUID} is already served by hbmd pid "
                                           f"{first.pid} \\(run directory {run_dir / 'a'};"):
        gpu_daemons(run_dir / "b")
    assert not (run_dir / "b" / "host" / "instance.json").exists()
    assert first.stop() == 0
    second = gpu_daemons(run_dir / "b")  # once the first has stopped, the GPU is free
    assert second.alive()


@pytest.mark.ipc
@pytest.mark.system
def test_a_successor_takes_the_gpu_over_from_its_predecessor(gpu_daemons, run_dir):
    first = gpu_daemons(run_dir)
    second = gpu_daemons(run_dir, "--takeover")
    assert first.proc.wait(10) == 0 and "took over from pid" in second.log()
    with pytest.raises(RuntimeError, match=f"already served by hbmd pid {second.pid} "):
        gpu_daemons(run_dir / "elsewhere")


@pytest.mark.unit
def test_the_lock_directory_is_made_where_it_is_missing(tmp_path):
    """/run/hbmd does not outlive a boot: the first daemon since makes it (seen missing on a GPU machine)."""
    lock = DeviceLock(tmp_path / "run" / "hbmd", UUID)
    lock.acquire("/run/one")
    assert (tmp_path / "run" / "hbmd" / f"gpu-{UUID}.lock").read_text() == f"{os.getpid()} /run/one\n"
    lock.release()
