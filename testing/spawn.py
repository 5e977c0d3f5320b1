"""Start an ``hbmd`` subprocess and wait until it serves: the one way tests, benchmarks and examples do it.

Also the helper processes they drive line by line (:class:`LineProcess`).
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TypeVar

from hbmd.proto.instance import instance_published_by

T = TypeVar("T")

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
LINE_TIMEOUT_S = 60.0


def ended(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie its parent has not reaped yet has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def wait_until(predicate: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    """Poll ``predicate`` until it returns a truthy value, and return it; ``TimeoutError`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout}s")
        time.sleep(interval)


class DaemonProcess:
    """An ``hbmd`` subprocess serving under ``run_dir``, its output in a log file.

    ``args`` are the daemon's options (``--run-dir`` is added); ``command``
    replaces ``python -m hbmd.daemon`` (a wrapper such as a stand-in service
    manager). ``pid_namespace``: the daemon runs in a pid namespace of its own
    (``unshare --pid``), as in a container, where it sees every client as pid
    0 and itself as pid 1. Where util-linux's ``setpriv`` is installed, the
    daemon gets SIGTERM when the thread that started it dies, so a test
    process that crashes leaves no daemon behind. :meth:`start` returns once
    ``instance.json`` names the process (the daemon's ready signal);
    :meth:`stop` sends SIGTERM and kills after a hard timeout. As a context
    manager it starts and stops.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *args: str,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
        log_path: str | os.PathLike | None = None,
        pid_namespace: bool = False,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.command = [*(command or [sys.executable, "-m", "hbmd.daemon"]), "--run-dir", str(self.run_dir), *args]
        if pid_namespace:
            self.command = ["unshare", "--pid", "--fork", "--kill-child", *self.command]
        if shutil.which("setpriv"):
            self.command = ["setpriv", "--pdeathsig", "TERM", *self.command]
        self.pid_namespace = pid_namespace
        self.env = {**os.environ, **(env or {})}
        self.pass_fds = pass_fds
        self.log_path = Path(log_path) if log_path else self.run_dir / f"hbmd-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen | None = None
        self.instance = ""

    def start(self, timeout: float = START_TIMEOUT_S) -> DaemonProcess:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        started = time.time_ns()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, pass_fds=self.pass_fds
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hbmd exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            instance = self._published(started)
            if instance is not None:
                self.instance = instance
                return self
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"hbmd did not publish its instance within {timeout:.0f}s:\n{self.log()[-4000:]}")

    def _published(self, started: int) -> str | None:
        """The instance this daemon published, once it has; ``started``: when it was started (``time.time_ns``)."""
        if not self.pid_namespace:
            return instance_published_by(self.run_dir, self.proc.pid if self.proc else 0)
        # Every daemon in a namespace of its own is its pid 1: only a file written since this one started is its.
        instance = instance_published_by(self.run_dir, 1)
        if instance is None or (self.run_dir / instance / "instance.json").stat().st_mtime_ns < started:
            return None
        return instance

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the daemon was not started")
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status (negative: killed by that signal)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            if self.pid_namespace:  # unshare passes no signal on: the daemon is its child
                children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
                for child in children:
                    os.kill(int(child), signal.SIGTERM)
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def __enter__(self) -> DaemonProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def lines_of(stream: IO[str], name: str) -> queue.Queue[str | None]:
    """A text stream's lines, read by a thread (``name``) onto a queue, None at the stream's end: a wait for a line
    can have a deadline however silent the writer, and a line already read into Python's buffer is waiting there,
    where a ``select`` on the pipe would not see it."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name=name, daemon=True).start()
    return lines


class LineProcess:
    """A Python helper process driven by lines: commands on its stdin, one line of stdout per step."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        """``argv``: the interpreter's arguments (a script and its options, or ``-c CODE``); ``env`` is added."""
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        assert self.proc.stdout is not None  # stdout=PIPE
        self._lines = lines_of(self.proc.stdout, f"stdout of pid {self.proc.pid}")

    def readline(self, timeout: float = LINE_TIMEOUT_S) -> str:
        """The next line it prints, stripped. ``TimeoutError`` (and the process killed) when none comes in time,
        ``RuntimeError`` when it exited instead; both with the end of its stderr."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise TimeoutError(f"pid {self.proc.pid} printed nothing in {timeout:.0f}s: {self.stderr_tail()}") from None
        if line is None:
            self._lines.put(None)  # for the next call too
            raise RuntimeError(f"pid {self.proc.pid} exited with {self.proc.wait(5)}: {self.stderr_tail()}")
        return line.strip()

    def rest(self, timeout: float = LINE_TIMEOUT_S) -> list[str]:
        """Every line it prints from here to the end of its output (its exit, and that of any child of it that
        holds its stdout), stripped; ``TimeoutError`` where that end does not come in time."""
        deadline = time.monotonic() + timeout
        lines: list[str] = []
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"pid {self.proc.pid}'s output did not end in {timeout:.0f}s") from None
            if line is None:
                self._lines.put(None)
                return lines
            lines.append(line.strip())

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None  # stdin=PIPE
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stderr_tail(self) -> str:
        """The end of its stderr once it has exited ("(still running)" before)."""
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stderr is not None  # stderr=PIPE
        return self.proc.stderr.read()[-3000:]

    def wait(self, timeout: float = LINE_TIMEOUT_S) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
