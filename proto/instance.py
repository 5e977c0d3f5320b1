"""Instance discovery: where a daemon instance puts its sockets, and what it publishes there.

``<run_dir>/<instance>/control.sock`` is the ZeroMQ control endpoint,
``handles.sock`` the Unix ``SOCK_SEQPACKET`` handle plane, ``instance.json``
an :class:`InstanceInfo` saying what the instance serves (backend, GPU UUID
and index, pid). The instance is ``host`` for the host backend and
``gpu<N>`` for the GPU with index N.
"""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import pwd
import stat
from pathlib import Path
from typing import Any

from hbmd import __version__

VERSION = __version__
"""The installed hbmd's version: what the daemon reports and both CLIs print."""

DEFAULT_RUN_DIR = "/run/hbmd"
RUN_DIR_ENV = "HBMD_RUN_DIR"
SUN_PATH_MAX = 107
"""``sun_path`` holds 108 bytes including the terminating NUL."""


def resolve_run_dir(run_dir: str | os.PathLike | None) -> Path:
    """The argument, else ``$HBMD_RUN_DIR``, else ``/run/hbmd``."""
    return Path(run_dir or os.environ.get(RUN_DIR_ENV) or DEFAULT_RUN_DIR)


def run_dir_origin(run_dir: str | os.PathLike | None) -> str:
    """Which run directory :func:`resolve_run_dir` chose, why, and how to choose another: what a message saying that
    no daemon is there must add, since the daemon may well be serving under another one."""
    source = "as given" if run_dir else f"from ${RUN_DIR_ENV}" if os.environ.get(RUN_DIR_ENV) else "the default"
    return (f"run directory {resolve_run_dir(run_dir)}, {source}; choose another with --run-dir, "
            f"run_dir= in Python, or ${RUN_DIR_ENV}")


def access_denied(path: str | os.PathLike) -> str:
    """Why this process may not reach ``path`` and what would let it: the nearest directory above it (or ``path``
    itself) that it can see, with its owner, group and mode."""
    blocking = Path(path)
    while True:
        try:
            st = os.stat(blocking)
            break
        except PermissionError:
            blocking = blocking.parent
        except OSError:
            return f"permission denied on {path}"
    user, group = _user_name(st.st_uid), _group_name(st.st_gid)
    who = "root" if user == "root" else f"{user} or root"
    if st.st_gid == 0:
        # Nobody should join group root to reach a daemon: it was started without --group.
        return (
            f"permission denied: {blocking} is {user}:{group} {stat.filemode(st.st_mode)}: the daemon was started "
            f"without --group, so only {who} may connect; start it with --group GROUP (the unit's default is hbmd) "
            "and add this user to that group, or run as " + who
        )
    return (
        f"permission denied: {blocking} is {user}:{group} {stat.filemode(st.st_mode)}, for its owner and group only: "
        f"add this user to group {group} (sudo usermod -aG {group} $USER, effective at the next login) or run as {who}"
    )


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def gpu_instance(index: int) -> str:
    return f"gpu{index}"


@dataclasses.dataclass(frozen=True)
class InstancePaths:
    directory: Path
    origin: str = dataclasses.field(default="", compare=False)
    """Where the run directory came from and how to choose another (:func:`run_dir_origin`), for messages."""

    @classmethod
    def of(cls, run_dir: str | os.PathLike | None, instance: str) -> InstancePaths:
        return cls(resolve_run_dir(run_dir) / instance, run_dir_origin(run_dir))

    @property
    def control(self) -> Path:
        return self.directory / "control.sock"

    @property
    def handles(self) -> Path:
        return self.directory / "handles.sock"

    @property
    def info(self) -> Path:
        return self.directory / "instance.json"

    @property
    def lock(self) -> Path:
        return self.directory / "lock"

    @property
    def takeover(self) -> Path:
        """Where a daemon hands its state over to its successor (``hbmd --takeover``); its own user's only."""
        return self.directory / "takeover.sock"

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.control}"

    def check_lengths(self) -> None:
        """Raise ``ValueError`` if a socket path does not fit ``sun_path``."""
        for path in (self.control, self.handles, self.takeover):
            if len(os.fsencode(path)) > SUN_PATH_MAX:
                raise ValueError(
                    f"socket path {path} is {len(os.fsencode(path))} bytes, over the "
                    f"{SUN_PATH_MAX}-byte Unix socket limit: choose a shorter run directory"
                )


@dataclasses.dataclass(frozen=True)
class InstanceInfo:
    """The contents of ``instance.json``: a running instance, as clients and tools find it.

    ``device_index`` is -1 and ``device_uuid`` empty on the host backend.
    The daemon writes it last, once it serves: its presence naming a live
    pid is the ready signal.
    """

    instance: str
    backend: str
    device_index: int
    device_uuid: str
    pid: int
    protocol: list[int]
    daemon_version: str
    control: str
    handles: str

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> InstanceInfo:
        """Parse ``instance.json``; ``ValueError`` when it is not one (unknown keys are ignored)."""
        data: Any = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("instance.json is not an object")
        try:
            return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})
        except KeyError as exc:
            raise ValueError(f"instance.json has no {exc.args[0]!r}") from None

    @classmethod
    def read(cls, path: str | os.PathLike) -> InstanceInfo | None:
        """The info at ``path``, or None where it is missing or unreadable."""
        try:
            return cls.from_json(Path(path).read_text())
        except (OSError, ValueError):
            return None


def list_instances(run_dir: str | os.PathLike | None) -> list[str]:
    """Instances with a published ``instance.json`` under the run directory, sorted."""
    return scan_instances(run_dir)[0]


def scan_instances(run_dir: str | os.PathLike | None) -> tuple[list[str], list[Path]]:
    """The instances under the run directory (as :func:`list_instances`), and the paths there this process was denied:
    the run directory where it cannot be listed, else each instance's ``instance.json`` it may not see (an instance
    directory of a daemon whose group this user is not in)."""
    root = resolve_run_dir(run_dir)
    try:
        entries = sorted(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    except PermissionError:
        return [], [root]
    found, denied = [], []
    for entry in entries:
        try:
            if (entry / "instance.json").is_file():
                found.append(entry.name)
        except PermissionError:
            denied.append(entry / "instance.json")
    return found, denied


def instance_published_by(run_dir: str | os.PathLike | None, pid: int) -> str | None:
    """The instance whose ``instance.json`` names process ``pid``: the daemon's ready signal."""
    for path in resolve_run_dir(run_dir).glob("*/instance.json"):
        info = InstanceInfo.read(path)
        if info is not None and info.pid == pid:
            return info.instance
    return None
