"""What a benchmark or a test of restarts watches from a client's side: its calls' answers, and its reconnects."""

from __future__ import annotations

import os
import threading
import time

from hbmd.client import Client, recovery
from hbmd.client.transport import HandleChannel
from hbmd.proto.errors import DaemonUnavailable
from hbmd.proto.instance import InstancePaths


class CallsInALoop:
    """``status()`` over and over on a thread, as an engine's calls would come: the longest gap between two answers is
    the pause it sees."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.failures: list[Exception] = []
        self.answered_at = [time.monotonic()]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.client.status()
            except Exception as exc:  # what a call raised is what the caller counts
                self.failures.append(exc)
            self.answered_at.append(time.monotonic())

    def stop(self) -> list[float]:
        """The gaps between answers, in seconds."""
        self._stop.set()
        self._thread.join(30)
        return [b - a for a, b in zip(self.answered_at, self.answered_at[1:])]


class Reconnects:
    """The client's reconnects to the handle socket while it resumes, counted from its side: the connects the kernel
    refused (no socket file, or nobody listening behind it), the seconds from the first refused one to the next that
    got through, and the seconds it then waited for the welcome. Installed in place of the ``HandleChannel`` its
    recovery opens; only the connects to ``paths`` (an instance's) count, not another client's of the process."""

    def __init__(self, paths: InstancePaths) -> None:
        self.paths = paths
        self.refused = 0
        self.refused_s = 0.0
        self.welcome_wait_s = 0.0
        self._first_refused: float | None = None

    def __enter__(self) -> Reconnects:
        counts = self

        class CountedHandleChannel(HandleChannel):
            def __init__(self, paths, timeout: float) -> None:
                counted = paths == counts.paths
                try:
                    super().__init__(paths, timeout)
                except DaemonUnavailable as exc:
                    if counted and exc.details.get("not_running"):
                        counts.refused_one()
                    raise
                if counted:
                    counts.got_through()

            def handshake(self, hello):
                started = time.monotonic()
                try:
                    return super().handshake(hello)
                finally:
                    if self.path == os.fspath(counts.paths.handles):
                        counts.welcome_wait_s += time.monotonic() - started

        # The name the client's restart path looks the channel up by, not one it exports: swapped for the count.
        recovery.HandleChannel = CountedHandleChannel  # type: ignore[attr-defined]
        return self

    def __exit__(self, *exc: object) -> None:
        recovery.HandleChannel = HandleChannel  # type: ignore[attr-defined]

    def refused_one(self) -> None:
        self.refused += 1
        if self._first_refused is None:
            self._first_refused = time.monotonic()

    def got_through(self) -> None:
        if self._first_refused is not None:
            self.refused_s += time.monotonic() - self._first_refused
            self._first_refused = None

    def figures(self) -> dict:
        return {"refused_connects": self.refused, "refused_connects_s": round(self.refused_s, 3),
                "welcome_wait_s": round(self.welcome_wait_s, 3)}
