"""The instance directory, opened so that nobody else can steer what the daemon writes.

The daemon often runs as root, and the run directory may sit where other
users can create entries (``/tmp``, a shared ``/run``). Everything it writes
there must therefore land in a directory only it can change:

- every ancestor of the run directory, and the run directory itself, belongs
  to root or to the daemon's user and is writable by nobody else, or is
  sticky (like ``/tmp``: others cannot rename or remove what is not theirs);
- the instance directory belongs to the daemon's user and is writable by it
  alone (``--group`` gets read and search, mode 0750), checked on an open
  descriptor taken without following a link;
- files are made relative to that descriptor with ``O_NOFOLLOW | O_EXCL`` and
  their mode and group are set on the open descriptor, so no link planted
  beforehand is ever followed.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path

from hbmd.proto.undo import Undo

from .state.credentials import KEY_BYTES

log = logging.getLogger("hbmd.daemon")

DIRECTORY_MODE = 0o750
RESUME_KEY = "resume.key"
RESUME_LINE = "resume.line"


class RunDirectoryError(OSError):
    """The run or instance directory is unusable, or could be changed by someone else; the message says which and
    how."""


def _trusted_owner(st: os.stat_result) -> bool:
    return st.st_uid in (0, os.geteuid())


def _writable_by_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)) and not st.st_mode & stat.S_ISVTX


def _prefixes(path: Path) -> list[Path]:
    return [*reversed(path.parents), path]


def check_ancestors(run_dir: Path) -> Path:
    """The run directory, resolved, once it and every directory above it are safe; raises :class:`RunDirectoryError`.

    Both the path as given and the path it resolves to are checked: a link
    on the way (``/var/run`` to ``/run``) must belong to root or to the
    daemon's user too, since whoever owns it could point it elsewhere.
    """
    given = Path(os.path.abspath(run_dir))
    resolved = Path(os.path.realpath(run_dir))
    for directory in dict.fromkeys((*_prefixes(given), *_prefixes(resolved))):
        try:
            st = os.stat(directory, follow_symlinks=False)
        except OSError as exc:
            raise RunDirectoryError(f"run directory {run_dir}: {directory}: {exc.strerror}") from None
        if not _trusted_owner(st):
            raise RunDirectoryError(
                f"run directory {run_dir}: {directory} belongs to uid {st.st_uid}, not to root or to this daemon's "
                f"uid {os.geteuid()}"
            )
        if stat.S_ISLNK(st.st_mode):
            continue  # where it leads is among the resolved path's directories
        if not stat.S_ISDIR(st.st_mode):
            raise RunDirectoryError(f"run directory {run_dir}: {directory} is not a directory")
        if _writable_by_others(st):
            raise RunDirectoryError(
                f"run directory {run_dir}: {directory} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}) "
                "and not sticky"
            )
    return resolved


def open_instance_directory(directory: Path, group: int | None) -> int:
    """A descriptor of the instance directory, made if missing, and checked.

    Missing parents are made with mode 0755. The instance directory must be
    this daemon's user's own and writable by it alone; ``group`` (the
    ``--group``) gets it with mode 0750. Raises :class:`RunDirectoryError`.
    """
    try:
        os.makedirs(directory.parent, mode=0o755, exist_ok=True)
    except FileExistsError:
        raise RunDirectoryError(f"run directory {directory.parent} is not a directory") from None
    except OSError as exc:
        raise RunDirectoryError(f"run directory {directory.parent}: {exc.strerror}") from None
    parent = check_ancestors(directory.parent)
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            os.mkdir(directory.name, DIRECTORY_MODE, dir_fd=parent_fd)
        except FileExistsError:
            pass
        try:
            fd = os.open(directory.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd)
        except OSError as exc:
            raise RunDirectoryError(
                f"instance directory {directory} is not a directory of its own: {exc.strerror}"
            ) from None
    finally:
        os.close(parent_fd)
    with Undo() as undo:
        undo.push(os.close, fd)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise RunDirectoryError(
                f"instance directory {directory} belongs to uid {st.st_uid}, not to this daemon's uid {os.geteuid()}: "
                "remove it, or choose another --run-dir"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise RunDirectoryError(
                f"instance directory {directory} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}): "
                "what is in it cannot be trusted; remove it, or choose another --run-dir"
            )
    return _own(fd, DIRECTORY_MODE, group)


def create_file(dir_fd: int, name: str, mode: int, group: int | None) -> int:
    """A new regular file ``name`` in ``dir_fd`` (a stale one is replaced), never through a link; returns its
    descriptor."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    return _own(fd, mode, group)


def _own(fd: int, mode: int, group: int | None) -> int:
    """Give the open ``fd`` its ``mode`` and ``--group``, on the descriptor (no path a link could redirect); closes it
    on failure."""
    with Undo() as undo:
        undo.push(os.close, fd)
        if group is not None:
            os.fchown(fd, -1, group)
        os.fchmod(fd, mode)
    return fd


def resume_key(dir_fd: int, name: str = RESUME_KEY) -> bytes:
    """The instance's key for resume credentials (``state/credentials.py``), kept in file ``name`` of the instance
    directory across runs: mode 0600, this daemon's own. Made anew where it is missing or is not a plain file of ours
    of :data:`KEY_BYTES` bytes, and then credentials of earlier runs start no session over."""
    key = _read_own(dir_fd, name, KEY_BYTES + 1, private=True)
    if key is not None and len(key) == KEY_BYTES:
        return key
    key = secrets.token_bytes(KEY_BYTES)
    fd = create_file(dir_fd, name, 0o600, None)
    try:
        os.write(fd, key)
    finally:
        os.close(fd)
    return key


def pass_line(dir_fd: int, line: str, name: str = RESUME_LINE) -> str:
    """The line of daemons (``state/credentials.py``) the daemon before this one belonged to, as file ``name`` of the
    instance directory says (empty where it says nothing readable), and ``line`` written there in its place, for the
    next: mode 0600, this daemon's own, replaced without following a link. Where it cannot be written, the next daemon
    starts no session of this line over after a cold restart, which is the safe side."""
    data = _read_own(dir_fd, name, 64, private=False)
    last = data.decode("ascii", "replace").strip() if data is not None else ""
    try:
        fd = create_file(dir_fd, name, 0o600, None)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        log.warning("cannot write %s in the instance directory (%s): after a cold restart, no session of this run "
                    "starts over", name, exc.strerror or exc)
    return last


def _read_own(dir_fd: int, name: str, most: int, private: bool) -> bytes | None:
    """Up to ``most`` bytes of file ``name`` of the instance directory, where it is a plain file of this daemon's own
    (no link followed, no second name; ``private``: readable by nobody else), else None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st, data = os.fstat(fd), os.read(fd, most)
    finally:
        os.close(fd)
    ours = stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1
    return data if ours and not (private and st.st_mode & 0o077) else None


def open_lock(dir_fd: int, name: str) -> int:
    """The instance's lock file, kept across runs: opened without following a link, and checked to be a plain file of
    ours."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640, dir_fd=dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise RunDirectoryError(f"lock file {name} is not a plain file of this daemon's own")
    return fd
