"""A flooder of the daemon and an engine timed beside it: what ``tests/test_flood.py`` checks and
``bench/flood_bench.py`` measures.

The flooder makes a buffer of the most segments (4,096), then sends, as fast
as the daemon reads them, either placements of leased granules that the
daemon must refuse (handle plane), hellos it must refuse, each naming a
tenant of its own (an attacker's way to fill the daemon with records), or
pipelined commits of every segment that the budget refuses (control plane),
on one control connection or on 64 of its own, as the engine's uid or as
another. The engine commits a granule and asks for status every
:data:`TICK_S`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from .spawn import LineProcess

TICK_S = 0.1
NOBODY = 65534

FLOODER = """
import os
import time
import zmq
from hbmd.client import InvalidRequest, connect
from hbmd.client.transport import HandleChannel
from hbmd.proto import (MAX_SEGMENTS, PROTOCOL_VERSION, CommitSegments, Hello, LeasePlace, encode_datagram,
                        encode_frames)

SEGMENTS = MAX_SEGMENTS
os.nice(nice)
if as_nobody:
    # Everything is imported before: the checkout need not be open to uid 65534.
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
client = connect("cpu", client_name="flood", timeout=60)
# A commit through the daemon starts the lease; its granules' ids make a placement pass the cheap checks.
small = client.create_buffer(8 << 20, 1)
with client.commit(small.buffer_id, 2 << 20):
    pass
deadline = time.monotonic() + 30
while client.leased_granules < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
leased = sorted(client.leasing.lease._ready)[:2]
wide = client.create_buffer(SEGMENTS * (2 << 20), SEGMENTS)  # a granule a segment: each needs its own
if plane == "hellos":
    # Hellos the daemon must refuse (a client name with an escape), each naming a tenant nobody else names.
    print("flooding", 1, flush=True)
    refused = 0
    while True:
        channel = HandleChannel(client.paths, 5)
        try:
            channel.handshake(Hello(list(PROTOCOL_VERSION), os.getpid(), client_name="\x1b[2J",
                                    tenant=f"squat-{refused}"))
        except InvalidRequest:
            refused += 1
        channel.close()
elif plane == "handles":
    # Every segment grows by one byte: the growth needs every granule of the buffer, two are placed.
    placement = encode_datagram(LeasePlace(wide.buffer_id, [1] * SEGMENTS, leased, [0, 2 << 20]))
    sock = client._core.handles.sock
    sock.settimeout(None)
    print("flooding", len(placement), flush=True)
    while True:
        sock.send(placement)
else:
    # Every segment full: the whole buffer is worked out, then refused for want of budget. Each connection keeps
    # requests in flight, sent as soon as it can take them, its replies read and dropped.
    control = client._core.control
    frames = encode_frames(CommitSegments(wide.buffer_id, [4096] * SEGMENTS), control.next_request_id(), control.token)
    poller = zmq.Poller()
    for _ in range(connections):
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDHWM, 16)
        dealer.connect(client._core.control.endpoint)
        poller.register(dealer, zmq.POLLIN | zmq.POLLOUT)
    print("flooding", len(frames[1]), flush=True)
    while True:
        for dealer, ready in poller.poll():
            while dealer.poll(0):
                dealer.recv_multipart()
            if ready & zmq.POLLOUT:
                dealer.send_multipart(frames, zmq.NOBLOCK)
"""

FLOODS = {  # plane, control connections, as uid 65534, nice
    "placements": ("handles", 1, False, 0),
    "refused hellos naming new tenants": ("hellos", 1, False, 0),
    "commits": ("control", 1, False, 0),
    "commits on 64 connections": ("control", 64, False, 0),
    "commits on 64 connections of another uid": ("control", 64, True, 0),
}


class Flooder(LineProcess):
    """The flooder of ``flood`` (a key of :data:`FLOODS`) against the daemon under ``run_dir``, flooding once made."""

    def __init__(self, run_dir: Path, flood: str) -> None:
        plane, connections, as_nobody, nice = FLOODS[flood]
        setting = (f"plane, connections, as_nobody, nice, NOBODY = {plane!r}, {connections}, {as_nobody}, {nice}, "
                   f"{NOBODY}\n")
        super().__init__(["-c", setting + FLOODER], env={"HBMD_RUN_DIR": str(run_dir)})
        if not self.readline().startswith("flooding"):
            raise RuntimeError(f"the flooder of {flood} did not start: {self.stderr_tail()}")


def engine_calls(kv: Any, seconds: float) -> tuple[list[float], list[str]]:
    """An engine's growth of ``kv`` (an ``ExtensibleTensor``) by a granule and a status, every :data:`TICK_S` for
    ``seconds``: each call's seconds, and every failure (counted, not just the first)."""
    granule = kv.granularity
    calls: list[float] = []
    errors: list[str] = []
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        tick = time.monotonic()
        try:
            if kv.num_bytes == kv.max_num_bytes:
                kv.release_physical()
            calls.append(_timed(lambda: kv.resize_(kv.num_bytes + granule)))
            calls.append(_timed(kv.client.status))
        except Exception as exc:  # every failure is counted, not just the first
            errors.append(f"engine: {type(exc).__name__}: {exc}")
        time.sleep(max(0.0, TICK_S - (time.monotonic() - tick)))
    return calls, errors


def _timed(call: Any) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def can_flood_as_nobody(flood: str) -> bool:
    """Whether this process may start ``flood``'s flooder: one of another uid needs root."""
    return not FLOODS[flood][2] or os.getuid() == 0
