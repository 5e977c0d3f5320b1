"""Fixtures: a real ``hbmd`` subprocess on the host backend in a short temp dir, and worker processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from hbmd.client import Client, connect
from hbmd.proto.layout import instance_published_by

PROCESS_TIMEOUT_S = 60


class DaemonProcess:
    """An ``hbmd`` subprocess; every one is killed in teardown."""

    def __init__(
        self,
        run_dir: Path,
        *args: str,
        backend: str = "host",
        env: dict[str, str] | None = None,
        launcher: list[str] | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.run_dir = run_dir
        self.args = ["--backend", backend, "--run-dir", str(run_dir), "--log-level", "debug", *args]
        self.env = dict(os.environ, **(env or {}))
        self.launcher = launcher or []
        self.pass_fds = pass_fds
        self.log_path = run_dir / f"hbmd-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen | None = None
        self.instance = "host" if backend == "host" else None

    def start(self, timeout: float = 20.0) -> "DaemonProcess":
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, *self.launcher, "-m", "hbmd.daemon", *self.args],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, pass_fds=self.pass_fds,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hbmd exited with {self.proc.returncode}:\n{self.log()}")
            instance = instance_published_by(self.run_dir, self.proc.pid)
            if instance is not None:
                self.instance = instance
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"hbmd did not come up in {timeout}s:\n{self.log()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def connect(self, **kwargs) -> Client:
        return connect(run_dir=self.run_dir, instance=self.instance, **kwargs)


@pytest.fixture
def run_dir():
    # Short and under /tmp: socket paths must fit in 108 bytes.
    path = Path(tempfile.mkdtemp(prefix="hbmd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


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


@pytest.fixture
def daemon(start_daemon):
    """A host-backend daemon with a 256 MiB budget."""
    return start_daemon("--budget", "256MiB")


@pytest.fixture
def client(daemon):
    c = daemon.connect(client_name="test")
    yield c
    c.close()


class Worker:
    """A Python worker process running ``code`` against the daemon; killed in teardown."""

    def __init__(self, daemon: DaemonProcess, code: str) -> None:
        env = dict(os.environ, HBMD_RUN_DIR=str(daemon.run_dir), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def readline(self, timeout: float = PROCESS_TIMEOUT_S) -> str:
        """The worker's next line of stdout (workers print one line per step)."""
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"worker printed nothing in {timeout}s; stderr: {self.stderr_tail()}")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait(5)}: {self.stderr_tail()}")
        return line.strip()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stderr_tail(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read()[-2000:]

    def wait(self, timeout: float = PROCESS_TIMEOUT_S) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


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
