"""The takeover channel: a real listener and a real taker, in threads, forked processes or a fresh interpreter, over a
real socket."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.pool
import os
import re
import select
import signal
import socket
import stat
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
from hbmd.daemon.fds import open_count
from hbmd.daemon.restart import takeover
from hbmd.daemon.restart.takeover import (
    MAX_STATE_BYTES,
    TAKEOVER_SOCKET,
    NothingToTakeOver,
    PendingTakeover,
    TakeoverError,
    TakeoverListener,
    TakeoverRefused,
    take_over,
)
from hbmd.proto.codec import packb, unpackb
from helpers import MiB

pytestmark = pytest.mark.ipc

MAJOR = 1
REQUEST_TIMEOUT_S = 0.5
CHILD_TIMEOUT_S = 20
NOBODY = 65534
T = TypeVar("T")


@pytest.fixture
def socket_path(run_dir: Path) -> Path:
    return run_dir / TAKEOVER_SOCKET


@pytest.fixture
def listener(socket_path: Path):
    listener = TakeoverListener(MAJOR, request_timeout=REQUEST_TIMEOUT_S)
    listener.bind(socket_path)
    yield listener
    listener.close()


def accept_within(listener: TakeoverListener, timeout: float = 5.0) -> PendingTakeover | None:
    """What ``accept`` makes of the next taker, once the listener's poll says one waits (as the daemon's loop would)."""
    poller = select.poll()
    poller.register(listener.fileno(), select.POLLIN)
    assert poller.poll(timeout * 1000), "no taker connected"
    return listener.accept()


def memfds(count: int) -> list[tuple[str, int]]:
    """``count`` chunk-like files, each holding its own name."""
    chunks = []
    for i in range(count):
        fd = os.memfd_create(f"chunk-{i}", os.MFD_CLOEXEC)
        os.write(fd, f"chunk-{i}".encode())
        chunks.append((f"chunk-{i}", fd))
    return chunks


def fresh_processes() -> multiprocessing.pool.Pool:
    """A pool of one new interpreter: no thread of an earlier test opens or closes descriptors there, so the process's
    own count of them is exact, and it may fork or change its uid without touching pytest's."""
    return multiprocessing.get_context("spawn").Pool(1)


def in_a_fresh_process(body: Callable[..., T], *args: object) -> T:
    """``body(*args)`` run in :func:`fresh_processes`, its assertions raised here."""
    with fresh_processes() as pool:
        return pool.apply(body, args)


def fork(body: Callable[[], str]) -> tuple[int, int]:
    """Run ``body`` in a forked child; ``(pid, read end of a pipe)`` that carries what it returns, or its error."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            os.close(read_end)
            outcome = body()
            status = 0
        except BaseException as exc:  # a forked child reports any failure, never returns into its caller
            outcome = f"{type(exc).__name__}: {exc}"
        finally:
            os.write(write_end, outcome.encode())
            os._exit(status)
    os.close(write_end)
    return pid, read_end


def outcome_of(pid: int, read_end: int) -> tuple[str, int]:
    """What the child wrote and its wait status, within :data:`CHILD_TIMEOUT_S` (its caller kills it after)."""
    poller = select.poll()
    poller.register(read_end, select.POLLIN)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    chunks = []
    while data := os.read(read_end, 65536) if poller.poll(max(0, deadline - time.monotonic()) * 1000) else None:
        chunks.append(data)
    if data is None:
        pytest.fail(f"child {pid} did not finish within {CHILD_TIMEOUT_S} s")
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    return b"".join(chunks).decode(), status


def hand_over_a_large_state(socket_path: Path) -> None:
    before = open_count()
    listener = TakeoverListener(MAJOR, request_timeout=REQUEST_TIMEOUT_S)
    listener.bind(socket_path)
    state = os.urandom(8 * MiB + 12345)
    chunks = memfds(1000)
    with ThreadPoolExecutor(1) as pool:
        taking = pool.submit(take_over, socket_path, MAJOR, 10)
        pending = accept_within(listener)
        assert pending.peer_pid == os.getpid()
        pending.hand_over(state, chunks, timeout=10)
        handover = taking.result(timeout=10)

    assert handover.state == state
    assert handover.peer_pid == os.getpid()
    assert sorted(handover.fds) == sorted(name for name, _ in chunks)
    for name, fd in chunks:
        received = handover.fds[name]
        assert os.pread(received, 64, 0) == name.encode()
        assert os.fstat(received).st_ino == os.fstat(fd).st_ino
        assert not os.get_inheritable(received)
    taken = [handover.fds.pop(name) for name, _ in chunks]
    assert handover.serving()
    assert pending.wait_serving(timeout=5)

    for fd in taken:
        os.close(fd)
    for _, fd in chunks:
        os.close(fd)
    listener.close()
    assert open_count() == before


def test_a_large_state_and_1000_fds_arrive_whole_and_the_old_daemon_may_exit(socket_path):
    in_a_fresh_process(hand_over_a_large_state, socket_path)


def abandon_a_handover(socket_path: Path) -> None:
    listener = TakeoverListener(MAJOR, request_timeout=REQUEST_TIMEOUT_S)
    listener.bind(socket_path)
    chunks = memfds(3)
    before = open_count()
    with ThreadPoolExecutor(1) as pool:
        taking = pool.submit(take_over, socket_path, MAJOR, 5)
        pending = accept_within(listener)
        pending.hand_over(b"state", chunks, timeout=5)
        handover = taking.result(timeout=5)
    kept = handover.fds.pop("chunk-0")
    handover.abandon()

    started = time.monotonic()
    assert not pending.wait_serving(timeout=5)
    assert time.monotonic() - started < 1  # the closed connection says so at once, not the timeout
    os.close(kept)
    assert open_count() == before  # abandon closed the two nobody took
    for _, fd in chunks:
        os.close(fd)
    listener.close()


def test_wait_serving_is_false_when_the_new_daemon_abandons(socket_path):
    in_a_fresh_process(abandon_a_handover, socket_path)


def test_a_daemon_of_another_protocol_major_is_refused(listener, socket_path):
    with ThreadPoolExecutor(1) as pool:
        taking = pool.submit(take_over, socket_path, MAJOR + 1, 5)
        assert accept_within(listener) is None
        with pytest.raises(TakeoverRefused, match="protocol major 2; this daemon speaks 1") as refused:
            taking.result(timeout=5)
    assert "cannot take over" in refused.value.reason


def test_a_second_taker_is_refused_while_a_takeover_is_pending(listener, socket_path):
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(take_over, socket_path, MAJOR, 5)
        pending = accept_within(listener)
        second = pool.submit(take_over, socket_path, MAJOR, 5)
        assert accept_within(listener) is None
        with pytest.raises(TakeoverRefused, match="busy: another takeover"):
            second.result(timeout=5)
        pending.refuse("stopping")
        with pytest.raises(TakeoverRefused, match="refused the takeover: stopping"):
            first.result(timeout=5)


def test_a_peer_that_sends_nothing_is_dropped_within_the_request_timeout(listener, socket_path):
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    silent.connect(os.fspath(socket_path))
    started = time.monotonic()
    assert accept_within(listener) is None
    assert REQUEST_TIMEOUT_S * 0.9 <= time.monotonic() - started < REQUEST_TIMEOUT_S + 1
    silent.settimeout(5)
    assert "timed out waiting for its request" in unpackb(silent.recv(4096))["refused"]
    assert silent.recv(4096) == b""
    silent.close()

    with ThreadPoolExecutor(1) as pool:  # the listener takes the next taker as before
        taking = pool.submit(take_over, socket_path, MAJOR, 5)
        accept_within(listener).hand_over(b"", [], timeout=5)
        taking.result(timeout=5).abandon()


def test_take_over_without_a_daemon_says_so(socket_path):
    nobody_there = re.escape(f"no daemon to take over at {socket_path}")
    with pytest.raises(NothingToTakeOver, match=nobody_there):
        take_over(socket_path, MAJOR, 1)
    left_behind = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # by a daemon that is gone
    left_behind.bind(os.fspath(socket_path))
    left_behind.close()
    with pytest.raises(NothingToTakeOver, match=nobody_there):
        take_over(socket_path, MAJOR, 1)


def test_hand_over_refuses_a_name_given_twice_before_sending_anything(listener, socket_path):
    (_, fd), = memfds(1)
    with ThreadPoolExecutor(1) as pool:
        taking = pool.submit(take_over, socket_path, MAJOR, 5)
        pending = accept_within(listener)
        with pytest.raises(ValueError, match="two file descriptors named 'chunk'"):
            pending.hand_over(b"", [("chunk", fd), ("chunk", fd)], timeout=5)
        pending.refuse("cannot hand over")
        with pytest.raises(TakeoverRefused, match="cannot hand over"):
            taking.result(timeout=5)
    os.close(fd)


def take_over_from_an_old_daemon_that_dies_mid_handover(socket_path: Path) -> None:
    ready_read, ready_write = os.pipe()

    def old_daemon() -> str:
        listener = TakeoverListener(MAJOR)
        listener.bind(socket_path)
        os.write(ready_write, b"listening")
        pending = accept_within(listener)
        send_batch, batches_sent = pending._send_batch, 0

        def send_two_batches_then_die(names: list[str], fds: list[int]) -> None:
            nonlocal batches_sent
            if batches_sent == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            send_batch(names, fds)
            batches_sent += 1

        pending._send_batch = send_two_batches_then_die  # type: ignore[method-assign]
        pending.hand_over(os.urandom(MiB), memfds(1000), timeout=10)
        return "handed over whole"

    pid, outcome = fork(old_daemon)
    try:
        assert os.read(ready_read, 64) == b"listening"
        closed: list[int] = []
        close_all = takeover._close_all

        def counting_close_all(fds):
            closed.extend(fds)
            close_all(fds)

        takeover._close_all = counting_close_all  # this process is the test's alone
        before = open_count()
        with pytest.raises(TakeoverError, match="closed the connection before the file descriptors"):
            take_over(socket_path, MAJOR, 10)
        assert open_count() == before
        assert len(closed) == 2 * 253  # what the two batches brought, closed again
        _, status = outcome_of(pid, outcome)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    finally:
        with contextlib.suppress(ChildProcessError):  # reaped already where the test got that far
            if os.waitpid(pid, os.WNOHANG) == (0, 0):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
    os.close(ready_read)
    os.close(ready_write)


def test_an_old_daemon_that_dies_mid_handover_leaves_no_fd_open(socket_path):
    in_a_fresh_process(take_over_from_an_old_daemon_that_dies_mid_handover, socket_path)


def as_nobody(body: Callable[..., str], *args: object) -> str:
    """``body(*args)`` as uid nobody, in the fresh process it runs in: what it returns, or its error as text."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    try:
        return body(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def take_over_once(socket_path: Path) -> str:
    take_over(socket_path, MAJOR, 5)
    return "took over"


def ask_to_take_over(socket_path: Path) -> str:
    """A taker's first message, sent by hand: what the listener answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5)
        sock.connect(os.fspath(socket_path))
        sock.send(packb({"takeover": takeover.WIRE_VERSION, "protocol": MAJOR}))
        return unpackb(sock.recv(4096))["refused"]


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running a taker as another uid needs root")


@needs_root
def test_another_user_cannot_even_connect(listener, socket_path, run_dir):
    os.chmod(run_dir, 0o711)  # nobody may reach the socket; only its mode stands in the way
    assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
    text = in_a_fresh_process(as_nobody, take_over_once, socket_path)
    assert text == f"TakeoverError: cannot connect to {socket_path}: Permission denied"


@needs_root
def test_a_peer_of_another_uid_is_refused_through_a_socket_left_open(listener, socket_path, run_dir):
    os.chmod(run_dir, 0o711)
    os.chmod(socket_path, 0o666)  # as a careless hand might: the kernel's word on the peer's uid still decides

    with fresh_processes() as pool:
        asking = pool.apply_async(as_nobody, (ask_to_take_over, socket_path))
        assert accept_within(listener) is None
        assert asking.get(CHILD_TIMEOUT_S) == f"uid {NOBODY} is not this daemon's uid 0"

    # The taker asks the kernel too: a daemon of another uid is not one to take state and FDs from.
    with fresh_processes() as pool:
        taking = pool.apply_async(as_nobody, (take_over_once, socket_path))
        assert accept_within(listener) is None
        assert taking.get(CHILD_TIMEOUT_S).endswith(f"may not hand over: uid 0 is not this daemon's uid {NOBODY}")


def offer(state_bytes: object, fds: object) -> bytes:
    return packb({"state_bytes": state_bytes, "fds": fds})


HOSTILE_OLD_DAEMONS = {
    "garbage for an offer": (lambda fd: [(b"\xc1", [])], "malformed msgpack"),
    "a bool for a count": (lambda fd: [(offer(True, 0), [])], "malformed offer"),
    "a state over the limit": (lambda fd: [(offer(MAX_STATE_BYTES + 1, 0), [])], "over the 1073741824 allowed"),
    "more FDs than this process may open": (lambda fd: [(offer(0, 10**9), [])], "may open only"),
    "FDs attached to the state": (lambda fd: [(offer(4, 0), []), (b"abcd", [fd])], "attached file descriptors"),
    "a state longer than declared": (lambda fd: [(offer(4, 0), []), (b"abcdefgh", [])], "message over 4 bytes"),
    "more FDs than names": (lambda fd: [(offer(0, 2), []), (packb(["a"]), [fd, fd])], "2 FDs with 1 names"),
    "more FDs than declared": (
        lambda fd: [(offer(0, 1), []), (packb(["a", "b"]), [fd, fd])],
        "2 FDs with 2 names, 0 of 1",
    ),
    "one name twice": (
        lambda fd: [(offer(0, 2), []), (packb(["a"]), [fd]), (packb(["a"]), [fd])],
        "two file descriptors named 'a'",
    ),
    "a name with a colon": (lambda fd: [(offer(0, 1), []), (packb(["a:b"]), [fd])], "without ':'"),
}


def take_over_from_a_hostile_old_daemon(socket_path: Path, hostile_kind: str) -> None:
    messages_of, complaint = HOSTILE_OLD_DAEMONS[hostile_kind]
    hostile = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    hostile.bind(os.fspath(socket_path))
    hostile.listen()
    (_, fd), = memfds(1)

    def serve() -> None:
        conn, _ = hostile.accept()
        with conn:
            conn.settimeout(5)
            conn.recv(4096)
            for data, fds in messages_of(fd):
                if fds:
                    socket.send_fds(conn, [data], fds)
                else:
                    conn.send(data)
            assert conn.recv(1) == b""  # the taker gave up and closed, on what it read, not on an EOF

    before = open_count()
    with ThreadPoolExecutor(1) as pool:
        serving = pool.submit(serve)
        with pytest.raises(TakeoverError, match=re.escape(complaint)):
            take_over(socket_path, MAJOR, 5)
        serving.result(timeout=5)
    assert open_count() == before
    hostile.close()
    os.close(fd)


@pytest.mark.parametrize("hostile_kind", HOSTILE_OLD_DAEMONS)
def test_what_a_hostile_old_daemon_declares_is_checked_and_no_fd_stays_open(socket_path, hostile_kind):
    in_a_fresh_process(take_over_from_a_hostile_old_daemon, socket_path, hostile_kind)
