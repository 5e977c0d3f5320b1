"""Fixtures: a real ``hbmd`` subprocess on the host backend in a short temp dir, and worker processes."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest
from fake_systemd import FakeSystemd
from hbmd.client import Client, connect
from hbmd.daemon.main import EXIT_INVARIANT_VIOLATED
from hbmd.testing import spawn

TORCH_MISSING = importlib.util.find_spec("torch") is None


def pytest_collection_modifyitems(config, items):
    """Without torch, the tests that go through tensor views skip, saying so; the others run as ever."""
    if not TORCH_MISSING:
        return
    skip = pytest.mark.skip(reason="needs torch for tensor views: pip install torch==2.13.0 numpy")
    for item in items:
        if item.get_closest_marker("torch") is not None:
            item.add_marker(skip)


class DaemonProcess(spawn.DaemonProcess):
    """An ``hbmd`` subprocess on the host backend (unless told otherwise), logging at debug and checking its
    invariants after every batch of requests (``--check-invariants``: it exits with ``EXIT_INVARIANT_VIOLATED``
    where one does not hold); killed in teardown."""

    def __init__(self, run_dir: Path, *args: str, backend: str = "host", **launch) -> None:
        super().__init__(run_dir, "--backend", backend, "--log-level", "debug", "--check-invariants", *args, **launch)

    def connect(self, **kwargs) -> Client:
        return connect(run_dir=self.run_dir, instance=self.instance, **kwargs)


@pytest.fixture
def run_dir():
    # Short and under /tmp: socket paths must fit in 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="hbmd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def systemd(run_dir):
    """A stand-in for systemd's notify socket and FD store (see ``fake_systemd.py``)."""
    fake = FakeSystemd(run_dir / "notify.sock")
    yield fake
    fake.close()


@pytest.fixture
def start_daemon(run_dir):
    started: list[DaemonProcess] = []

    def start(*args: str, backend: str = "host", **launch) -> DaemonProcess:
        daemon = DaemonProcess(run_dir, *args, backend=backend, **launch).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.kill()
    for daemon in started:
        # A daemon still running was just killed (-9); one that exited on its own with this status found a bug.
        assert daemon.proc.returncode != EXIT_INVARIANT_VIOLATED, daemon.log()[-4000:]
        assert "an invariant does not hold" not in daemon.log(), daemon.log()[-4000:]


@pytest.fixture
def daemon(start_daemon):
    """A host-backend daemon with a 256 MiB budget."""
    return start_daemon("--budget", "256MiB")


@pytest.fixture
def client(daemon):
    c = daemon.connect(client_name="test")
    yield c
    c.close()


class Worker(spawn.LineProcess):
    """A Python worker process running ``code`` against the daemon; killed in teardown."""

    def __init__(self, daemon: DaemonProcess, code: str) -> None:
        super().__init__(["-c", textwrap.dedent(code)], env={"HBMD_RUN_DIR": str(daemon.run_dir)})


@pytest.fixture
def spawn_worker():
    workers: list[Worker] = []

    def spawn(daemon: DaemonProcess, code: str) -> Worker:
        worker = Worker(daemon, code)
        workers.append(worker)
        return worker

    yield spawn
    for worker in workers:
        worker.kill()
