"""Instance discovery: where a daemon instance puts its sockets, and what it publishes there.

``<run_dir>/<instance>/control.sock`` is the ZeroMQ control endpoint,
``handles.sock`` the Unix ``SOCK_SEQPACKET`` handle plane, ``instance.json``
an :class:`InstanceInfo` saying what the instance serves (backend, GPU UUID
and index, pid). The instance is ``host`` for the host backend and
``gpu<N>`` for the GPU with index N.
"""

from __future__ import annotations

import dataclasses
import json
import os
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


def gpu_instance(index: int) -> str:
    return f"gpu{index}"


@dataclasses.dataclass(frozen=True)
class InstancePaths:
    directory: Path

    @classmethod
    def of(cls, run_dir: str | os.PathLike | None, instance: str) -> "InstancePaths":
        return cls(resolve_run_dir(run_dir) / instance)

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
    def from_json(cls, text: str) -> "InstanceInfo":
        """Parse ``instance.json``; ``ValueError`` when it is not one (unknown keys are ignored)."""
        data: Any = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("instance.json is not an object")
        try:
            return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})
        except KeyError as exc:
            raise ValueError(f"instance.json has no {exc.args[0]!r}") from None

    @classmethod
    def read(cls, path: str | os.PathLike) -> "InstanceInfo | None":
        """The info at ``path``, or None where it is missing or unreadable."""
        try:
            return cls.from_json(Path(path).read_text())
        except (OSError, ValueError):
            return None


def list_instances(run_dir: str | os.PathLike | None) -> list[str]:
    """Instances with a published ``instance.json`` under the run directory, sorted."""
    root = resolve_run_dir(run_dir)
    try:
        entries = sorted(p.name for p in root.iterdir() if (p / "instance.json").is_file())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    return entries


def instance_published_by(run_dir: str | os.PathLike | None, pid: int) -> str | None:
    """The instance whose ``instance.json`` names process ``pid``: the daemon's ready signal."""
    for path in resolve_run_dir(run_dir).glob("*/instance.json"):
        info = InstanceInfo.read(path)
        if info is not None and info.pid == pid:
            return info.instance
    return None
