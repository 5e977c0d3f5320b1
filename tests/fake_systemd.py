"""A stand-in for systemd's notify socket and file-descriptor store, behaving as systemd does for hbmd."""

from __future__ import annotations

import array
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

MAX_FDS = 253

# Runs as the relaunched daemon's first program: puts the stored FDs at 3, 4, ... and
# sets LISTEN_PID to its own pid, which exec keeps, exactly as systemd does. The FDs and
# their names come in a file (a store of thousands would not fit an argument); the names
# go on in LISTEN_FDNAMES, so that a list too long for execve fails as it does for systemd.
LAUNCHER = """
import json, os, sys
with open(sys.argv[1]) as passed:
    fds, names = json.load(passed)
os.unlink(sys.argv[1])
# In order of their numbers, each FD moves down to 3, 4, ...: the i-th is at 3 + i or above, so a
# move never lands on one not moved yet, and no more FDs are open at once than were passed.
pairs = sorted(zip(fds, names))
for i, (fd, _) in enumerate(pairs):
    if fd != 3 + i:
        os.dup2(fd, 3 + i)
        os.close(fd)
names = [name for _, name in pairs]
os.environ.update(LISTEN_FDS=str(len(pairs)), LISTEN_FDNAMES=":".join(names), LISTEN_PID=str(os.getpid()))
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


class FakeSystemd:
    """Receives READY/STOPPING/WATCHDOG and keeps FDSTORE descriptors by FDNAME until FDSTOREREMOVE."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.store: dict[str, list[int]] = {}
        self.states: list[str] = []
        self.times: list[float] = []
        """When each of :attr:`states` came (``time.monotonic``)."""
        self.lock = threading.Lock()
        self._handled = threading.Condition(self.lock)
        """Notified as each barrier is read: :meth:`barrier` waits on it."""
        self._barriers = 0
        """How many barriers were sent, and (below) the last one read: a barrier is numbered, never stored."""
        self._barriers_handled = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        fd_bytes = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
        while not self._stop.is_set():
            try:
                data, ancdata, _, _ = self.sock.recvmsg(4096, fd_bytes)
            except TimeoutError:
                continue
            fds: list[int] = []
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(array.array("i", payload[: len(payload) - len(payload) % 4]))
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            with self.lock:
                if "BARRIER" in fields:
                    self._barriers_handled = int(fields["BARRIER"])
                    self._handled.notify_all()
                    continue
                self.states.append(data.decode())
                self.times.append(time.monotonic())
                name = fields.get("FDNAME", "stored")
                if fields.get("FDSTORE") == "1":
                    self.store.setdefault(name, []).extend(fds)
                    continue
                if fields.get("FDSTOREREMOVE") == "1":
                    for fd in self.store.pop(name, []):
                        os.close(fd)
                for fd in fds:
                    os.close(fd)

    def barrier(self, timeout: float = 10.0) -> None:
        """Return once every message sent to the stand-in before this call is handled: a datagram is queued when
        its send returns, and the queue is read in order, so a message of our own sent last comes back last. A test
        that checks what the stand-in did not receive waits for this, not for a guess at how long a message takes."""
        with self.lock:
            self._barriers += 1
            barrier = self._barriers
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sender:
            sender.sendto(f"BARRIER={barrier}".encode(), str(self.path))
        with self.lock:
            if not self._handled.wait_for(lambda: self._barriers_handled >= barrier, timeout):
                raise TimeoutError(f"the systemd stand-in did not read its barrier within {timeout}s")

    def names(self) -> set[str]:
        with self.lock:
            return set(self.store)

    def saw(self, state: str) -> bool:
        with self.lock:
            return any(state in message.splitlines() for message in self.states)

    def arrivals(self, state: str, since: float = 0.0) -> list[float]:
        """When each message saying ``state`` came, from ``since`` on (``time.monotonic``)."""
        with self.lock:
            return [at for at, message in zip(self.times, self.states) if at >= since and state in message.splitlines()]

    def drop_store(self) -> None:
        """Close every stored FD, as systemd does when the service is stopped (``systemctl stop``) rather than
        restarted, unless ``FileDescriptorStorePreserve=yes``."""
        with self.lock:
            for fds in self.store.values():
                for fd in fds:
                    os.close(fd)
            self.store.clear()

    def relaunch(self) -> dict:
        """Keyword arguments for ``start_daemon`` that pass the stored FDs back, as on a restart."""
        with self.lock:
            pairs = [(name, fd) for name, fds in sorted(self.store.items()) for fd in fds]
        fds = [fd for _, fd in pairs]
        passed = self.path.with_name(f"passed-{time.monotonic_ns()}.json")
        passed.write_text(json.dumps([fds, [name for name, _ in pairs]]))
        return {
            "env": {"NOTIFY_SOCKET": str(self.path)},
            "command": [sys.executable, "-c", LAUNCHER, str(passed), "-m", "hbmd.daemon"],
            "pass_fds": tuple(fds),
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()
        self.drop_store()
