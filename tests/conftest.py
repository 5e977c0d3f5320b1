"""Fixtures: a real ``hbmd`` subprocess on the host backend in a short temp dir, and worker processes."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from fake_systemd import FakeSystemd
from hbmd.client import Client, connect
from hbmd.daemon.main import EXIT_INVARIANT_VIOLATED
from hbmd.testing import spawn

TORCH_MISSING = importlib.util.find_spec("torch") is None


SYSTEM_LANE = ("system", "cli", "flood", "vllm", "gpu")
"""Markers of the second lane: tests of a second or more, which run after every test of the fast lane passed."""


def in_system_lane(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) is not None for name in SYSTEM_LANE)


def pytest_addoption(parser):
    parser.addoption("--lane", choices=("fast", "system"),
                     help="run one lane: fast (unit and quick ipc tests, about four minutes) or system (the rest)")


def pytest_collection_modifyitems(config, items):
    """The fast lane first (unit tests and quick ipc tests, about four minutes), then the system lane (``--lane``
    picks one); without torch, the tests that go through tensor views skip, saying so."""
    lane = config.getoption("--lane")
    if lane is not None:
        left = [item for item in items if in_system_lane(item) != (lane == "system")]
        config.hook.pytest_deselected(items=left)
        items[:] = [item for item in items if in_system_lane(item) == (lane == "system")]
    items.sort(key=in_system_lane)  # stable: each lane keeps the files' order
    fast = sum(not in_system_lane(item) for item in items)
    if items and 0 < fast < len(items):
        config.pluginmanager.register(Lanes(items[0].session, fast), "hbmd-lanes")
    if not TORCH_MISSING:
        return
    skip = pytest.mark.skip(reason="needs torch for tensor views: pip install torch==2.13.0 numpy")
    for item in items:
        if item.get_closest_marker("torch") is not None:
            item.add_marker(skip)


class Lanes:
    """Says when the fast lane has run, and stops there where it failed: the system lane takes fifteen minutes more, and
    a broken fast test seldom leaves it worth waiting for (``--lane system`` runs it alone)."""

    def __init__(self, session: pytest.Session, fast: int) -> None:
        self.session = session
        self.left = fast
        self.failed = 0
        self.began = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.left <= 0:
            return
        self.failed += report.failed
        if report.when == "teardown":
            self.left -= 1
            if self.left == 0:
                self.fast_lane_ran()

    def fast_lane_ran(self) -> None:
        reporter = self.session.config.pluginmanager.get_plugin("terminalreporter")
        verdict = f"{self.failed} failed" if self.failed else "passed"
        if reporter is not None:
            reporter.write_line(f"\nfast lane {verdict} in {time.monotonic() - self.began:.0f} s", bold=True)
        if self.failed:
            self.session.shouldstop = "the fast lane failed: the system lane did not run (--lane system runs it)"


class DaemonProcess(spawn.DaemonProcess):
    """An ``hbmd`` subprocess on the host backend (unless told otherwise), logging at debug and checking its
    invariants after every batch of requests (``--check-invariants``: it exits with ``EXIT_INVARIANT_VIOLATED``
    where one does not hold); killed in teardown. It locks its device in its own run directory, so that it meets no
    daemon of another test, another suite or the machine (one of a quick start)."""

    def __init__(self, run_dir: Path, *args: str, backend: str = "host", **launch) -> None:
        super().__init__(run_dir, "--backend", backend, "--log-level", "debug", "--check-invariants",
                         "--device-lock-dir", str(run_dir), *args, **launch)

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
def restartable(start_daemon, run_dir, systemd):
    """Start a daemon that parks its chunks with the systemd stand-in; ``restart(how)`` replaces it."""
    state_dir = run_dir / "state"
    state_dir.mkdir()
    args = ("--budget", "256MiB", "--state-dir", str(state_dir))

    class Restartable:
        daemon = start_daemon(*args, env={"NOTIFY_SOCKET": str(systemd.path)})

        def restart(self, how: str, *more: str):
            if how == "kill":
                self.daemon.kill()
            else:
                assert self.daemon.stop() == 0
            self.daemon = start_daemon(*args, *more, **systemd.relaunch())
            return self.daemon

    return Restartable()


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
