"""The instance's two listening sockets, held by the daemon so that they outlive the daemon that listens on them.

The control socket (``control.sock``, where clients' ZeroMQ DEALERs connect
as ``ipc://`` and the daemon speaks ZMTP itself, :mod:`.control_socket`) and
the handle socket (``handles.sock``) are bound here, so the daemon holds both
listening descriptors. It hands them to a successor (``hbmd --takeover``) or
is given them by the service manager (socket activation, ``LISTEN_FDNAMES``
``control.sock`` and ``handles.sock``); the planes accept on them and stopping
closes only their connections. While no daemon accepts, a client's connect
waits in the socket's backlog instead of being refused, as with HAProxy's
``-x``, nginx's binary upgrade and Envoy's hot restart.

What is handed over or passed in is checked before it is served on: a
listening Unix socket of the right type, bound at this instance's path.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from hbmd.proto.instance import InstancePaths
from hbmd.proto.undo import Undo

log = logging.getLogger("hbmd.server")

CONTROL = "control.sock"
HANDLES = "handles.sock"
"""The sockets' names, in a takeover's FDs and in ``LISTEN_FDNAMES`` (the socket units' ``FileDescriptorName=``): their
files' names, which no chunk's FD-store name (``c`` and base-36 digits) can be."""


class ListeningSocketError(ValueError):
    """A descriptor handed over or passed in as a listening socket is not this instance's; the message says why."""


def _file_of(path: Path) -> tuple[int, int]:
    """The device and inode of the socket file at ``path``: which socket a connect to it reaches."""
    st = os.stat(path, follow_symlinks=False)
    if not stat.S_ISSOCK(st.st_mode):
        raise ListeningSocketError(f"{path} is not a socket")
    return st.st_dev, st.st_ino


class ListeningSockets:
    """The control socket (``SOCK_STREAM``) and the handle socket (``SOCK_SEQPACKET``) of one instance, listening."""

    def __init__(self, paths: InstancePaths, control: socket.socket, handles: socket.socket, owned: bool) -> None:
        self.paths = paths
        self.control = control
        self.handles = handles
        self.owned = owned
        """Whether this daemon removes their files when it stops: not while a daemon it took them from may serve on
        them again, never when the service manager made them."""
        self._files = {path: _file_of(path) for path in (paths.control, paths.handles)}

    @classmethod
    def serve(
        cls, held: ListeningSockets | None, paths: InstancePaths, directory_fd: int, group: int | None
    ) -> ListeningSockets:
        """The sockets to serve on once the instance's lock is taken: ``held`` (handed over, passed in, or this
        daemon's before a handover that failed) where a connect to their paths still reaches them, else new ones,
        bound in place of whatever files are left there, that ``group`` (the ``--group``) may connect to."""
        if held is not None and held.in_place():
            return held
        if held is not None:
            # A successor that failed bound its own there meanwhile (one older than handing them over).
            log.warning("the listening sockets at %s were replaced meanwhile: binding them anew", paths.directory)
            held.close()
        for path in (paths.control, paths.handles):
            try:
                os.unlink(path.name, dir_fd=directory_fd)
            except FileNotFoundError:
                pass
        with Undo() as undo:
            control = _listen(paths.control, socket.SOCK_STREAM, group)
            undo.push(control.close)
            handles = _listen(paths.handles, socket.SOCK_SEQPACKET, group)
            undo.push(handles.close)
            return cls(paths, control, handles, owned=True)

    @classmethod
    def adopt(cls, fds: MutableMapping[str, int], paths: InstancePaths, origin: str) -> ListeningSockets | None:
        """The sockets ``origin`` passed in ``fds`` (taken out of it: each FD is this object's, or closed), checked;
        None where it passed neither (a daemon older than this handover, or no socket units).

        Raises :class:`ListeningSocketError`, having closed them, where only
        one came, or one is not a listening Unix socket of its type bound at
        this instance's path.
        """
        control_fd, handles_fd = fds.pop(CONTROL, -1), fds.pop(HANDLES, -1)
        if control_fd < 0 and handles_fd < 0:
            return None
        with Undo() as undo:
            for fd in (control_fd, handles_fd):
                if fd >= 0:
                    undo.push(os.close, fd)
            if control_fd < 0 or handles_fd < 0:
                raise ListeningSocketError(f"{origin} passed the {CONTROL if control_fd >= 0 else HANDLES} socket "
                                           "alone: both or neither")
            _check(control_fd, socket.SOCK_STREAM, paths.control, origin)
            _check(handles_fd, socket.SOCK_SEQPACKET, paths.handles, origin)
        control, handles = _served(control_fd), _served(handles_fd)
        try:
            return cls(paths, control, handles, owned=False)
        except (OSError, ListeningSocketError) as exc:
            control.close()
            handles.close()
            raise ListeningSocketError(f"{origin} passed sockets whose files are not in place: {exc}") from None

    def in_place(self) -> bool:
        """Whether a connect to each path still reaches this socket: no other daemon has bound one there since."""
        try:
            return all(_file_of(path) == file for path, file in self._files.items())
        except (OSError, ListeningSocketError):
            return False

    def named_fds(self) -> list[tuple[str, int]]:
        """Both listening FDs by name, for a successor; they stay this object's."""
        return [(CONTROL, self.control.fileno()), (HANDLES, self.handles.fileno())]

    def close(self, directory_fd: int = -1) -> None:
        """Close both; with ``directory_fd`` (the instance directory's, its lock held), remove their files too where
        they are this daemon's and still in place."""
        if directory_fd >= 0 and self.owned and self.in_place():
            for path in self._files:
                os.unlink(path.name, dir_fd=directory_fd)
        self.control.close()
        self.handles.close()


def _listen(path: Path, kind: int, group: int | None) -> socket.socket:
    """A socket of ``kind`` listening at ``path``, which the ``--group`` may connect to (mode 0660, its group)."""
    sock = socket.socket(socket.AF_UNIX, kind | socket.SOCK_CLOEXEC)
    with Undo() as undo:
        undo.push(sock.close)
        sock.bind(os.fspath(path))
        # Set on the path just bound in the daemon's own directory, where nobody else could have put a link in its
        # place; before it listens, so that nobody connects through a looser mode in between.
        os.chmod(path, 0o660)
        if group is not None:
            os.chown(path, -1, group)
        sock.listen(socket.SOMAXCONN)  # a burst of connections, or a restart's worth, must not turn clients away
        sock.setblocking(False)
    return sock


def _check(fd: int, kind: int, path: Path, origin: str) -> None:
    """Raise :class:`ListeningSocketError` unless ``fd`` is a listening Unix socket of ``kind`` bound at ``path``;
    ``fd`` stays open either way."""
    what = f"{origin} passed FD {fd} as {path.name}"
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise ListeningSocketError(f"{what}: not a socket")
        probe = socket.socket(fileno=fd)
    except OSError as exc:
        raise ListeningSocketError(f"{what}: {exc.strerror or exc}") from None
    try:
        listening = probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        if probe.family != socket.AF_UNIX or probe.type != kind or not listening:
            raise ListeningSocketError(f"{what}: not a listening Unix {_kind_name(kind)} socket")
        bound = probe.getsockname()
        if bound != os.fspath(path):
            raise ListeningSocketError(f"{what}: bound at {bound!r}, not at {os.fspath(path)!r}")
    finally:
        probe.detach()


def _served(fd: int) -> socket.socket:
    """A checked listening ``fd`` as this daemon's socket: not inherited by children, and never blocking the loop."""
    os.set_inheritable(fd, False)
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return sock


def _kind_name(kind: int) -> str:
    return "SOCK_STREAM" if kind == socket.SOCK_STREAM else "SOCK_SEQPACKET"


def named(passed: Mapping[str, list[int]]) -> dict[str, int]:
    """The listening sockets among the FDs the service manager passed (``LISTEN_FDNAMES``), one per name; raises
    :class:`ListeningSocketError` for a name passed more than once (closing none: they are the caller's still)."""
    found = {}
    for name in (CONTROL, HANDLES):
        fds = passed.get(name, [])
        if len(fds) > 1:
            raise ListeningSocketError(f"the service manager passed {len(fds)} sockets named {name}: one, please")
        if fds:
            found[name] = fds[0]
    return found
