"""Peers that stream at the daemon, against a same-run baseline: what an honest engine, the watchdog and the metrics
port see (issue #61).

    python3 bench/stream_bench.py [--seconds 6] [--daemon-tree DIR] [--out bench/results/streams-DATE.json]

Each case starts a host-backend daemon (watchdog on, ``WATCHDOG_USEC`` 1 s:
a keep-alive every 0.5 s; ``--metrics-addr`` on a free port), and an engine
asks it for status every 20 ms for ``--seconds``, first alone (the
baseline, the same daemon), then beside the case's attack:

- ``heartbeats``: one connection streaming ZMTP PINGs, which complete no
  request;
- ``empty_messages_1`` and ``empty_messages_4``: one and four connections
  streaming empty messages, two bytes each;
- ``requests_4mib``: four processes sending requests of 4 MiB, past what
  the daemon decodes, each a map of two million entries with its id last;
- ``metrics_trickle``: 16 connections from 127.0.0.2 to the metrics port,
  each sending a byte a second; 30 ``/metrics`` and 30 ``/healthz`` asked
  from 127.0.0.1 meanwhile;
- ``uids_partial``: four uids (65531 to 65534; root only, skipped
  otherwise) each holding unfinished messages of 3 MiB on 24 connections.

Per case: the engine's p50, p99 and max against the baseline's (and their
ratios), failed calls, the longest gap between watchdog keep-alives, the
daemon's RSS peak over its RSS before, the metrics answered, and SIGTERM to
exit. ``--daemon-tree DIR`` runs the daemon from another checkout, ``DIR/hbmd`` (the tree
before a change, say: ``git archive <commit> | tar -x -C DIR/hbmd``), the engine
and the attackers from this one.
"""

from __future__ import annotations

import argparse
import itertools
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, Daemon, metadata, percentile, today_utc, write_json
from hbmd.client import connect

WATCHDOG_USEC = 1_000_000
TICK_S = 0.02
UIDS = (65534, 65533, 65532, 65531)

GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
READY_BODY = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
READY = b"\x04" + bytes([len(READY_BODY)]) + READY_BODY

STREAMER = r"""
import select, socket, struct, sys
path, kind, connections = sys.argv[1], sys.argv[2], int(sys.argv[3])
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
READY_BODY = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
READY = b"\x04" + bytes([len(READY_BODY)]) + READY_BODY
if kind == "heartbeats":
    block = b"\x04\x07\x04PING\x00\x00" * 8192
elif kind == "empty":
    block = b"\x00\x00" * 8192
elif kind == "partial":
    block = b"\x03" + struct.pack(">Q", 1 << 20) + b"p" * (1 << 20)
else:
    entries = 2 * 1024 * 1024 - 16
    payload = b"\xdf" + struct.pack(">I", entries + 1) + b"\x00\x00" * entries + b"\xa2id\x07"
    kind_frame = b"\x01" + bytes([22]) + b"buffer.commit_segments"
    block = kind_frame + b"\x02" + struct.pack(">Q", len(payload)) + payload
socks = []
for _ in range(connections):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    try:
        sock.connect(path)
        sock.sendall(GREETING + READY)
        if kind == "partial":
            sock.sendall(block * 3)
    except OSError:
        continue
    socks.append(sock)
print(len(socks), flush=True)
if kind == "partial":
    sys.stdin.readline()
    sys.exit(0)
for sock in socks:
    sock.setblocking(False)
views = {sock: memoryview(block) for sock in socks}
while views:
    for sock in select.select([], list(views), [], 1.0)[1]:
        try:
            sent = sock.send(views[sock])
        except OSError:
            del views[sock]
            continue
        views[sock] = views[sock][sent:] if sent < len(views[sock]) else memoryview(block)
"""


class Keepalives:
    """The daemon's notify socket: when each ``WATCHDOG=1`` came."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.times: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            if b"WATCHDOG=1" in data.split(b"\n"):
                self.times.append(time.monotonic())

    def longest_gap(self, start: float, end: float) -> float:
        times = [t for t in self.times if start <= t <= end]
        edges = [start, *times, end]
        return max(b - a for a, b in itertools.pairwise(edges))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def rss(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":")) * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_calls(client: Any, seconds: float) -> tuple[list[float], int]:
    """Status every :data:`TICK_S` for ``seconds``: each call's seconds, and how many failed."""
    calls, failed = [], 0
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        began = time.monotonic()
        try:
            client.status()
        except Exception:  # a failure is a figure here, not an error of the bench
            failed += 1
        calls.append(time.monotonic() - began)
        time.sleep(TICK_S)
    return calls, failed


def figures(calls: list[float]) -> dict[str, float]:
    ms = [c * 1e3 for c in calls]
    return {"p50_ms": round(percentile(ms, 50), 2), "p99_ms": round(percentile(ms, 99), 2),
            "max_ms": round(max(ms), 2), "calls": len(ms)}


def streamers(kind: str, path: str, processes: int, connections: int, uid: int | None = None) -> list[subprocess.Popen]:
    started = []
    for _ in range(processes):
        user = {} if uid is None else {"user": uid, "group": 65534, "extra_groups": []}
        proc = subprocess.Popen(["/usr/bin/python3" if uid is not None else sys.executable, "-c", STREAMER, path, kind,
                                 str(connections)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **user)
        started.append(proc)
    for proc in started:
        assert proc.stdout is not None
        if not select.select([proc.stdout], [], [], 60)[0]:
            raise RuntimeError(f"streamer {kind} said nothing in 60 s")
        proc.stdout.readline()
    return started


def trickle(port: int, stop: threading.Event) -> list[socket.socket]:
    socks = []
    for _ in range(16):
        sock = socket.socket()
        sock.bind(("127.0.0.2", 0))
        sock.connect(("127.0.0.1", port))
        socks.append(sock)

    def run() -> None:
        while not stop.wait(1.0):
            for sock in socks:
                try:
                    sock.send(b"G")
                except OSError:
                    pass

    threading.Thread(target=run, daemon=True).start()
    return socks


def answered(port: int, path: str) -> bool:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).status == 200
    except Exception:  # refused, reset or timed out: not answered
        return False


def run_case(case: str, seconds: float, tree: str | None) -> dict[str, Any]:
    port = free_port()
    notify = Path(tempfile.mkdtemp(prefix="hbmdn-", dir="/tmp")) / "notify"
    keepalives = Keepalives(notify)
    command = ["env", f"PYTHONPATH={tree}", sys.executable, "-m", "hbmd.daemon"] if tree else None
    daemon = Daemon("--backend", "host", "--budget", "64MiB", "--metrics-addr", f"127.0.0.1:{port}",
                    *(("--group", "nogroup") if case == "uids_partial" else ()), command=command)
    daemon.env.update(NOTIFY_SOCKET=str(notify), WATCHDOG_USEC=str(WATCHDOG_USEC))
    daemon.start()
    if case == "uids_partial":
        os.chmod(daemon.run_dir, 0o755)
    attackers: list[subprocess.Popen] = []
    stop = threading.Event()
    held: list[socket.socket] = []
    try:
        client = connect(run_dir=daemon.run_dir, instance=daemon.instance, client_name="engine", timeout=5)
        baseline, baseline_failed = engine_calls(client, seconds)
        before = rss(daemon.pid, "VmRSS")
        path = str(daemon.run_dir / daemon.instance / "control.sock")
        started = time.monotonic()
        result: dict[str, Any] = {}
        if case == "heartbeats":
            attackers = streamers("heartbeats", path, 1, 1)
        elif case.startswith("empty_messages"):
            attackers = streamers("empty", path, 1, int(case.rsplit("_", 1)[1]))
        elif case == "requests_4mib":
            attackers = streamers("requests", path, 4, 1)
        elif case == "metrics_trickle":
            held = trickle(port, stop)
            time.sleep(2)
            result["metrics_answered"] = sum(answered(port, "/metrics") for _ in range(30))
            result["healthz_answered"] = sum(answered(port, "/healthz") for _ in range(30))
        elif case == "uids_partial":
            for uid in UIDS:
                attackers += streamers("partial", path, 1, 24, uid)
        attacked, attacked_failed = engine_calls(client, seconds)
        ended = time.monotonic()
        result.update({
            "baseline": figures(baseline), "attacked": figures(attacked),
            "failed": {"baseline": baseline_failed, "attacked": attacked_failed},
            "ratio_p50": round(figures(attacked)["p50_ms"] / figures(baseline)["p50_ms"], 2),
            "ratio_p99": round(figures(attacked)["p99_ms"] / figures(baseline)["p99_ms"], 2),
            "watchdog_longest_gap_ms": round(keepalives.longest_gap(started, ended) * 1e3),
            "rss_peak_over_before_mib": round((rss(daemon.pid, "VmHWM") - before) / (1 << 20), 1),
        })
        client.close()
        sigterm = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        try:
            daemon.proc.wait(15)
        except subprocess.TimeoutExpired:
            pass
        result["sigterm_to_exit_ms"] = round((time.monotonic() - sigterm) * 1e3)
        return result
    finally:
        stop.set()
        for sock in held:
            sock.close()
        for proc in attackers:
            proc.kill()
            proc.wait(10)
        daemon.stop()
        keepalives.close()


CASES = ("heartbeats", "empty_messages_1", "empty_messages_4", "requests_4mib", "metrics_trickle", "uids_partial")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--daemon-tree", default=None, help="a folder holding another checkout as hbmd/")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / f"streams-{today_utc()}.json")
    args = parser.parse_args()
    payload: dict[str, Any] = {"meta": metadata(), "cases": {}}
    for case in args.cases.split(","):
        if case == "uids_partial" and os.getuid() != 0:
            payload["cases"][case] = {"skipped": "needs root to attack as four uids"}
            continue
        payload["cases"][case] = run_case(case, args.seconds, args.daemon_tree)
        print(case, payload["cases"][case], flush=True)
        write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
