"""sd_notify: a real AF_UNIX datagram socket stands in for systemd and reads what the daemon tells it."""

from __future__ import annotations

import logging
import os
import socket

import pytest
from hbmd.daemon import notify
from hbmd.daemon.notify import (
    MAX_FDS_PER_MESSAGE,
    SystemdNotifier,
    watchdog_interval_from,
)

pytestmark = pytest.mark.unit


class FakeManager:
    """The service manager's end of ``NOTIFY_SOCKET``: a bound datagram socket."""

    def __init__(self, address: str | bytes, notify_socket: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.sock.bind(address)
        self.sock.settimeout(5)
        self.notify_socket = notify_socket

    def receive(self) -> tuple[list[str], list[int]]:
        """The next datagram's state lines and the FDs it carried (the caller closes them)."""
        data, fds, flags, _ = socket.recv_fds(self.sock, 4096, MAX_FDS_PER_MESSAGE)
        assert not flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC)
        return data.decode().splitlines(), fds

    def pending(self) -> int:
        """Datagrams queued right now (a send is queued before ``sendto`` returns)."""
        count = 0
        self.sock.setblocking(False)
        try:
            while True:
                _, fds, _, _ = socket.recv_fds(self.sock, 4096, MAX_FDS_PER_MESSAGE)
                for fd in fds:
                    os.close(fd)
                count += 1
        except BlockingIOError:
            return count
        finally:
            self.sock.settimeout(5)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def manager(run_dir):
    path = run_dir / "notify"
    fake = FakeManager(str(path), str(path))
    yield fake
    fake.close()


@pytest.fixture
def notifier(manager):
    n = SystemdNotifier.from_environment({"NOTIFY_SOCKET": manager.notify_socket})
    yield n
    n.close()


def test_ready_sends_ready_and_a_status_line(manager, notifier):
    notifier.ready("serving gpu0: budget 120 GiB")
    lines, fds = manager.receive()
    assert lines == ["READY=1", "STATUS=serving gpu0: budget 120 GiB"]
    assert fds == []


def test_stopping_and_status(manager, notifier):
    notifier.status("3 sessions")
    notifier.stopping()
    assert manager.receive()[0] == ["STATUS=3 sessions"]
    lines, _ = manager.receive()
    assert lines[0] == "STOPPING=1"


def test_a_status_text_cannot_inject_another_state(manager, notifier):
    notifier.status("fine\nREADY=1")
    assert manager.receive()[0] == ["STATUS=fine READY=1"]


def test_notify_socket_is_read_from_the_process_environment(manager, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", manager.notify_socket)
    n = SystemdNotifier.from_environment()
    try:
        assert n.enabled
        n.ready()
        assert manager.receive()[0][0] == "READY=1"
    finally:
        n.close()


def test_abstract_socket_address(run_dir):
    name = f"hbmd-test-{os.getpid()}-{run_dir.name}"
    fake = FakeManager(b"\0" + name.encode(), "@" + name)
    n = SystemdNotifier.from_environment({"NOTIFY_SOCKET": fake.notify_socket})
    try:
        n.ready()
        assert fake.receive()[0][0] == "READY=1"
    finally:
        n.close()
        fake.close()


def test_watchdog_interval_is_half_of_watchdog_usec(manager):
    env = {"NOTIFY_SOCKET": manager.notify_socket, "WATCHDOG_USEC": "30000000"}
    assert SystemdNotifier.from_environment(env).watchdog_interval == 15.0
    env["WATCHDOG_PID"] = str(os.getpid())
    assert SystemdNotifier.from_environment(env).watchdog_interval == 15.0


def test_watchdog_of_another_pid_is_not_ours(manager):
    env = {"NOTIFY_SOCKET": manager.notify_socket, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getppid())}
    n = SystemdNotifier.from_environment(env)
    assert n.watchdog_interval is None
    n.watchdog()
    assert manager.pending() == 0


@pytest.mark.parametrize("usec", [None, "0", "-5", "soon"])
def test_no_watchdog_without_a_valid_period(manager, usec):
    env = {"NOTIFY_SOCKET": manager.notify_socket}
    if usec is not None:
        env["WATCHDOG_USEC"] = usec
    n = SystemdNotifier.from_environment(env)
    assert n.watchdog_interval is None
    n.watchdog()
    assert manager.pending() == 0


def test_watchdog_sends_keepalives_once_per_interval(manager):
    now = [100.0]
    n = SystemdNotifier(os.fsencode(manager.notify_socket), watchdog_interval=15.0, clock=lambda: now[0])
    try:
        n.watchdog()
        assert manager.receive()[0] == ["WATCHDOG=1"]
        for step in (1.0, 13.9):
            now[0] += step
            n.watchdog()
            assert manager.pending() == 0
        now[0] += 0.1
        n.watchdog()
        assert manager.receive()[0] == ["WATCHDOG=1"]
    finally:
        n.close()


def test_fdstore_passes_descriptors_of_the_same_file(manager, notifier):
    memfd = os.memfd_create("kv-cache", os.MFD_CLOEXEC)
    try:
        os.write(memfd, b"block 0 of layer 3")
        assert notifier.send_fds([memfd], "buffer-7")
        lines, fds = manager.receive()
        try:
            assert lines == ["FDSTORE=1", "FDNAME=buffer-7"]
            assert len(fds) == 1
            assert os.pread(fds[0], 64, 0) == b"block 0 of layer 3"
            os.pwrite(memfd, b"BLOCK", 0)
            assert os.pread(fds[0], 5, 0) == b"BLOCK"
        finally:
            for fd in fds:
                os.close(fd)
        # The caller's own descriptor stays open and usable.
        assert os.pread(memfd, 5, 0) == b"BLOCK"
    finally:
        os.close(memfd)


def test_fdstore_splits_past_the_kernel_limit_per_message(manager, notifier):
    memfd = os.memfd_create("chunks", os.MFD_CLOEXEC)
    dups = [os.dup(memfd) for _ in range(MAX_FDS_PER_MESSAGE + 10)]
    try:
        assert notifier.send_fds(dups, "chunks")
        counts = []
        for _ in range(2):
            lines, fds = manager.receive()
            assert lines == ["FDSTORE=1", "FDNAME=chunks"]
            assert all(os.fstat(fd).st_ino == os.fstat(memfd).st_ino for fd in fds)
            counts.append(len(fds))
            for fd in fds:
                os.close(fd)
        assert counts == [MAX_FDS_PER_MESSAGE, 10]
    finally:
        for fd in dups:
            os.close(fd)
        os.close(memfd)


def test_fdstore_remove(manager, notifier):
    notifier.remove_fds("buffer-7")
    assert manager.receive()[0] == ["FDSTOREREMOVE=1", "FDNAME=buffer-7"]


@pytest.mark.parametrize("name", ["", "a:b", "tab\there", "x" * 256, "kv\u00e9"])
def test_fdstore_refuses_names_systemd_would_refuse(notifier, name):
    with pytest.raises(ValueError):
        notifier.send_fds([0], name)


def test_without_notify_socket_nothing_is_sent(monkeypatch):
    n = SystemdNotifier.from_environment({"WATCHDOG_USEC": "1000000"})
    assert not n.enabled
    assert n.watchdog_interval is None

    class NoSockets:
        """The socket module as the notifier sees it, but opening none; other threads' sockets are not touched."""

        def __getattr__(self, name):
            return getattr(socket, name)

        def socket(self, *args, **kwargs):
            raise AssertionError("a socket was opened without NOTIFY_SOCKET")

    monkeypatch.setattr(notify, "socket", NoSockets())
    n.ready()
    n.status("idle")
    n.watchdog()
    n.stopping()
    n.remove_fds("buffer-7")
    assert n.send_fds([0], "buffer-7") is False


def test_a_relative_notify_socket_is_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="hbmd.notify"):
        n = SystemdNotifier.from_environment({"NOTIFY_SOCKET": "notify"})
    assert not n.enabled
    assert "NOTIFY_SOCKET" in caplog.text


def test_a_vanished_socket_warns_once_and_never_raises(run_dir, caplog):
    path = run_dir / "notify"
    fake = FakeManager(str(path), str(path))
    n = SystemdNotifier.from_environment({"NOTIFY_SOCKET": fake.notify_socket, "WATCHDOG_USEC": "2000000"})
    fake.close()
    path.unlink()
    memfd = os.memfd_create("orphan", os.MFD_CLOEXEC)
    try:
        with caplog.at_level(logging.DEBUG, logger="hbmd.notify"):
            n.ready()
            n.watchdog()
            n.status("still here")
            assert n.send_fds([memfd], "buffer-1") is False
            n.stopping()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert str(path) in warnings[0].getMessage()
    finally:
        os.close(memfd)
        n.close()


def test_watchdog_interval_from_ignores_a_garbled_pid():
    assert watchdog_interval_from({"WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "init"}) is None
    assert watchdog_interval_from({"WATCHDOG_USEC": "4000000"}) == 2.0
