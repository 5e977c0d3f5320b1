"""hbmd's host backend against the in-process baseline, side by side in one run (about a minute, no GPU).

    python3 bench/host_bench.py [--quick] [--cases commit,release] [--out bench/results/host-DATE.json]

Starts its own daemon (``python -m hbmd.daemon --backend host`` in a short
/tmp run directory). The baseline does the same work in this process: one
memfd per buffer, ``fallocate`` per commit, ``mmap MAP_SHARED|MAP_FIXED``
into a reserved range, ``memset``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import struct
import sys
import time
from typing import Any

import zmq
from baseline import HostInProcessBuffer
from cases import (
    Target,
    add_status_cases,
    concurrent_commits,
    fresh_commits,
    release_recommit,
    status_round_trips,
    step_commits,
    step_commits_without_lease,
    turns_under_load,
)
from common import RESULTS_DIR, Bench, Daemon, GiB, MiB, ratio, repeat_ns, summarize_ns, timed_ns, today_utc
from hbmd import proto
from hbmd.client import connect
from hbmd.client.host import HostMapper
from hbmd.memfd import sealed_memfd
from hbmd.proto.instance import InstancePaths
from hbmd.testing.spawn import wait_until

bench = Bench("host", "hbmd's host backend against the in-process baseline, side by side")

COMMIT_REPS = {2 * MiB: (50, 5), 64 * MiB: (20, 3), 1 * GiB: (5, 2)}
RELEASE_SIZES = (64 * MiB, 1 * GiB)


@bench.case("commit")
def commit_case(t: Target) -> dict[str, Any]:
    return {"sizes": fresh_commits(t, COMMIT_REPS)}


@bench.case("commit_2mib_steps")
def commit_steps_case(t: Target) -> dict[str, Any]:
    return step_commits(t, t.reps(500, 100))


@bench.case("commit_2mib_steps_no_lease")
def commit_steps_no_lease_case(t: Target) -> dict[str, Any]:
    return step_commits_without_lease(t, t.reps(500, 100))


class UnmappedHostMapper(HostMapper):
    """The host mapper with mapping, unmapping and zeroing left out: what remains of a commit is the client's own
    work."""

    def map_prepared(self, address: int, chunk: Any, prepared: int, readonly: bool = False) -> None:
        pass

    def unmap(self, address: int, size: int) -> None:
        pass

    def zero(self, address: int, size: int) -> None:
        pass


@bench.case("leased_commit_client_work")
def leased_commit_client_work_case(t: Target) -> dict[str, Any]:
    """A leased 2 MiB step with the mapping left out: the Python a commit costs the client, the same on a GPU."""
    client = connect("cpu", run_dir=t.daemon.run_dir, client_name="client-work", mapper=UnmappedHostMapper(t.granule))
    n = t.reps(500, 200)
    tensor = t.tensor((n + 1) * t.granule, client=client)
    try:
        tensor.resize_per_segment_(t.granule)
        samples, sent = [], client.requests_sent
        for i in range(2, n + 2):
            while not client.leased_granules:
                time.sleep(0.0005)  # a warm lease: what is timed is the placement, not the daemon's refill
            samples.append(timed_ns(lambda: tensor.resize_per_segment_(i * t.granule, zero_new=True)))
        return {"commits": n, "round_trips": client.requests_sent - sent, "client_work": summarize_ns(samples)}
    finally:
        tensor.free()
        client.close()


class PooledHostMapper(UnmappedHostMapper):
    """:class:`UnmappedHostMapper` whose chunks made on credit come from a pool filled beforehand: what remains of a
    commit on credit is the client's own work and the bind's send."""

    def __init__(self, granule: int) -> None:
        super().__init__(granule)
        self.pool: list[int] = []

    def make(self, size: int) -> int:
        return self.pool.pop()


@bench.case("credit_commit_client_work")
def credit_commit_client_work_case(t: Target) -> dict[str, Any]:
    """A fresh buffer's 8 MiB commit on credit with the chunk made beforehand and the mapping and zeroing left out,
    the daemon stopped while it runs (the bind waits in its socket, so the sender is not preempted by the daemon
    waking): the Python a commit on credit costs the client and the bind's ``sendmsg``, the same on a GPU."""
    mapper = PooledHostMapper(t.granule)
    client = connect("cpu", run_dir=t.daemon.run_dir, client_name="client-work", mapper=mapper)
    n, size = t.reps(300, 100), 8 * MiB
    try:
        first = t.tensor(size, client=client)
        first.resize_per_segment_(size)  # through the daemon: the credit is granted from this demand
        first.free()
        samples, sent = [], client.requests_sent
        for _ in range(n):
            tensor = t.tensor(size, client=client)
            mapper.pool.append(sealed_memfd(size))
            wait_until(lambda: client.leasing.credit_covers(size), timeout=10)
            os.kill(t.daemon.pid, signal.SIGSTOP)
            try:
                samples.append(timed_ns(lambda: tensor.resize_per_segment_(size, zero_new=True)))
            finally:
                os.kill(t.daemon.pid, signal.SIGCONT)
            tensor.free()
        return {"commits": n, "round_trips": client.requests_sent - sent - 2 * n, "client_work": summarize_ns(samples)}
    finally:
        client.close()


@bench.case("release")
def release_case(t: Target) -> dict[str, Any]:
    return {"sizes": [release_recommit(t, size, t.reps(5, 2)) for size in RELEASE_SIZES]}


CONCURRENT_CLIENTS = (1, 16)


@bench.case("control")
def control_case(t: Target) -> dict[str, Any]:
    figures = status_round_trips(t, t.reps(2000, 300))
    figures["concurrent_2mib_commits"] = concurrent_commits(t, "cpu", CONCURRENT_CLIENTS, 1.0 if t.quick else 3.0)
    return figures


add_status_cases(bench)

# ZMTP 3.1 with the NULL mechanism, spelled out from RFC 23 and 37 as a DEALER sends it.
GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
READY_BODY = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"


def zmtp_frames(frames: list[bytes]) -> bytes:
    return b"".join((bytes([int(i < len(frames) - 1), len(f)]) if len(f) < 256 else
                     bytes([int(i < len(frames) - 1) | 0x02]) + struct.pack(">Q", len(f))) + f
                    for i, f in enumerate(frames))


class RawZmtpClient:
    """A Unix stream socket speaking ZMTP to the control socket by hand: one request, then its reply's frames."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.buffer = bytearray()
        self.sock.sendall(GREETING + b"\x04" + bytes([len(READY_BODY)]) + READY_BODY)
        self._take(64)
        assert self._frame()[1] & 0x04, "the daemon's READY"

    def _take(self, count: int) -> bytes:
        while len(self.buffer) < count:
            self.buffer += self.sock.recv(65536)
        taken = bytes(self.buffer[:count])
        del self.buffer[:count]
        return taken

    def _frame(self) -> tuple[bytes, int]:
        flags = self._take(1)[0]
        size = struct.unpack(">Q", self._take(8))[0] if flags & 0x02 else self._take(1)[0]
        return self._take(size), flags

    def call(self, request: bytes) -> list[bytes]:
        self.sock.sendall(request)
        frames = []
        while True:
            body, flags = self._frame()
            frames.append(body)
            if not flags & 0x01:
                return frames

    def close(self) -> None:
        self.sock.close()


@bench.case("dealer_hop")
def dealer_hop_case(t: Target) -> dict[str, Any]:
    """What the pyzmq DEALER hop costs: the same status request's frames, under the same session token, through a
    DEALER socket and through a Unix socket speaking ZMTP by hand, timed in turns on one daemon. The ratio is the
    DEALER's p50 over the raw socket's; what both share is the daemon's work and the round trip."""
    # A session of its own: the ids sent here must not pass those of the client the other cases use.
    client = connect("cpu", run_dir=t.daemon.run_dir, client_name="dealer-hop")
    token = client._core.control.token
    path = os.fspath(InstancePaths.of(t.daemon.run_dir, "host").control)
    n = t.reps(2000, 300)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"ipc://{path}")
    raw = RawZmtpClient(path)
    ids = itertools.count(client.requests_sent + 1)

    def through_dealer() -> None:
        dealer.send_multipart(proto.encode_frames(proto.Status(), next(ids), token))
        assert isinstance(proto.decode_frames(dealer.recv_multipart()).body, proto.StatusReply)

    def through_raw() -> None:
        reply = raw.call(zmtp_frames(proto.encode_frames(proto.Status(), next(ids), token)))
        assert isinstance(proto.decode_frames(reply).body, proto.StatusReply)

    try:
        for call in (through_dealer, through_raw):
            repeat_ns(call, 0, warmup=100)
        dealer_ns: list[int] = []
        raw_ns: list[int] = []
        for _ in range(10):  # in turns, so that the machine's load falls on both alike
            dealer_ns += repeat_ns(through_dealer, n // 10)
            raw_ns += repeat_ns(through_raw, n // 10)
        figures = {"dealer": summarize_ns(dealer_ns), "raw_socket": summarize_ns(raw_ns)}
        figures["dealer_over_raw_p50"] = ratio(figures["dealer"]["p50_us"], figures["raw_socket"]["p50_us"])
        figures["dealer_over_raw_p99"] = ratio(figures["dealer"]["p99_us"], figures["raw_socket"]["p99_us"])
        print(f"  status p50 through a DEALER {figures['dealer']['p50_us']} µs, a raw socket "
              f"{figures['raw_socket']['p50_us']} µs: ×{figures['dealer_over_raw_p50']}")
        return figures
    finally:
        dealer.close(linger=0)
        raw.close()
        client.close()


@bench.case("turns")
def turns_case(t: Target) -> dict[str, Any]:
    """The daemon's turns with 16 clients committing at once, and what fills the longest (a probed daemon)."""
    return turns_under_load(["--backend", "host"], "cpu", CONCURRENT_CLIENTS[-1], 1.0 if t.quick else 3.0)


@contextlib.contextmanager
def setup(args: Any):
    with Daemon("--backend", "host") as daemon:
        client = connect("cpu", run_dir=daemon.run_dir, client_name="host_bench")
        try:
            yield Target(
                quick=args.quick,
                daemon=daemon,
                client=client,
                device="cpu",
                granule=client.granularity,
                in_process=lambda capacity: HostInProcessBuffer(capacity, client.granularity),
                sync=lambda: None,
            )
        finally:
            client.close()


def describe(t: Target) -> dict[str, Any]:
    return {"backend": "host", "granule_bytes": t.granule, "daemon_command": " ".join(t.daemon.command)}


def main() -> int:
    args = bench.parser(RESULTS_DIR / f"host-{today_utc()}.json").parse_args()
    return bench.run(args, setup, describe)


if __name__ == "__main__":
    sys.exit(main())
