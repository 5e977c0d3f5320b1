"""Where a daemon instance puts its sockets: the contract clients find it by.

``<run_dir>/<instance>/control.sock`` is the ZeroMQ control endpoint,
``handles.sock`` the Unix ``SOCK_SEQPACKET`` handle plane, ``instance.json``
what the instance serves (backend, GPU UUID and index, pid). The instance is
``host`` for the host backend and ``gpu<N>`` for the GPU with index N.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

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
    def endpoint(self) -> str:
        return f"ipc://{self.control}"

    def check_lengths(self) -> None:
        """Raise ``ValueError`` if a socket path does not fit ``sun_path``."""
        for path in (self.control, self.handles):
            if len(os.fsencode(path)) > SUN_PATH_MAX:
                raise ValueError(
                    f"socket path {path} is {len(os.fsencode(path))} bytes, over the "
                    f"{SUN_PATH_MAX}-byte Unix socket limit: choose a shorter run directory"
                )


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
    for info in resolve_run_dir(run_dir).glob("*/instance.json"):
        try:
            published = json.loads(info.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(published, dict) and published.get("pid") == pid:
            return str(published.get("instance", info.parent.name))
    return None
