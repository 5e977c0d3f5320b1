"""Opening a session: the daemon instance that serves a device, and the process's default client for it."""

from __future__ import annotations

import os
from typing import Any

from hbmd.proto.instance import InstancePaths, list_instances, resolve_run_dir

from .devices import parse_device
from .mapper import Mapper
from .session import DEFAULT_TIMEOUT_S, Client


def instance_for(device: Any, run_dir: str | os.PathLike | None) -> str:
    """The instance that serves ``device`` under ``run_dir``."""
    kind, index = parse_device(device)
    if kind == "cpu":
        return "host"
    from hbmd.driver import CudaUnavailable

    from .cuda import instance_for_cuda_device

    try:
        return instance_for_cuda_device(index, run_dir)
    except CudaUnavailable as exc:
        # A host instance may well be what this user meant to reach: its device is "cpu".
        if "host" not in list_instances(run_dir):
            raise
        raise CudaUnavailable(
            f"{exc}; an hbmd host instance serves under {resolve_run_dir(run_dir)}: device 'cpu' uses it"
        ) from None


def connect(
    device: Any = None,
    run_dir: str | os.PathLike | None = None,
    *,
    instance: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    client_name: str = "",
    tenant: str | None = None,
    observer: bool = False,
    mapper: Mapper | None = None,
    lease: bool = True,
    resume_timeout: float | None = None,
) -> Client:
    """Open a session with the daemon serving ``device`` (or the named ``instance``: ``gpu0``, ``host``, ...).

    ``run_dir`` defaults to ``$HBMD_RUN_DIR``, then ``/run/hbmd``; ``tenant``
    to ``$HBMD_TENANT``, then none; ``resume_timeout`` to
    ``$HBMD_RESUME_TIMEOUT``, then 30 s (see :class:`Client`). Raises
    :class:`DaemonUnavailable` when nothing answers there.
    """
    if instance is None:
        instance = instance_for(device, run_dir)
    paths = InstancePaths.of(run_dir, instance)
    return Client(
        paths, timeout=timeout, client_name=client_name, tenant=tenant, observer=observer, mapper=mapper, lease=lease,
        resume_timeout=resume_timeout,
    )


_defaults: dict[tuple[str, str], Client] = {}


def default_client(device: Any) -> Client:
    """The process-wide client for ``device``'s instance, connected on first use, and again after fork or once the
    daemon came back without its session (the next tensor gets a new session, not ``SessionLost``)."""
    instance = instance_for(device, None)
    key = (os.fspath(resolve_run_dir(None)), instance)
    client = _defaults.get(key)
    if client is None or client.closed or client.forked or (client.lost and not client.resumed()):
        if client is not None and not client.closed and not client.forked:
            client.close()
        client = _defaults[key] = connect(instance=instance)
    return client
