"""Workers SIGKILLed at any point of their work leave nothing behind in the daemon.

The promise (SPEC): the handle-plane connection is the session, so process
death is detected at once; a session's anonymous buffers are freed when it
ends; the daemon never leaks a handle or an FD, and the budget it admits
against stays exact.
"""

from __future__ import annotations

import random
import signal
import time

import pytest
from helpers import GRANULE, MiB, wait_until

pytestmark = pytest.mark.ipc

SEED = 20261203
ITERATIONS = 30
SEGMENTS = 1500
"""One granule-sized chunk per 4 MiB segment: 1,500 chunks, so six FD batches of at most 250."""
BUDGET = SEGMENTS * GRANULE

WORKER = r"""
import os, random, signal, socket, sys, time
import zmq
from hbmd import proto
from hbmd.client import connect
from hbmd.proto.instance import InstancePaths

SEGMENTS = %(segments)d
MiB = 1 << 20
mode, seed = sys.stdin.readline().rstrip("\n").split("|")
rng = random.Random(int(seed))


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def send_and_die(client, msg, wait_for_reply):
    # On a socket of our own, so that the reply and the FDs are never read.
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(client.paths.endpoint)
    sock.send_multipart(proto.encode_frames(msg, client._core.control.next_request_id(), client.welcome.token))
    if wait_for_reply:
        sock.poll(10000)
    else:
        time.sleep(rng.uniform(0, 0.003))
    die()


if mode == "handle socket, no hello":
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.fspath(InstancePaths.of(None, "host").handles))
    print("ready", flush=True)
    die()

client = connect("cpu", client_name="doomed")
granule = client.granularity
print("ready", flush=True)
if mode == "connected":
    die()

if mode.startswith("large commit"):
    info = client.create_buffer(SEGMENTS * 2 * granule, SEGMENTS)
    if mode == "large commit, batches never read":
        send_and_die(client, proto.Commit(info.buffer_id, granule), wait_for_reply=rng.random() < 0.7)
    stop_after = rng.randrange(SEGMENTS)
    received = []
    print("committing", flush=True)
    with client.commit(info.buffer_id, granule) as delivery:
        for chunk, fd in delivery:
            received.append(chunk.chunk_id)
            if mode == "large commit, killed while reading batches" and len(received) > stop_after:
                die()
    print("committed", flush=True)
    sys.stdin.readline()

small = client.create_buffer(8 * MiB, 2)
client.commit(small.buffer_id, granule).close()
if mode == "after release":
    client.release(small.buffer_id)
    die()
if mode == "in the middle of free":
    send_and_die(client, proto.Free(small.buffer_id), wait_for_reply=False)
if mode == "in the middle of a preserving defragment":
    client.commit(small.buffer_id, 2 * granule).close()  # two chunks per segment
    send_and_die(client, proto.Defragment(small.buffer_id, True), wait_for_reply=rng.random() < 0.5)
if mode == "churning":
    print("churning", flush=True)
    held = []
    while True:
        info = client.create_buffer(16 * MiB, rng.choice([1, 2, 4]))
        held.append(info.buffer_id)
        client.commit(info.buffer_id, granule).close()
        client.commit(info.buffer_id, rng.choice([1, 2]) * granule).close()
        if rng.random() < 0.5:
            client.release(info.buffer_id)
        if len(held) > 4:  # keep a few buffers held at any moment, well inside the budget
            client.free(held.pop(rng.randrange(len(held))))
raise SystemExit(f"unknown mode {mode!r}")
""" % {"segments": SEGMENTS}  # noqa: UP031 - the worker's code has braces of its own

# Modes the test kills from outside, after the worker's second line, at a random moment.
KILLED_FROM_OUTSIDE = {"large commit, killed from outside": "committing", "churning": "churning"}
MODES = [
    "handle socket, no hello",
    "connected",
    "large commit, killed while reading batches",
    "large commit, batches never read",
    "large commit, killed from outside",
    "after release",
    "in the middle of free",
    "in the middle of a preserving defragment",
    "churning",
]


def wait_for_only_this_session(client, what: str) -> None:
    """Wait until the daemon has ended every other session and freed what they held."""
    def settled() -> bool:
        status = client.status()
        return status.num_sessions == 1 and status.committed_bytes == 0 and status.num_buffers == 0

    try:
        wait_until(settled, timeout=5)
    except TimeoutError:
        status = client.status()
        raise AssertionError(
            f"{what}: 5 s after the kill the daemon still has {status.num_sessions} sessions, "
            f"{status.num_buffers} buffers, {status.committed_bytes} committed bytes"
        ) from None


@pytest.mark.torch
@pytest.mark.system
def test_workers_killed_at_any_point_leave_nothing_behind(start_daemon, spawn_worker):
    """Thirty workers SIGKILLed mid-commit, mid-batch, mid-free, mid-defragment or just connected:
    every byte and FD comes back, and the whole budget can be committed again."""
    daemon = start_daemon("--budget", f"{BUDGET // MiB}MiB")
    client = daemon.connect(client_name="survivor")
    rng = random.Random(SEED)
    try:
        client.status()  # the daemon accepts our control connection asynchronously: settle it before counting
        fds_before = daemon.open_fds()
        killed, overruns = 0, 0
        by_mode: dict[str, int] = {}
        started = time.monotonic()
        for i in range(ITERATIONS):
            # Every mode at least three times, the rest at random.
            mode = MODES[i % len(MODES)] if i < 3 * len(MODES) else rng.choice(MODES)
            worker = spawn_worker(daemon, WORKER)
            worker.send(f"{mode}|{rng.getrandbits(32)}")
            assert worker.readline(timeout=20) == "ready", f"iteration {i} ({mode})"
            if mode in KILLED_FROM_OUTSIDE:
                assert worker.readline(timeout=20) == KILLED_FROM_OUTSIDE[mode]
                time.sleep(rng.uniform(0, 0.4))
                worker.proc.send_signal(signal.SIGKILL)
            returncode = worker.wait(timeout=30)
            # Dying of anything but the kill means the worker never reached the point under test.
            assert returncode == -signal.SIGKILL, f"iteration {i} ({mode}): exit {returncode}, {worker.stderr_tail()}"
            killed += 1
            by_mode[mode] = by_mode.get(mode, 0) + 1
            status = client.status()
            overruns += status.committed_bytes > status.budget_bytes
            # The daemon learns of the death from the handle socket: at once, not after a timeout.
            wait_for_only_this_session(client, f"iteration {i} ({mode})")
            assert daemon.alive(), f"iteration {i} ({mode}) killed the daemon:\n{daemon.log()[-3000:]}"
        loop_s = time.monotonic() - started

        try:
            wait_until(lambda: daemon.open_fds() == fds_before, timeout=10)
        except TimeoutError:
            pass  # reported below, with the count
        status = client.status()
        leaked_fds = daemon.open_fds() - fds_before
        print(
            f"\nreliability: messages fuzzed=0, clients killed={killed}, crashes={int(not daemon.alive())}, "
            f"leaked FDs={leaked_fds}, leaked bytes={status.committed_bytes}, budget overruns={overruns} "
            f"({loop_s:.1f} s; {', '.join(f'{m}: {n}' for m, n in sorted(by_mode.items()))})"
        )
        assert daemon.alive()
        assert status.committed_bytes == 0 and status.num_buffers == 0 and status.num_sessions == 1
        assert leaked_fds == 0
        assert overruns == 0

        # Nothing of the budget leaked: all of it can be committed again, in one go.
        info = client.create_buffer(BUDGET, 1)
        client.commit(info.buffer_id, BUDGET).close()
        assert client.status().committed_bytes == BUDGET
        client.free(info.buffer_id)
        assert client.status().committed_bytes == 0
        assert daemon.open_fds() == fds_before
        assert "Traceback" not in daemon.log()
    finally:
        client.close()
