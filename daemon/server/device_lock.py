"""One daemon per GPU, whatever its run directory: a lock keyed by the GPU's UUID.

The instance directory's own lock keeps two daemons from serving one
instance directory, but two daemons of one GPU started with two run
directories (a second unit, a test left running, a container beside the
host's daemon) would each admit the whole card. So a CUDA daemon also holds
``gpu-<UUID>.lock`` in one directory every daemon of the node shares
(``--device-lock-dir``, default ``/run/hbmd``: systemd's runtime directory
and the DaemonSet's host path, writable by the service's user only, so no
other user can take the name first). The holder writes its pid and run
directory there, so a refusal names the daemon that serves.

The server takes it with the instance directory's lock and lets it go
first, so a successor (``--takeover``) waits for it as for the instance,
and a predecessor whose successor failed takes it back. Where the directory
cannot be used at all (a user's own daemon with no access to
``/run/hbmd``), the daemon serves without it and says so.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

MAX_RECORD = 4096
"""The most of a holder's record read back: a pid and a path."""


class DeviceTaken(RuntimeError):
    """Another daemon serves this GPU: the message names it."""


class DeviceLock:
    """The lock of one GPU: :meth:`acquire` it before serving, :meth:`release` it once this daemon serves no more."""

    def __init__(self, directory: str | os.PathLike, device_uuid: str) -> None:
        self.path = Path(directory) / f"gpu-{device_uuid}.lock"
        self.device_uuid = device_uuid
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self, run_dir: str | os.PathLike) -> None:
        """Take the lock and record this daemon in it.

        Raises :class:`DeviceTaken` naming the holder (a successor waits for
        its predecessor by trying again, as for the instance), or ``OSError``
        where the lock file cannot be opened (the caller decides whether to
        serve without it).
        """
        # The lock directory is shared by every daemon of the node, whatever its run directory; /run is a tmpfs, so
        # the first daemon since boot makes it.
        os.makedirs(self.path.parent, mode=0o755, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DeviceTaken(self._taken_by(fd)) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()} {os.path.abspath(run_dir)}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Let the GPU go (the file stays: removing it would race the next daemon's open). Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _taken_by(self, fd: int) -> str:
        try:
            pid, _, run_dir = os.pread(fd, MAX_RECORD, 0).decode(errors="replace").strip().partition(" ")
        except OSError as exc:
            pid, run_dir = "?", f"unreadable: {errno.errorcode.get(exc.errno or 0, exc)}"
        return (f"GPU {self.device_uuid} is already served by hbmd pid {pid or '?'} (run directory {run_dir or '?'}; "
                f"lock {self.path}): one daemon per GPU, or both would admit the whole card. Stop that one, or "
                "replace it with --takeover on its run directory")
