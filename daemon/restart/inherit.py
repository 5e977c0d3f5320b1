"""What a starting daemon takes from those before it: the state, chunks and listening sockets of the daemon it takes
over from (``--takeover``), or what the service manager kept and passed (the FD store, socket activation)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from hbmd.proto import PROTOCOL_VERSION
from hbmd.proto.instance import InstancePaths

from ..backends import A, C
from ..notify import SystemdNotifier
from ..server.listening import ListeningSocketError, ListeningSockets, named
from ..state import State
from .persist import Persistence, unpack_image
from .restore import NewerState, restore
from .takeover import HANDOVER_TIMEOUT_S, Handover, NothingToTakeOver, TakeoverError, take_over

log = logging.getLogger("hbmd.daemon")


class Refusal(Exception):
    """The daemon must not start: ``message`` says why, ``exit_code`` is 1 (cannot serve) or 2 (usage)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def take_over_from_predecessor(
    args: argparse.Namespace, state: State[A, C], paths: InstancePaths
) -> tuple[Handover, ListeningSockets | None] | None:
    """Take the state, chunks and listening sockets of the daemon serving the instance (the state into ``state``);
    None where none serves, no sockets where it gave none (a daemon older than handing them over). Raises
    :class:`Refusal` where it refuses or fails: it then serves on, and this daemon must not start."""
    # Ready before the old daemon stops: what this one still has to start (NVML's first query) would be the clients'
    # pause otherwise.
    state.backend.free_bytes()
    try:
        handover = take_over(paths.takeover, PROTOCOL_VERSION[0], HANDOVER_TIMEOUT_S)
    except NothingToTakeOver as exc:
        log.info("--takeover: %s; starting afresh", exc)
        return None
    except TakeoverError as exc:
        raise Refusal(f"--takeover: {exc}", 1) from None
    listening = None
    try:
        listening = ListeningSockets.adopt(handover.fds, paths, f"the daemon taken over from (pid {handover.peer_pid})")
        image = unpack_image(bytes(handover.state))
        sessions, buffers = restore(state, image, handover.fds, args.resume_timeout)
    except Exception as exc:  # the old daemon serves on: whatever went wrong here must not end both
        if listening is not None:
            listening.close()
        handover.abandon()
        raise Refusal(f"--takeover: what was handed over cannot be taken ({exc}); pid {handover.peer_pid} serves on",
                      1) from None
    log.info("took over from pid %d: %d sessions (resuming within %gs), %d buffers, %s", handover.peer_pid, sessions,
             args.resume_timeout, buffers, "its listening sockets" if listening else "no listening sockets")
    return handover, listening


def passed_sockets(passed: dict[str, list[int]], paths: InstancePaths) -> ListeningSockets | None:
    """The listening sockets the service manager passed (socket activation), taken out of ``passed``; None where it
    passed none. Raises :class:`Refusal` where they are not this instance's, closing them."""
    try:
        fds = named(passed)
    except ListeningSocketError as exc:
        raise Refusal(str(exc), 1) from None
    for name in fds:
        del passed[name]
    try:
        return ListeningSockets.adopt(fds, paths, "the service manager")
    except ListeningSocketError as exc:
        raise Refusal(f"socket activation: {exc}", 1) from None


def persistence(
    args: argparse.Namespace, state: State[A, C], notifier: SystemdNotifier, passed: dict[str, list[int]],
    taken_over: bool,
) -> Persistence | None:
    """Journal the state and park every chunk with systemd, restoring what an earlier run parked (``passed``, the FD
    store's; ``taken_over``: the state came from the daemon taken over, and is parked and journaled afresh); None
    without a state directory or a service manager, and then the FDs passed in are closed."""
    if not (args.state_dir and notifier.enabled):
        if args.state_dir:
            log.warning("--state-dir %s: no service manager to keep the chunks (NOTIFY_SOCKET is not set), so nothing "
                        "is journaled: a stop or a crash loses every buffer. Run under systemd (deploy/hbmd@.service), "
                        "or upgrade with --takeover", args.state_dir)
        for fd in (fd for fds in passed.values() for fd in fds):
            os.close(fd)
        return None
    kept = Persistence(state, notifier, Path(args.state_dir) / f"{state.backend.instance}.journal", args.resume_timeout)
    if taken_over:
        kept.start_afresh(passed)
        return kept
    try:
        sessions, buffers = kept.restore(passed)
    except NewerState as exc:
        raise Refusal(f"the journal {kept.journal.path} cannot be restored: {exc}", 1) from None
    log.info("every chunk is parked with the service manager; restored: %d sessions (resuming within %gs), %d buffers",
             sessions, args.resume_timeout, buffers)
    return kept


def inherited_sockets(
    from_predecessor: ListeningSockets | None, from_manager: ListeningSockets | None
) -> ListeningSockets | None:
    """The sockets to serve on: the predecessor's where it gave them (the manager's, if any, are the same sockets
    passed again, and are closed), else the manager's."""
    if from_predecessor is not None and from_manager is not None:
        from_manager.close()
    return from_predecessor if from_predecessor is not None else from_manager
