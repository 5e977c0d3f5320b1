"""Restarts that refuse no connect: the listening sockets outlive the daemon that listens on them.

A daemon taken over hands its control and handle sockets to its successor
with the chunks, and one started by the service manager serves on the
sockets it was passed (socket activation). A connect made while no daemon
accepts waits in the socket's backlog for the next one, where it used to be
refused (issue #53, item 3).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest
from fake_systemd import LAUNCHER
from hbmd.client.transport import HandleChannel
from hbmd.daemon.restart.takeover import take_over
from hbmd.daemon.server.listening import CONTROL, HANDLES
from hbmd.proto import PROTOCOL_VERSION, Hello, Welcome
from hbmd.proto.instance import InstancePaths
from hbmd.testing.restarts import CallsInALoop, Reconnects
from helpers import MiB, wait_until

pytestmark = pytest.mark.ipc


def paths_of(daemon) -> InstancePaths:
    return InstancePaths.of(daemon.run_dir, daemon.instance)


def socket_files(paths: InstancePaths) -> list[tuple[int, int]]:
    """Which sockets a connect to the instance's paths reaches: the device and inode of each file."""
    return [(st.st_dev, st.st_ino) for st in (os.stat(paths.control), os.stat(paths.handles))]


def connect_raw(path, kind: int) -> socket.socket:
    """A plain connect, as a client's first step: refused (ECONNREFUSED, ENOENT) where nothing listens."""
    sock = socket.socket(socket.AF_UNIX, kind)
    sock.settimeout(5)
    sock.connect(os.fspath(path))
    return sock


def settled_fds(daemon, timeout: float = 5.0) -> int:
    """The daemon's descriptor count once it holds still: it closes a connection its client hung up on a turn later."""
    deadline = time.monotonic() + timeout
    count = daemon.open_fds()
    while time.monotonic() < deadline:
        time.sleep(0.2)
        count, before = daemon.open_fds(), count
        if count == before:
            return count
    raise TimeoutError(f"the daemon's descriptors did not settle within {timeout}s")


@pytest.mark.system
def test_a_client_calling_through_a_takeover_is_never_refused_a_connect(start_daemon, monkeypatch):
    first = start_daemon("--budget", "64MiB")
    files = socket_files(paths_of(first))
    client = first.connect(lease=False)
    buffer = client.create_buffer(8 * MiB)
    with client.commit(buffer.buffer_id, 4 * MiB):
        pass
    with Reconnects(client.paths) as reconnects:
        calls = CallsInALoop(client)
        try:
            wait_until(lambda: len(calls.answered_at) > 10)
            second = start_daemon("--budget", "64MiB", "--takeover")
            assert first.proc.wait(10) == 0
            wait_until(lambda: "session 1 resumed" in second.log())
            answered = len(calls.answered_at)
            wait_until(lambda: len(calls.answered_at) > answered + 10)
        finally:
            calls.stop()
    assert calls.failures == []
    assert reconnects.refused == 0  # it waited in the backlog instead
    assert "its listening sockets" in second.log()
    assert socket_files(paths_of(second)) == files  # the very sockets, not new ones at the same paths
    assert client.status().committed_bytes == 4 * MiB
    client.close()


@pytest.mark.system
def test_a_connect_while_nobody_accepts_waits_and_is_served_next(start_daemon):
    daemon = start_daemon("--budget", "64MiB")
    paths = paths_of(daemon)
    files = socket_files(paths)
    with daemon.connect() as client:
        client.status()  # what a first status opens (the host backend's /proc/meminfo) stays open
    fds_before = settled_fds(daemon)
    for turn in range(1, 4):
        handover = take_over(paths.takeover, PROTOCOL_VERSION[0], 5)  # a successor that takes all, then fails
        assert {CONTROL, HANDLES} <= set(handover.fds)
        # The old daemon accepts nothing now: a connect waits in the backlog, on either socket.
        control = connect_raw(paths.control, socket.SOCK_STREAM)
        handles = HandleChannel(paths, 5)
        handover.abandon()
        welcome = handles.handshake(Hello(list(PROTOCOL_VERSION), os.getpid(), observer=True))
        assert isinstance(welcome, Welcome)  # served by the daemon that accepted next: the old one, serving on
        handles.close()
        control.close()
        wait_until(lambda: daemon.log().count("did not take over: serving on") == turn)
    assert daemon.alive()
    assert socket_files(paths) == files  # it serves on its own sockets again
    with daemon.connect() as client:
        assert client.status().num_sessions == 1
    # Each failed takeover left nothing open: the router's duplicate, the connections and the handover's FDs closed.
    wait_until(lambda: daemon.open_fds() == fds_before, timeout=5)


@pytest.mark.system
def test_the_successor_holds_no_descriptor_more_than_the_daemon_it_took_over_from(start_daemon):
    first = start_daemon("--budget", "64MiB")
    client = first.connect(lease=False)
    buffer = client.create_buffer(8 * MiB)
    with client.commit(buffer.buffer_id, 4 * MiB):
        pass
    client.status()  # what a first status opens (the host backend's /proc/meminfo) stays open
    held = settled_fds(first)
    second = start_daemon("--budget", "64MiB", "--takeover")
    assert first.proc.wait(10) == 0
    wait_until(lambda: "session 1 resumed" in second.log())
    client.status()
    wait_until(lambda: second.open_fds() == held, timeout=5)
    client.close()


def activated(run_dir, instance: str = "host") -> tuple[InstancePaths, list[socket.socket]]:
    """The instance's two sockets bound and listening, as the service manager's socket units make them."""
    paths = InstancePaths.of(run_dir, instance)
    paths.directory.mkdir(mode=0o750)
    sockets = []
    for path, kind in ((paths.control, socket.SOCK_STREAM), (paths.handles, socket.SOCK_SEQPACKET)):
        sock = socket.socket(socket.AF_UNIX, kind)
        sock.bind(os.fspath(path))
        sock.listen(16)
        sockets.append(sock)
    return paths, sockets


def launched_with(run_dir, named: dict[str, socket.socket]) -> dict:
    """``start_daemon`` keywords that pass ``named`` sockets as systemd does (``LISTEN_FDS``, ``LISTEN_FDNAMES``)."""
    passed = run_dir / f"passed-{time.monotonic_ns()}.json"
    passed.write_text(json.dumps([[sock.fileno() for sock in named.values()], list(named)]))
    return {"command": [sys.executable, "-c", LAUNCHER, str(passed), "-m", "hbmd.daemon"],
            "pass_fds": tuple(sock.fileno() for sock in named.values())}


def test_a_daemon_started_with_its_sockets_serves_on_them_and_leaves_them_to_the_manager(start_daemon, run_dir):
    paths, (control, handles) = activated(run_dir)
    files = socket_files(paths)
    daemon = start_daemon("--budget", "64MiB", **launched_with(run_dir, {CONTROL: control, HANDLES: handles}))
    with daemon.connect() as client:
        assert client.status().budget_bytes == 64 * MiB
    assert socket_files(paths) == files
    assert daemon.stop() == 0
    assert socket_files(paths) == files  # the manager's, not the daemon's to remove
    # Nobody accepts now, and a connect still waits for the next start instead of being refused.
    connect_raw(paths.control, socket.SOCK_STREAM).close()


@pytest.mark.parametrize("wrong", ["swapped", "elsewhere", "one only"])
def test_sockets_passed_that_are_not_the_instances_are_refused(start_daemon, run_dir, wrong):
    _, (control, handles) = activated(run_dir)
    if wrong == "swapped":
        named = {CONTROL: handles, HANDLES: control}
    elif wrong == "elsewhere":
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(os.fspath(run_dir / "elsewhere.sock"))
        other.listen(1)
        named = {CONTROL: other, HANDLES: handles}
    else:
        named = {HANDLES: handles}
    with pytest.raises(RuntimeError, match="hbmd exited with 1") as refused:
        start_daemon("--budget", "64MiB", **launched_with(run_dir, named))
    why = {"swapped": "not a listening Unix SOCK_STREAM socket", "elsewhere": "elsewhere.sock",
           "one only": "alone: both or neither"}[wrong]
    assert why in str(refused.value)
