"""``hbmd``: the per-GPU memory daemon's command line."""

from __future__ import annotations

import argparse
import dataclasses
import grp
import logging
import os
import resource
import signal
import sys
import threading
import time
from typing import Any, Generic, NoReturn

from hbmd.proto.instance import VERSION, InstancePaths
from hbmd.proto.units import format_bytes, parse_size

from . import logs
from .backends import A, Backend, C
from .backends.host import GRANULE, HostBackend, host_memory_bytes
from .backends.pool import HOST_PIECE
from .clock import Clock
from .config import Config, ConfigError, load_config
from .notify import SystemdNotifier, listen_fds
from .options import (
    DEFAULT_WARM_CHUNKS,
    EXIT_INVARIANT_VIOLATED,
    HOST_DEFAULT_BUDGET,
    build_parser,
)
from .reload import ConfigReloader
from .restart import inherit
from .restart.inherit import Refusal, inherited_sockets, passed_sockets, take_over_from_predecessor
from .restart.takeover import HANDOVER_TIMEOUT_S, Handover
from .server import AlreadyRunning, HandlerTableError, InvariantViolated, Server
from .server.device_lock import DeviceLock
from .state import Limits, State
from .state.records import Buffer

log = logging.getLogger("hbmd.daemon")

class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message says why."""


def select_backend(
    kind: str, device: int, warm_chunks: int = 0, export_sentinel: bool = True, host_pool_bytes: int = 0,
    host_piece: int = HOST_PIECE, clock: Clock | None = None,
) -> tuple[Backend[Any, Any], str]:
    """The backend named by ``--backend`` and a note on why it was chosen.

    ``auto`` takes CUDA where a driver and the device are usable, else host:
    as expected where no NVIDIA driver is loaded, and said plainly then; as
    a fault to mend where one is.
    """
    if kind == "host":
        return HostBackend(host_pool_bytes, host_piece, clock), "as asked"
    from hbmd.driver import CudaUnavailable, driver_loaded
    from hbmd.proto.errors import HbmdError

    from .backends.cuda import CudaBackend

    try:
        why = "as asked" if kind == "cuda" else "auto: CUDA driver and device found"
        return CudaBackend(device, warm_chunks, export_sentinel, host_pool_bytes, host_piece, clock), why
    except (CudaUnavailable, HbmdError) as exc:
        if kind == "cuda":
            raise BackendUnavailable(f"CUDA backend unusable for GPU {device}: {exc}") from None
        why = f"auto: CUDA unusable: {exc}" if driver_loaded() else "auto: no NVIDIA driver is loaded here"
        return HostBackend(host_pool_bytes, host_piece, clock), why


def raise_fd_limit() -> None:
    """Lift the soft RLIMIT_NOFILE to the hard one: FDs in flight over SCM_RIGHTS count against it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclasses.dataclass
class Daemon(Generic[A, C]):
    """Everything one instance is made of, built and checked before anything is bound."""

    args: argparse.Namespace
    backend: Backend[A, C]
    why: str
    budget: int
    paths: InstancePaths
    notifier: SystemdNotifier
    server: Server[A, C]
    handover: Handover | None = None
    """What the daemon this one takes over from handed over (``--takeover``); told once this one serves."""


def build(args: argparse.Namespace) -> Daemon[Any, Any]:
    """Choose the backend, size the budget, load the config and wire the server; raises :class:`Refusal`.

    The backend is chosen at run time, so its arena and chunk types are
    known only from here on (:func:`_wire`).
    """
    kind, device = _backend_asked(args)
    host_budget, host_pool, host_piece = _host_tier(args)
    clock = Clock()
    try:
        backend, why = select_backend(kind, device, _warm_chunks(args), not args.no_export_sentinel, host_pool,
                                      host_piece, clock)
    except BackendUnavailable as exc:
        named = f"--device {args.device} names a GPU, so host memory is not served instead; " if kind != args.backend \
            else ""
        raise Refusal(named + str(exc), 1) from None
    try:
        if host_budget:
            _check_host_tier(backend)
        return _wire(args, backend, why, clock, host_budget)
    except BaseException:
        backend.close()
        raise


def _backend_asked(args: argparse.Namespace) -> tuple[str, int]:
    """The backend (``auto``, ``cuda`` or ``host``) and GPU index the options ask for; :class:`Refusal` for a GPU
    named to the host backend."""
    if args.backend == "host" and args.device is not None:
        raise Refusal(f"--device {args.device}: the host backend serves host memory, no GPU; leave --device out, or "
                      "serve the GPU with --backend cuda", 2)
    # A GPU named is a GPU meant: auto falls back to host memory only where none was named, or an engine looking
    # for the GPU's daemon would find host memory served under another name.
    kind = "cuda" if args.backend == "auto" and args.device is not None else args.backend
    return kind, 0 if args.device is None else args.device


def _host_tier(args: argparse.Namespace) -> tuple[int, int, int]:
    """``--host-budget``, ``--host-pool`` (within the budget) and ``--host-piece`` in bytes."""
    ram = host_memory_bytes()
    try:
        budget = parse_size(args.host_budget, ram)
        pool = parse_size(args.host_pool, ram)
        piece = parse_size(args.host_piece)
    except ValueError as exc:
        raise Refusal(f"--host-budget/--host-pool/--host-piece: {exc}", 2) from None
    # Both backends' granule is 2 MiB (the CUDA one checks its own before serving a host tier).
    if piece <= 0 or piece % GRANULE:
        raise Refusal(f"--host-piece: {args.host_piece} is not a positive whole number of 2 MiB granules", 2)
    if budget > ram:
        raise Refusal(f"--host-budget: {format_bytes(budget)} is more than the {format_bytes(ram)} of RAM there is", 2)
    if 0 < budget < GRANULE:
        raise Refusal(f"--host-budget: {args.host_budget} admits no demote; give 0 (no host tier) or at least one "
                      f"{format_bytes(GRANULE)} granule", 2)
    return budget, min(pool, budget), piece


def _check_host_tier(backend: Backend[Any, Any]) -> None:
    """Refuse to start with a host tier the backend cannot serve (a CUDA driver without host-NUMA VMM memory)."""
    check = getattr(backend, "check_host_tier", None)
    if check is None:
        return
    from hbmd.proto.errors import HbmdError

    try:
        check()
    except HbmdError as exc:
        raise Refusal(f"--host-budget: {backend.name} cannot serve a host tier here: {exc}", 1) from None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the options and the config file ask of a backend, checked: everything :func:`_wire` needs before it
    makes anything."""

    budget: int
    lease: int
    credit: int
    config: Config
    group: int | None
    limits: Limits


def _settings(args: argparse.Namespace, backend: Backend[Any, Any]) -> Settings:
    """The options and ``--config`` checked against ``backend``; raises :class:`Refusal` (exit 2) naming what is
    wrong."""
    budget = _budget(args, backend)
    lease = _granules_option("--lease", args.lease, backend)
    credit = _granules_option("--credit", args.credit, backend)
    try:
        config = load_config(args.config, backend.total_bytes, budget) if args.config else Config()
    except ConfigError as exc:
        raise Refusal(f"--config: {exc}", 2) from None
    try:
        group = grp.getgrnam(args.group).gr_gid if args.group else None
    except KeyError:
        raise Refusal(f"--group: no group named {args.group!r}", 2) from None
    return Settings(budget, lease, credit, config, group, _limits(args))


def check_config(args: argparse.Namespace) -> int:
    """``--check-config``: check the options and ``--config`` as a start would, serve nothing, and say what they
    set; 0 when a start would take them, 2 (logged) when not, 1 when the backend cannot run here."""
    kind, device = _backend_asked(args)
    _host_tier(args)
    try:
        backend, _ = select_backend(kind, device, export_sentinel=False)
    except BackendUnavailable as exc:
        raise Refusal(str(exc), 1) from None
    try:
        settings = _settings(args, backend)
    finally:
        backend.close()
    tenants = settings.config.tenants
    print(f"{args.config or 'no --config'}: valid for the {backend.name} backend; budget "
          f"{format_bytes(settings.budget)} of {format_bytes(backend.total_bytes)}, {len(tenants)} tenants "
          f"guaranteed {format_bytes(settings.config.guaranteed_bytes)} in all")
    return 0


def _wire(args: argparse.Namespace, backend: Backend[A, C], why: str, clock: Clock, host_budget: int = 0
          ) -> Daemon[A, C]:
    if args.instance_name:
        backend.instance = args.instance_name
    settings = _settings(args, backend)
    budget = settings.budget
    paths = InstancePaths.of(args.run_dir, backend.instance)
    notifier = SystemdNotifier.from_environment()
    state = State(backend, budget, settings.config, args.reclaim_timeout, settings.limits, settings.lease,
                  host_budget_bytes=host_budget, credit_bytes=settings.credit, demote_idle_s=args.demote_idle,
                  clock=clock)
    if args.config:
        state.config_load.path = os.path.abspath(args.config)
        state.config_load.loaded()
    lock = threading.Lock()
    passed = listen_fds()
    from_manager = passed_sockets(passed, paths)
    taken = take_over_from_predecessor(args, state, paths) if args.takeover else None
    handover, from_predecessor = taken if taken is not None else (None, None)
    listening = inherited_sockets(from_predecessor, from_manager)
    persistence = inherit.persistence(args, state, notifier, passed, taken_over=handover is not None)
    metrics = None
    if args.metrics_addr:
        from .metrics import Metrics

        metrics = Metrics(state, lock, VERSION, per_session=args.metrics_sessions)
    try:
        server = Server(
            state, paths, lock=lock, notifier=notifier, group=settings.group, metrics=metrics, persistence=persistence,
            check_invariants=args.check_invariants, resume_window_s=args.resume_timeout,
            device_lock=_device_lock(args, backend),
            listening=listening,
        )
    except HandlerTableError as exc:
        raise Refusal(f"this hbmd build is inconsistent: {exc}", 1) from None
    return Daemon(args, backend, why, budget, paths, notifier, server, handover)


def _device_lock(args: argparse.Namespace, backend: Backend[Any, Any]) -> DeviceLock | None:
    """The lock of what the daemon serves: its GPU, whatever the instance's name; host memory, unless an
    ``--instance-name`` says that this is a second host pool, meant to serve beside the node's."""
    if not backend.device_uuid and args.instance_name:
        return None
    return DeviceLock(args.device_lock_dir, backend.device_uuid)


def _budget(args: argparse.Namespace, backend: Backend[Any, Any]) -> int:
    """The bytes commits may take: ``--budget`` (or the backend's default) less the warm pool and export sentinel."""
    default_budget = HOST_DEFAULT_BUDGET if backend.name == "host" else "100%"
    try:
        budget = parse_size(args.budget or default_budget, backend.total_bytes)
    except ValueError as exc:
        raise Refusal(f"--budget: {exc}", 2) from None
    if budget < backend.granularity:
        raise Refusal(f"--budget: {args.budget} admits nothing; give a positive size of at least one "
                      f"{format_bytes(backend.granularity)} granule", 2)
    if budget > backend.total_bytes:
        raise Refusal(
            f"--budget: {format_bytes(budget)} is more than the {format_bytes(backend.total_bytes)} "
            f"of {backend.name} memory there is", 2,
        )
    held_back = backend.held_back_bytes()
    if held_back > budget:
        raise Refusal(
            f"--warm-chunks: {_warm_chunks(args)} granules and the export sentinel do not fit the budget of "
            f"{format_bytes(budget)}",
            2,
        )
    return budget - held_back  # the warm pool and the sentinel are device memory too: commits get what is left


def _warm_chunks(args: argparse.Namespace) -> int:
    """``--warm-chunks``, or the default where it was left out."""
    return DEFAULT_WARM_CHUNKS if args.warm_chunks is None else args.warm_chunks


def _granules_option(flag: str, value: str, backend: Backend[Any, Any]) -> int:
    """A size option (``--lease``, ``--credit``) in bytes, a whole number of granules."""
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise Refusal(f"{flag}: {exc}", 2) from None
    if size % backend.granularity:
        raise Refusal(f"{flag}: {value} is not a whole number of {format_bytes(backend.granularity)} granules", 2)
    return size


def _limits(args: argparse.Namespace) -> Limits:
    """The per-uid limits of ``--max-sessions-per-uid``, ``--max-persistent-per-uid`` and ``--max-buffers-per-uid``."""
    if args.max_sessions_per_uid < 1:
        raise Refusal(f"--max-sessions-per-uid: {args.max_sessions_per_uid} is not a positive number", 2)
    if args.max_persistent_per_uid < 0:
        raise Refusal(f"--max-persistent-per-uid: {args.max_persistent_per_uid} is negative", 2)
    if args.max_buffers_per_uid < 1:
        raise Refusal(f"--max-buffers-per-uid: {args.max_buffers_per_uid} is not a positive number", 2)
    return Limits(
        sessions_per_uid=args.max_sessions_per_uid,
        persistent_buffers_per_uid=args.max_persistent_per_uid,
        buffers_per_uid=args.max_buffers_per_uid,
    )


def run(daemon: Daemon[A, C]) -> int:
    """Bind, publish, serve until SIGTERM, and clean up; returns the exit code.

    Where ``--check-invariants`` finds an invariant broken it does not
    return: it ends the process (:func:`_exit_on_violation`).
    """
    args, backend, server, notifier = daemon.args, daemon.backend, daemon.server, daemon.notifier
    metrics_url = _bind(daemon)
    if metrics_url is None:
        server.close()
        backend.close()
        return 1
    server.install_signal_handlers()
    ConfigReloader(args.config, server.state, server.lock, notifier).install()
    _announce(daemon, metrics_url)
    server.publish()
    if daemon.handover is not None:
        if not daemon.handover.serving():
            log.warning("the daemon taken over from exited before it heard this one serves")
        server.took_over()
    notifier.ready(f"serving {backend.instance}: {backend.name} backend, budget {format_bytes(daemon.budget)}")
    try:
        server.run()
    except InvariantViolated as exc:
        _exit_on_violation(exc)
    finally:
        notifier.stopping()
        if server.metrics is not None:
            server.metrics.close()
        if not server.handed_over and server.persistence is None:
            _warn_of_what_is_lost(server.state)
        server.close()
        backend.close()
        notifier.close()
    if server.handed_over and args.linger:
        _linger()
    log.info("hbmd stopped")
    return 0


def _warn_of_what_is_lost(state: State[Any, Any]) -> None:
    """Say what a stop gives up of the persistent buffers where nothing keeps the chunks (no FD store, no successor):
    what an operator stopping the daemon may not know.

    A buffer no process maps is lost. One a live session (or a sealed
    buffer's reader) maps stays in that process, which declares it again to
    the next daemon (a cold restart), data and all; but that daemon holds no
    handle to it, so it cannot hand it to another process, and it goes with
    the last process that maps it.
    """
    persistent = [buffer for buffer in state.buffers.by_id.values() if buffer.persistent]
    lost = [buffer for buffer in persistent if buffer.owner is None and not buffer.readers]
    mapped = [buffer for buffer in persistent if buffer.owner is not None or buffer.readers]
    said = []
    if lost:
        said.append(f"{len(lost)} persistent buffers no process maps are lost ({_bytes_of(lost)}, "
                    f"{sum(b.sealed for b in lost)} sealed): {_names_of(lost)}")
    if mapped:
        said.append(f"{len(mapped)} that live processes map stay mapped there ({_bytes_of(mapped)}), declared again "
                    "to the next daemon, but persistent no more: no other process can attach them, and they go with "
                    f"the last process that maps them: {_names_of(mapped)}")
    if said:
        log.warning("stopping with nothing to keep the chunks (no service manager's FD store, no --takeover): %s",
                    "; ".join(said))


def _bytes_of(buffers: list[Buffer[Any, Any]]) -> str:
    return format_bytes(sum(b.physical_bytes for b in buffers))


def _names_of(buffers: list[Buffer[Any, Any]]) -> str:
    return ", ".join(repr(b.name) for b in buffers[:10]) + (" ..." if len(buffers) > 10 else "")


def _linger() -> None:
    """Wait, holding nothing, for SIGTERM or SIGINT (``--linger``)."""
    log.info("handed over: lingering until stopped (--linger)")
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()


def _exit_on_violation(exc: InvariantViolated) -> NoReturn:
    """Log the violation and end the process at once with :data:`EXIT_INVARIANT_VIOLATED`.

    The state is known to be wrong, so nothing more is done through it: no
    session is ended and no chunk released by it (a chunk counted twice
    could have its pages punched under a client that still maps them), and
    nothing is journaled. The kernel closes the sockets and frees what the
    daemon held, as after a crash; the next daemon clears the instance
    directory as it does then.
    """
    log.error("an invariant does not hold: %s; exiting at once with status %d (--check-invariants)",
              exc, EXIT_INVARIANT_VIOLATED)
    logging.shutdown()
    os._exit(EXIT_INVARIANT_VIOLATED)


def _bind(daemon: Daemon[Any, Any]) -> str | None:
    """Bind the server's sockets, and serve its metrics if asked: their URL ("" without), or None (logged) when
    something could not be bound."""
    server = daemon.server
    # The daemon taken over from lets the instance go once it has handed over: a moment after, at most.
    deadline = time.monotonic() + (HANDOVER_TIMEOUT_S if daemon.handover is not None else 0)
    while True:
        try:
            server.bind()
            break
        except AlreadyRunning as exc:
            if time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            log.error("cannot serve %s: %s", daemon.paths.directory, exc)
            return None
        except (ValueError, OSError) as exc:
            log.error("cannot serve %s: %s", daemon.paths.directory, exc)
            return None
    if server.metrics is None:
        return ""
    host, port = daemon.args.metrics_addr
    try:
        server.metrics.serve(host, port, beside_predecessor=daemon.handover is not None)
    except OSError as exc:
        log.error("--metrics-addr %s:%d: %s", host, port, exc)
        return None
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def _announce(daemon: Daemon[Any, Any], metrics_url: str) -> None:
    """The first log line says what serves where; then what the warm pool holds back."""
    args, backend = daemon.args, daemon.backend
    # Host memory where a driver says a GPU may have been expected deserves more than INFO.
    log.log(
        logging.WARNING if daemon.why.startswith("auto: CUDA unusable") else logging.INFO,
        "hbmd %s serving instance %s: backend %s (%s)%s, granule %s, budget %s of %s; control %s, handles %s%s",
        VERSION,
        backend.instance,
        backend.name,
        daemon.why,
        f", {backend.device_uuid}" if backend.device_uuid else "",
        format_bytes(backend.granularity),
        format_bytes(daemon.budget),
        format_bytes(backend.total_bytes),
        daemon.paths.endpoint,
        daemon.paths.handles,
        f", metrics {metrics_url}" if metrics_url else "",
    )
    if daemon.server.state.tenants.host_budget_bytes:
        log.info("host tier: budget %s, up to %s of it made ahead while idle (--host-pool)",
                 format_bytes(daemon.server.state.tenants.host_budget_bytes), args.host_pool)
    held_back = backend.held_back_bytes()
    if held_back:
        log.info("%s of the budget held back for %d warm chunks and the export sentinel",
                 format_bytes(held_back), _warm_chunks(args))
    if backend.name != "cuda" and args.warm_chunks:
        log.warning("--warm-chunks applies to the CUDA backend only; ignored")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logs.configure(args.log_level, args.log_format)
    raise_fd_limit()
    try:
        if args.check_config:
            return check_config(args)
        daemon = build(args)
    except Refusal as exc:
        log.error("%s", exc)
        return exc.exit_code
    return run(daemon)


if __name__ == "__main__":
    sys.exit(main())
