"""One daemon per GPU, and one host-memory daemon per node, whatever their run directories.

The instance directory's own lock keeps two daemons from serving one
instance directory, but two daemons of one GPU started with two run
directories (a second unit, a test left running, a container beside the
host's daemon) would each admit the whole card, and two host daemons each
their budget of the same RAM. So a daemon also locks what it serves, by the
GPU's UUID (``gpu-<UUID>``) or as host memory (``host``), in two ways:

- by name: it binds the abstract Unix socket ``@hbmd-lock:<DIR>/<KEY>.lock``.
  Any process may bind one, root or not, and the kernel frees the name when
  the process ends, so every daemon takes it; the daemons of one network
  namespace see it. It listens, and tells whoever connects who holds it:
  the kernel says the holder's pid and uid (``SO_PEERCRED``), the holder its
  run directory (:meth:`DeviceLock.answer`, from the server's loop).
- by file: ``<DIR>/<KEY>.lock``, where ``DIR`` (``--device-lock-dir``,
  default ``/run/hbmd``: systemd's runtime directory and the DaemonSet's
  host path, writable by the service's user only) can be used; daemons of
  other network namespaces that share the directory (containers) see it
  too. The holder writes its pid, uid and run directory there. A user's own
  daemon, which cannot write ``/run/hbmd``, goes without
  (:attr:`DeviceLock.unshared` says why).

Locks of different directories never meet: tests, and pools kept apart on
purpose, name their own. Any local user can take a name first and keep the
daemon from starting: the refusal names its pid and uid.

The server takes it with the instance directory's lock and lets it go
first, so a successor (``--takeover``) waits for it as for the instance,
and a predecessor whose successor failed takes it back.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import struct
from pathlib import Path

MAX_RECORD = 4096
"""The most of a holder's record read back: a pid, a uid and a path."""
MAX_NAME = 107
"""The longest abstract socket name: ``sun_path`` less its leading NUL."""
ASK_TIMEOUT_S = 1.0
"""How long a daemon refused waits for the holder to say its run directory (the holder's loop answers between
requests); the pid and uid need no answer."""
PEER_CRED = struct.Struct("3i")
"""``struct ucred``: pid, uid, gid."""


class DeviceTaken(RuntimeError):
    """Another daemon serves this GPU (or this node's host memory): the message names it."""


class DeviceLock:
    """The lock of one GPU, or of host memory (``device_uuid`` empty): :meth:`acquire` it before serving,
    :meth:`release` it once this daemon serves no more."""

    def __init__(self, directory: str | os.PathLike, device_uuid: str) -> None:
        key = f"gpu-{device_uuid}" if device_uuid else "host"
        self.path = Path(os.path.abspath(directory)) / f"{key}.lock"
        self.device_uuid = device_uuid
        name = f"hbmd-lock:{self.path}"
        if len(os.fsencode(name)) > MAX_NAME:
            name = f"hbmd-lock:{hashlib.sha256(os.fsencode(self.path.parent)).hexdigest()[:32]}/{key}.lock"
        self.name = name
        self.unshared = ""
        """Why the lock is by name only (the directory cannot be used); "" where the file is held too."""
        self._fd = -1
        self._socket: socket.socket | None = None
        self._record = b""

    @property
    def held(self) -> bool:
        return self._socket is not None

    def fileno(self) -> int:
        """The listening socket, for the server's poll: readable when another daemon asks who holds the lock."""
        assert self._socket is not None, "the lock is not held"
        return self._socket.fileno()

    def acquire(self, run_dir: str | os.PathLike) -> None:
        """Take the lock and record this daemon in it.

        Raises :class:`DeviceTaken` naming the holder (a successor waits for
        its predecessor by trying again, as for the instance), or ``OSError``
        where the name cannot be bound at all.
        """
        self._record = f"{os.getpid()} {os.geteuid()} {os.path.abspath(run_dir)}\n".encode()
        fd = self._lock_file()
        try:
            self._socket = self._bind_name()
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        self._fd = fd

    def answer(self) -> None:
        """Tell every daemon that connected which run directory holds the lock, and hang up."""
        assert self._socket is not None, "the lock is not held"
        while True:
            try:
                peer, _ = self._socket.accept()
            except BlockingIOError:
                return
            with peer, contextlib.suppress(OSError):  # one that left meanwhile is owed nothing
                peer.setblocking(False)
                peer.send(self._record)

    def release(self) -> None:
        """Let the GPU go (the file stays: removing it would race the next daemon's open). Idempotent."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _lock_file(self) -> int:
        """The lock file, locked and holding this daemon's record; -1 (and :attr:`unshared` saying why) where its
        directory cannot be used, or a link was planted where it goes."""
        try:
            # The lock directory is shared by every daemon of the node, whatever its run directory; /run is a tmpfs,
            # so the first daemon since boot makes it.
            os.makedirs(self.path.parent, mode=0o755, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            self.unshared = f"{self.path}: {exc.strerror or exc}"
            return -1
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DeviceTaken(self._refusal(*self._read_record(fd), str(self.path))) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, self._record, 0)
        except BaseException:
            os.close(fd)
            raise
        self.unshared = ""
        return fd

    def _bind_name(self) -> socket.socket:
        """The abstract socket bound and listening; :class:`DeviceTaken` where another process holds the name."""
        address = b"\0" + os.fsencode(self.name)
        # A holder that lets go between our bind and our connect leaves the name free: try it again.
        for _ in range(3):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
            try:
                sock.bind(address)
            except OSError as exc:
                sock.close()
                if exc.errno != errno.EADDRINUSE:
                    raise
                holder = self._ask_holder(address)
                if holder is None:
                    continue
                raise DeviceTaken(self._refusal(*holder, f"@{self.name}")) from None
            sock.listen(16)
            return sock
        raise DeviceTaken(self._refusal("?", "?", "?", f"@{self.name}"))

    def _ask_holder(self, address: bytes) -> tuple[str, str, str] | None:
        """The pid, uid and run directory of the process holding the name; None where it let go meanwhile."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(ASK_TIMEOUT_S)
            try:
                sock.connect(address)
            except ConnectionRefusedError:
                return None
            except OSError:
                return "?", "?", "?"
            pid, uid, _ = PEER_CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CRED.size))
            try:
                told = sock.recv(MAX_RECORD)
            except OSError:
                told = b""
        _, _, run_dir = self._parse(told)
        # The kernel's pid is this daemon's view of it (0 where the holder is outside its pid namespace).
        return str(pid) if pid else "?", str(uid), run_dir

    def _read_record(self, fd: int) -> tuple[str, str, str]:
        try:
            return self._parse(os.pread(fd, MAX_RECORD, 0))
        except OSError as exc:
            return "?", "?", f"unreadable: {errno.errorcode.get(exc.errno or 0, exc)}"

    @staticmethod
    def _parse(record: bytes) -> tuple[str, str, str]:
        """pid, uid and run directory of a record; an older daemon's record has no uid."""
        pid, _, rest = record.decode(errors="replace").strip().partition(" ")
        uid, _, run_dir = rest.partition(" ")
        if not uid.isdigit():
            uid, run_dir = "?", rest
        return pid or "?", uid or "?", run_dir or "?"

    def _refusal(self, pid: str, uid: str, run_dir: str, lock: str) -> str:
        held = f"already served by hbmd pid {pid} (uid {uid}, run directory {run_dir}; lock {lock})"
        if self.device_uuid:
            return (f"GPU {self.device_uuid} is {held}: one daemon per GPU, or both would admit the whole card. Stop "
                    "that one, or replace it with --takeover on its run directory")
        return (f"host memory is {held}: one host daemon per node, or each would admit its budget of the same RAM. "
                "Stop that one, replace it with --takeover on its run directory, or give this one an --instance-name "
                "of its own to serve a second host pool on purpose")
