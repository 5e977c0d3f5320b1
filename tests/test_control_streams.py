"""A peer streaming on the control socket delays only itself, and the loop keeps turning (issue #61).

Three streams that a turn's read of one connection could not stop at: ZMTP
heartbeats, which complete no request (a turn read a connection until one
was whole, so a connection sending PINGs held the loop for as long as it
sent: no call answered, no hello, no watchdog keep-alive); empty messages,
two bytes each, of which one read completes thousands, each refused inside
that read; and requests of 4 MiB, past what the daemon decodes, whose id the
refusal looked for by walking every entry of the payload's map. Meanwhile an engine asks for
status every 20 ms and the daemon runs under a watchdog of 1 s (systemd's
keep-alive every 0.5 s). The promise: no call fails, the engine's p99 is
within 250 ms and its worst call within 2 s, the watchdog is never missed
(no gap of a second between keep-alives), and SIGTERM is honoured within
a second. The figures against the tree before are in SECURITY.md,
"Measured".
"""

from __future__ import annotations

import os
import select
import signal
import statistics
import subprocess
import time

import pytest
from hbmd.proto.instance import InstancePaths
from test_admission import nobody_can_run_python, nobody_python  # noqa: F401 - a fixture, and its interpreter

pytestmark = [pytest.mark.ipc, pytest.mark.flood]

ATTACK_SECONDS = float(os.environ.get("HBMD_FLOOD_SECONDS", "6"))
WATCHDOG_USEC = 1_000_000

ATTACKER = """
import select
import socket
import struct
import msgpack

GREETING = b"\\xff" + bytes(8) + b"\\x7f" + b"\\x03\\x01" + b"NULL".ljust(20, b"\\x00") + b"\\x00" + bytes(31)
def command(name, data=b""):
    body = bytes([len(name)]) + name + data
    return b"\\x04" + bytes([len(body)]) + body
def frame(data, more=False):
    if len(data) < 256:
        return bytes([int(more), len(data)]) + data
    return bytes([int(more) | 0x02]) + struct.pack(">Q", len(data)) + data
READY = command(b"READY", b"\\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER")

if stream == "heartbeats":
    block = command(b"PING", b"\\x00\\x00") * 8192
elif stream == "empty messages":
    block = frame(b"") * 8192
else:
    # A real kind, past what the daemon decodes (1 MiB): a map of two million entries, its id after them.
    entries = 2 * 1024 * 1024 - 16
    payload = b"\\xdf" + struct.pack(">I", entries + 1) + b"\\x00\\x00" * entries + msgpack.packb("id") + b"\\x07"
    block = frame(b"buffer.commit_segments", more=True) + frame(payload)
socks = []
for _ in range(connections):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.sendall(GREETING + READY)
    sock.setblocking(False)
    socks.append(sock)
print("streaming", len(block), flush=True)
views = {sock: memoryview(block) for sock in socks}
while True:
    for sock in select.select([], socks, [])[1]:
        sent = sock.send(views[sock])
        views[sock] = views[sock][sent:] if sent < len(views[sock]) else memoryview(block)
"""

STREAMS = {  # attacking processes, connections each
    "heartbeats": (1, 1),
    "empty messages": (1, 4),
    "requests of 4 MiB": (4, 1),
}


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@pytest.mark.parametrize("stream", list(STREAMS))
def test_a_stream_on_the_control_socket_delays_only_its_sender(start_daemon, spawn_worker, run_dir, systemd, stream):
    processes, connections = STREAMS[stream]
    daemon = start_daemon("--budget", "64MiB", env={"NOTIFY_SOCKET": str(systemd.path),
                                                     "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    engine = daemon.connect(client_name="engine", timeout=5)
    engine.status()
    path = str(InstancePaths.of(run_dir, "host").control)
    attackers = [spawn_worker(daemon, f"stream, connections, path = {stream!r}, {connections}, {path!r}\n{ATTACKER}")
                 for _ in range(processes)]
    for attacker in attackers:
        assert attacker.readline().startswith("streaming")
    started = time.monotonic()
    calls: list[float] = []
    errors: list[str] = []
    while time.monotonic() - started < ATTACK_SECONDS:
        began = time.monotonic()
        try:
            engine.status()
        except Exception as exc:  # every failure counted, not only the first
            errors.append(f"{type(exc).__name__}: {exc}")
        calls.append(time.monotonic() - began)
        time.sleep(0.02)
    keepalives = systemd.arrivals("WATCHDOG=1", since=started)
    stopped = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    try:
        daemon.proc.wait(10)
    except subprocess.TimeoutExpired:
        pass  # reported below
    stopped_in = time.monotonic() - stopped
    gaps = [later - earlier for earlier, later in zip([started, *keepalives], keepalives)]
    gaps.append(stopped - (keepalives[-1] if keepalives else started))
    engine.close()
    print(f"\n{stream}: {len(calls)} calls, p50 {statistics.median(calls) * 1e3:.1f} ms, p99 "
          f"{percentile(calls, 0.99) * 1e3:.1f} ms, max {max(calls) * 1e3:.1f} ms, {len(errors)} errors; "
          f"{len(keepalives)} keep-alives, the longest gap {max(gaps) * 1e3:.0f} ms; SIGTERM {stopped_in * 1e3:.0f} ms")
    assert errors == []
    assert percentile(calls, 0.99) <= 0.25 and max(calls) <= 2.0
    assert max(gaps) < WATCHDOG_USEC / 1e6
    assert stopped_in <= 1.0


HOLDER = """
import socket, struct, sys, time

path, connections = sys.argv[1], int(sys.argv[2])
GREETING = b"\\xff" + bytes(8) + b"\\x7f" + b"\\x03\\x01" + b"NULL".ljust(20, b"\\x00") + b"\\x00" + bytes(31)
READY_BODY = b"\\x05READY\\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
READY = b"\\x04" + bytes([len(READY_BODY)]) + READY_BODY
PART = b"\\x03" + struct.pack(">Q", 1 << 20) + b"p" * (1 << 20)  # a part of 1 MiB, MORE set: never ended
held = cut = 0
socks = []
for _ in range(connections):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    try:
        sock.connect(path)
        sock.sendall(GREETING + READY + PART * 3)
        held += 1
    except OSError:
        cut += 1
    socks.append(sock)
print(held, cut, flush=True)
time.sleep(600)
"""
UIDS = (65534, 65533, 65532, 65531)


def peak_growth(pid: int, before: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        peak = next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) * 1024
    return peak - before


def test_uids_holding_unfinished_messages_share_a_bound_in_all(nobody_can_run_python, start_daemon, run_dir):
    """Four uids each hold unfinished messages of 3 MiB on 24 connections: past their bounds (64 MiB each) their
    connections are cut, and past the bound in all (96 MiB, each uid a message more): 256 MiB held before, RSS
    +250 MiB (issue #61). An engine's calls are answered meanwhile. Skipped where other uids cannot start a Python
    (not root, or an interpreter under a folder closed to them, as a venv under /root is)."""
    daemon = start_daemon("--budget", "64MiB", "--group", "nogroup")
    engine = daemon.connect(client_name="engine", timeout=5)
    engine.status()
    with open(f"/proc/{daemon.pid}/status") as status:
        before = next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) * 1024
    path = str(InstancePaths.of(run_dir, "host").control)
    holders = [subprocess.Popen([*nobody_python(), "-c", HOLDER, path, "24"], user=uid, group=65534, extra_groups=[],
                                stdout=subprocess.PIPE, text=True) for uid in UIDS]
    try:
        calls: list[float] = []
        counts: dict[int, list[str]] = {}
        deadline = time.monotonic() + 60
        while (len(counts) < len(holders) or len(calls) < 50) and time.monotonic() < deadline:
            began = time.monotonic()
            engine.status()
            calls.append(time.monotonic() - began)
            for ready in select.select([h.stdout for h in holders if h.pid not in counts], [], [], 0.02)[0]:
                counts[next(h.pid for h in holders if h.stdout is ready)] = ready.readline().split()
        grown = peak_growth(daemon.pid, before)
    finally:
        for holder in holders:
            holder.kill()
            holder.wait(10)
    print(f"\nfour uids holding unfinished messages: connections held/cut {list(counts.values())}; the daemon's RSS "
          f"peak +{grown >> 20} MiB; the engine's calls max {max(calls) * 1e3:.0f} ms")
    assert len(counts) == len(holders) and sum(int(held) for held, _ in counts.values()) * 3 <= 96 + 4 * 5
    assert grown <= 160 << 20
    assert max(calls) <= 2.0
