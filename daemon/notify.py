"""systemd's service notification protocol (``sd_notify``), spoken directly.

The service manager passes the address of an ``AF_UNIX`` datagram socket in
``NOTIFY_SOCKET`` (a path, or an abstract name written with a leading ``@``).
Each datagram is a newline-separated list of ``KEY=value`` states:
``READY=1`` once the daemon serves (``Type=notify``), ``WATCHDOG=1``
keep-alives when the unit sets ``WatchdogSec=``, ``STOPPING=1`` on shutdown,
``STATUS=`` for ``systemctl status``, and ``FDSTORE=1`` with file
descriptors attached (``SCM_RIGHTS``) to park them with the manager across a
restart. Outside systemd (no ``NOTIFY_SOCKET``) every call does nothing.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Mapping, Sequence

log = logging.getLogger("hbmd.notify")

SEND_TIMEOUT_S = 1
"""Seconds a notification may block the daemon's loop while the manager's queue is full."""
MAX_STATUS_CHARS = 1024
"""systemd drops a whole datagram over its 4 KiB read buffer, READY=1 included; a status is cut well short of that."""
MAX_FDS_PER_MESSAGE = 253
"""The kernel's limit on descriptors in one ``SCM_RIGHTS`` message (``SCM_MAX_FD``)."""
MAX_FDNAME_CHARS = 255


def parse_notify_socket(value: str | None) -> bytes | None:
    """The socket address named by a ``NOTIFY_SOCKET`` value, or None when unset or unusable."""
    if not value:
        return None
    if value.startswith("@"):
        return b"\0" + os.fsencode(value[1:])
    if value.startswith("/"):
        return os.fsencode(value)
    log.warning("NOTIFY_SOCKET=%r is neither an absolute path nor an abstract name; not notifying systemd", value)
    return None


def watchdog_interval_from(environ: Mapping[str, str]) -> float | None:
    """Seconds between keep-alives asked for by ``WATCHDOG_USEC``/``WATCHDOG_PID``, or None for none."""
    try:
        period_us = int(environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if period_us <= 0:
        return None
    pid = environ.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                # The keep-alives are another process's duty: we inherited the service's environment.
                return None
        except ValueError:
            return None
    # Half the period, as sd_watchdog_enabled advises: one late ping must not kill the daemon.
    return period_us / 2e6


def check_fdname(name: str) -> None:
    """Raise ``ValueError`` unless systemd accepts ``name`` as an ``FDNAME``."""
    if not name or len(name) > MAX_FDNAME_CHARS:
        raise ValueError(f"FD store name must be 1 to {MAX_FDNAME_CHARS} characters, got {len(name)}")
    if any(not (0x20 <= ord(c) < 0x7F) or c == ":" for c in name):
        raise ValueError(f"FD store name {name!r} must be printable ASCII without ':'")


def _status_value(text: str) -> str:
    # A newline would start a new state: a status text must never smuggle in READY=1 or the like.
    return " ".join(text.splitlines())[:MAX_STATUS_CHARS]


class SystemdNotifier:
    """Tells the service manager about the daemon's life: ready, alive, stopping, and FDs to keep."""

    def __init__(
        self,
        address: bytes | None,
        watchdog_interval: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``address``: the notify socket (None: do nothing); ``watchdog_interval``: seconds between keep-alives."""
        self.address = address
        self.watchdog_interval = watchdog_interval if address is not None else None
        self._clock = clock
        self._last_keepalive: float | None = None
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> SystemdNotifier:
        """A notifier for what the service manager put in the environment (``os.environ`` by default)."""
        env = os.environ if environ is None else environ
        address = parse_notify_socket(env.get("NOTIFY_SOCKET"))
        return cls(address, watchdog_interval_from(env) if address is not None else None)

    @property
    def enabled(self) -> bool:
        """Whether a service manager is listening (``NOTIFY_SOCKET`` was set)."""
        return self.address is not None

    def ready(self, status: str = "serving") -> None:
        """Report start-up complete: the sockets are bound and clients may connect."""
        self._send(f"READY=1\nSTATUS={_status_value(status)}")

    def reloading(self) -> None:
        """Report that a configuration reload has begun; :meth:`ready` reports it finished."""
        self._send(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def stopping(self, status: str = "stopping") -> None:
        """Report that shutdown has begun, so the manager does not mistake it for a crash."""
        self._send(f"STOPPING=1\nSTATUS={_status_value(status)}")

    def status(self, text: str) -> None:
        """Set the one-line status ``systemctl status`` shows."""
        self._send(f"STATUS={_status_value(text)}")

    def watchdog(self) -> None:
        """Send a keep-alive if the watchdog is on and one is due; cheap enough to call every loop turn."""
        if self.watchdog_interval is None:
            return
        now = self._clock()
        if self._last_keepalive is not None and now - self._last_keepalive < self.watchdog_interval:
            return
        self._last_keepalive = now
        self._send("WATCHDOG=1")

    def send_fds(self, fds: Sequence[int], name: str) -> bool:
        """Park ``fds`` with the manager under ``name``; they come back to the next run of the service.

        The manager receives duplicates: the caller keeps, and still closes,
        its own descriptors. Returns whether every batch was sent (the unit
        must also set ``FileDescriptorStoreMax=`` high enough, or systemd
        closes what does not fit). Raises ``ValueError`` for a name systemd
        would refuse.
        """
        check_fdname(name)
        if self.address is None or not fds:
            return False
        for start in range(0, len(fds), MAX_FDS_PER_MESSAGE):
            if not self._send(f"FDSTORE=1\nFDNAME={name}", fds[start : start + MAX_FDS_PER_MESSAGE]):
                return False
        return True

    def remove_fds(self, name: str) -> None:
        """Drop every descriptor parked under ``name`` (``FDSTOREREMOVE=1``). Raises ``ValueError`` for a bad name."""
        check_fdname(name)
        self._send(f"FDSTOREREMOVE=1\nFDNAME={name}")

    def close(self) -> None:
        """Close the socket; later calls open a new one."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _send(self, state: str, fds: Sequence[int] = ()) -> bool:
        if self.address is None:
            return False
        payload = state.encode("utf-8", "replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # SO_SNDTIMEO, not settimeout(): the kernel sleeps until the queue drains; Python would spin.
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
            if fds:
                # Not socket.send_fds(): on Python 3.11 it drops its address argument.
                rights = (socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))
                self._sock.sendmsg([payload], [rights], 0, self.address)
            else:
                self._sock.sendto(payload, self.address)
        except OSError as exc:
            # A lost notification must never take the daemon down; a restarted manager may listen again later.
            where = "@" + os.fsdecode(self.address[1:]) if self.address.startswith(b"\0") else os.fsdecode(self.address)
            if not self._warned:
                self._warned = True
                log.warning("notifying systemd at %s failed: %s (further failures logged at debug level)", where, exc)
            else:
                log.debug("notifying systemd at %s failed: %s", where, exc)
            return False
        return True


SD_LISTEN_FDS_START = 3


def listen_fds(environ: dict[str, str] | None = None) -> dict[str, list[int]]:
    """The descriptors the service manager passed at start (``LISTEN_FDS``), by ``FDNAME``.

    Only when ``LISTEN_PID`` names this process; the variables are then
    removed so children do not take the FDs for theirs. The FDs are marked
    close-on-exec.
    """
    env = os.environ if environ is None else environ
    try:
        if int(env.get("LISTEN_PID", "")) != os.getpid():
            return {}
        count = int(env.get("LISTEN_FDS", ""))
    except ValueError:
        return {}
    names = env.get("LISTEN_FDNAMES", "").split(":") if env.get("LISTEN_FDNAMES") else []
    for key in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        env.pop(key, None)
    found: dict[str, list[int]] = {}
    for i in range(count):
        fd = SD_LISTEN_FDS_START + i
        os.set_inheritable(fd, False)
        found.setdefault(names[i] if i < len(names) else "unknown", []).append(fd)
    return found
