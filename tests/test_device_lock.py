"""One daemon per GPU, and one host daemon per node, whatever their run directories: the lock keyed by the GPU's
UUID (or by host memory).

The daemon's side runs here on the host backend, given a GPU's UUID by a
launcher (no GPU needed): what is checked is the lock and its wiring, which
are the same for the CUDA backend. Every daemon here names its own lock
directory, so that none meets a daemon of another test or of the machine.
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
                                          rf"\(uid {os.getuid()}, run directory /run/one;"):
        second.acquire("/run/two")
    assert not second.held
    first.release()
    second.acquire("/run/two")
    assert second.held
    assert (tmp_path / f"gpu-{UUID}.lock").read_text() == f"{os.getpid()} {os.getuid()} /run/two\n"
    second.release()
    second.release()


@pytest.mark.unit
def test_a_link_planted_where_the_lock_goes_is_not_followed_and_the_gpu_is_locked_all_the_same(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    (tmp_path / f"gpu-{UUID}.lock").symlink_to(target)
    lock = DeviceLock(tmp_path, UUID)
    lock.acquire("/run/one")
    assert target.read_text() == "keep"
    with pytest.raises(DeviceTaken, match=f"already served by hbmd pid {os.getpid()} "):
        DeviceLock(tmp_path, UUID).acquire("/run/two")
    lock.release()


@pytest.mark.unit
def test_where_the_lock_directory_cannot_be_used_the_lock_holds_all_the_same(tmp_path):
    """A user's own daemon cannot write /run/hbmd: it still locks the GPU, by a name every daemon can take (an abstract
    socket), and a second daemon is refused naming the first."""
    (tmp_path / "a-file").write_text("")
    unusable = tmp_path / "a-file" / "locks"  # no directory can be made there, by root either
    first, second = DeviceLock(unusable, UUID), DeviceLock(unusable, UUID)
    first.acquire("/run/one")
    assert first.held and "a-file" in first.unshared
    with pytest.raises(DeviceTaken, match=f"GPU {UUID} is already served by hbmd pid {os.getpid()} "):
        second.acquire("/run/two")
    assert not second.held
    first.release()
    second.acquire("/run/two")
    assert second.held
    second.release()


@pytest.mark.unit
def test_host_memory_has_a_lock_of_its_own_and_locks_in_other_directories_do_not_meet(tmp_path):
    host, gpu = DeviceLock(tmp_path, ""), DeviceLock(tmp_path, UUID)
    host.acquire("/run/one")
    gpu.acquire("/run/one")  # a GPU is not host memory
    with pytest.raises(DeviceTaken, match=f"host memory is already served by hbmd pid {os.getpid()} .*--instance-name"):
        DeviceLock(tmp_path, "").acquire("/run/two")
    elsewhere = DeviceLock(tmp_path / "elsewhere", "")
    elsewhere.acquire("/run/three")
    for lock in (host, gpu, elsewhere):
        lock.release()


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
                                           f"{first.pid} \\(uid {os.getuid()}, run directory {run_dir / 'a'};"):
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


def host_daemon(run_dir, lock_dir, *args: str) -> DaemonProcess:
    return DaemonProcess(run_dir, "--backend", "host", "--budget", "64MiB", "--device-lock-dir", str(lock_dir), *args)


@pytest.mark.ipc
@pytest.mark.system
def test_a_second_host_daemon_of_a_node_is_refused_unless_its_instance_name_says_it_is_meant(run_dir):
    locks = run_dir / "locks"
    with host_daemon(run_dir / "a", locks) as first:
        second = host_daemon(run_dir / "b", locks)
        with pytest.raises(RuntimeError, match=f"(?s)hbmd exited with 1:.*host memory is already served by hbmd pid "
                                               f"{first.pid} \\(uid {os.getuid()}, run directory {run_dir / 'a'};"):
            second.start()
        assert "--takeover" in second.log() and "--instance-name" in second.log()
        with host_daemon(run_dir / "b", locks, "--instance-name", "pool2") as meant:
            assert meant.instance == "pool2" and first.alive()


@pytest.mark.ipc
@pytest.mark.system
def test_a_daemon_that_cannot_use_the_lock_directory_still_keeps_a_second_one_of_its_gpu_out(gpu_daemons, run_dir):
    """As a user's own daemon, which cannot write /run/hbmd: it used to serve without the lock, saying so at WARNING."""
    (run_dir / "a-file").write_text("")
    unusable = str(run_dir / "a-file" / "locks")
    first = gpu_daemons(run_dir / "a", "--device-lock-dir", unusable)
    with pytest.raises(RuntimeError, match=f"(?s)hbmd exited with 1:.*GPU {UUID} is already served by hbmd pid "
                                           f"{first.pid} \\(uid {os.getuid()}, run directory {run_dir / 'a'};"):
        gpu_daemons(run_dir / "b", "--device-lock-dir", unusable)
    assert " WARNING " not in first.log()


@pytest.mark.ipc
@pytest.mark.system
def test_a_second_daemon_of_one_run_directory_is_refused_naming_the_first_and_the_takeover(run_dir):
    with host_daemon(run_dir, run_dir) as first:
        second = host_daemon(run_dir, run_dir)
        with pytest.raises(RuntimeError, match=f"(?s)hbmd exited with 1:.*another hbmd \\(pid {first.pid}\\) is "
                                               f"already serving {run_dir / 'host'}: .*--takeover"):
            second.start()


@pytest.mark.unit
def test_the_lock_directory_is_made_where_it_is_missing(tmp_path):
    """/run/hbmd does not outlive a boot: the first daemon since makes it (seen missing on a GPU machine)."""
    lock = DeviceLock(tmp_path / "run" / "hbmd", UUID)
    lock.acquire("/run/one")
    assert (tmp_path / "run" / "hbmd" / f"gpu-{UUID}.lock").read_text() == f"{os.getpid()} {os.getuid()} /run/one\n"
    lock.release()
