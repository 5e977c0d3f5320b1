"""Timers around the steps of a commit, in the benchmark process and inside the daemon.

:class:`Probe` wraps functions (module attributes or methods) so that each
call records ``(label, start, end)`` in ``CLOCK_MONOTONIC`` nanoseconds, a
clock every process of the machine shares: the daemon's events line up with
the client's, and :func:`breakdown` sums both per measured operation.

Run as a script it is the daemon, ``python -m hbmd.daemon``, with its side of
a commit probed (the request dispatch, ``cuMemCreate``, the export, the FD
send, closing FDs, ``cuMemRelease``, the NVML query behind ``status``); the events are
written to ``--events FILE`` when it stops::

    python bench/probe.py --events /tmp/ev.json --backend cuda --device 0 --run-dir /tmp/hb
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

from common import percentile

Event = tuple[str, int, int]


class Probe:
    """Records every call of the wrapped functions until :meth:`restore` (or the ``with`` block ends)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attribute: str, label: str) -> None:
        original = getattr(owner, attribute)
        events = self.events
        clock = time.monotonic_ns

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                events.append((label, start, clock()))

        setattr(owner, attribute, timed)
        self._undo.append((owner, attribute, original))

    def restore(self) -> None:
        while self._undo:
            owner, attribute, original = self._undo.pop()
            setattr(owner, attribute, original)

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def client_probe() -> Probe:
    """The client's side of a commit and the in-process baseline's driver calls, probed.

    ``client.send_request``, ``client.decode_reply`` and ``client.file_datagram`` (a datagram of the handle socket
    read and filed, by the caller or by the listener thread) are parts of ``client.control_call`` and
    ``client.receive_fds``; ``client.import_leased`` is the listener's import of granted granules. On credit:
    ``drv.create`` is the client's own chunk, ``drv.export_fd`` its FD and ``client.send_bind`` the bind's send
    (the label counts every datagram the client sends: a leased granule's placement too).
    """
    import zmq
    from hbmd import driver
    from hbmd.client import transport
    from hbmd.client.inbox import Inbox
    from hbmd.client.lease import Lease
    from hbmd.client.transport import ControlChannel, HandleChannel

    probe = Probe()
    probe.wrap(ControlChannel, "call_with_id", "client.control_call")
    probe.wrap(zmq.Socket, "send_multipart", "client.send_request")
    probe.wrap(transport, "decode_frames", "client.decode_reply")
    probe.wrap(Inbox, "_read_and_file", "client.file_datagram")
    probe.wrap(Lease, "granted", "client.import_leased")
    probe.wrap(os, "close", "client.os_close")
    probe.wrap(Inbox, "receive_fds", "client.receive_fds")
    probe.wrap(HandleChannel, "send", "client.send_bind")
    for name in ("create", "export_fd", "import_fd", "map", "set_access", "release", "memset_async",
                 "context_synchronize", "make_current"):
        probe.wrap(driver, name, f"drv.{name}")
    return probe


def move_probe() -> Probe:
    """The client's side of a demote or promote (``ExtensibleTensor._reback``): the daemon's request, the copy into the
    new chunks (a promote's ``client.copy_into`` maps them at a scratch range and copies, then ``client.unmap_old``
    and ``client.map_new`` map them in place; a demote's ``client.move_into`` holds all three, the old chunks mapped
    again at a scratch range), and the finish; with the driver calls they make."""
    from hbmd import driver
    from hbmd.client.inbox import Inbox
    from hbmd.client.reservation import Reservation
    from hbmd.client.session import Client
    from hbmd.client.transport import ControlChannel

    probe = Probe()
    probe.wrap(Client, "move", "client.move_request")
    probe.wrap(Inbox, "receive_fds", "client.receive_fds")
    probe.wrap(Reservation, "copy_into", "client.copy_into")
    probe.wrap(Reservation, "move_into", "client.move_into")
    probe.wrap(Reservation, "unmap_all", "client.unmap_old")
    probe.wrap(Reservation, "map", "client.map_new")
    probe.wrap(Client, "finish_defragment", "client.finish")
    probe.wrap(ControlChannel, "call_with_id", "client.control_call")
    for name in ("import_fd", "retain", "map", "set_access", "unmap", "release", "copy_async", "context_synchronize",
                 "reserve", "unreserve"):
        probe.wrap(driver, name, f"drv.{name}")
    return probe


def daemon_probe() -> Probe:
    """The daemon's side: nested inside the client's ``client.control_call``.

    ``daemon.drain_control`` holds ``daemon.recv_request``, ``daemon.dispatch`` and ``daemon.send_reply``;
    ``daemon.dispatch`` holds ``daemon.read_request`` (the envelope opened), ``daemon.state_commit`` (admission and
    ``cuMemCreate``), ``daemon.queue_fds`` (export and ``send_fds``) and ``daemon.encode_reply``.
    ``daemon.look_after_sessions`` is the loop's work after each batch of events (lease top-ups among it).
    A move: ``daemon.state_move`` (the new tier's chunks made, host ones taken from the pool by ``daemon.pool_take``)
    and ``daemon.state_finish`` (the old tier's chunks released); ``daemon.create_host`` runs on the host pool's thread
    as well, beside the loop. A bind of chunks made on credit: ``daemon.drain_datagrams`` (every datagram of the
    handle plane read and handled) holds ``daemon.accept_chunk``, the check of each chunk (the FD's import, the
    allocation's properties and the size check's mappings).

    The loop's turns (:func:`turns`): ``daemon.turn`` marks the start of each; ``daemon.take_placements`` (every
    placing session's datagrams, read before a request), ``daemon.release_request`` (a ``release_physical``) and
    ``daemon.serve_leases`` (revokes and top-ups, holding ``daemon.top_up_lease``, the granules made) are parts of it.
    """
    import socket

    import zmq
    from hbmd import driver
    from hbmd.daemon.backends.pool import HostPool
    from hbmd.daemon.server import Server, loop
    from hbmd.daemon.server.buffers import BufferRequests
    from hbmd.daemon.server.handles import HandlePlane
    from hbmd.daemon.server.outbox import Outbox
    from hbmd.daemon.server.session import SessionNotices
    from hbmd.daemon.state import State
    from hbmd.daemon.state.buffers import Buffers
    from hbmd.daemon.state.chunks import Chunks
    from hbmd.driver import nvml

    probe = Probe()
    probe.wrap(Server, "_drain_control", "daemon.drain_control")
    probe.wrap(Server, "_dispatch", "daemon.dispatch")
    probe.wrap(Server, "_look_after_sessions", "daemon.look_after_sessions")
    probe.wrap(HandlePlane, "_drain_datagrams", "daemon.drain_datagrams")
    probe.wrap(Chunks, "accept", "daemon.accept_chunk")
    probe.wrap(HandlePlane, "new_turn", "daemon.turn")
    probe.wrap(HandlePlane, "take_placements", "daemon.take_placements")
    probe.wrap(BufferRequests, "release", "daemon.release_request")
    probe.wrap(SessionNotices, "serve_leases", "daemon.serve_leases")
    probe.wrap(Outbox, "top_up_lease", "daemon.top_up_lease")
    probe.wrap(zmq.Socket, "recv_multipart", "daemon.recv_request")
    probe.wrap(zmq.Socket, "send_multipart", "daemon.send_reply")
    probe.wrap(loop, "read_envelope", "daemon.read_request")
    probe.wrap(loop, "encode_frames", "daemon.encode_reply")
    probe.wrap(State, "commit", "daemon.state_commit")
    probe.wrap(State, "move", "daemon.state_move")
    probe.wrap(Buffers, "finish_defragment", "daemon.state_finish")
    probe.wrap(HostPool, "take", "daemon.pool_take")
    probe.wrap(driver, "create_host", "daemon.create_host")
    probe.wrap(Outbox, "deliver", "daemon.queue_fds")
    probe.wrap(os, "close", "daemon.os_close")
    probe.wrap(driver, "create", "daemon.create")
    probe.wrap(driver, "export_fd", "daemon.export_fd")
    probe.wrap(driver, "release", "daemon.release")
    probe.wrap(socket, "send_fds", "daemon.send_fds")
    probe.wrap(nvml, "free_bytes", "daemon.nvml_free_bytes")
    return probe


def breakdown(events: list[Event], windows: list[tuple[int, int]]) -> dict[str, float]:
    """Median over ``windows`` of the time each label's events that start inside a window add up to (µs)."""
    ordered = sorted(events, key=lambda e: e[1])
    starts = [e[1] for e in ordered]
    labels = sorted({e[0] for e in ordered})
    per_label: dict[str, list[int]] = defaultdict(list)
    for begin, end in windows:
        sums: dict[str, int] = defaultdict(int)
        for label, start, stop in ordered[bisect.bisect_left(starts, begin) : bisect.bisect_left(starts, end)]:
            sums[label] += stop - start
        for label in labels:
            per_label[label].append(sums.get(label, 0))
    return {label: round(percentile(values, 50) / 1e3, 2) for label, values in per_label.items() if any(values)}


def turns(events: list[Event], begin: int, end: int, longest: int = 5) -> dict[str, Any]:
    """The daemon's turns that started within ``[begin, end)``: how long they took (ms), and what filled the
    ``longest`` of them (the ms each label's events that started inside add up to, largest first)."""
    ordered = sorted(events, key=lambda e: e[1])
    starts = [e[1] for e in ordered]
    marks = [start for label, start, _ in ordered if label == "daemon.turn"]
    spans = [(b - a, a, b) for a, b in itertools.pairwise(marks) if begin <= a < end]
    if not spans:
        return {"turns": 0}
    ms = [span / 1e6 for span, _, _ in spans]
    filled = []
    for span, a, b in sorted(spans, reverse=True)[:longest]:
        sums: dict[str, int] = defaultdict(int)
        for label, start, stop in ordered[bisect.bisect_left(starts, a) : bisect.bisect_left(starts, b)]:
            if label != "daemon.turn":
                sums[label] += stop - start
        filled.append({"ms": round(span / 1e6, 2),
                       "steps_ms": {k: round(v / 1e6, 2) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])}})
    return {"turns": len(spans), "p50_ms": round(percentile(ms, 50), 2), "p90_ms": round(percentile(ms, 90), 2),
            "p99_ms": round(percentile(ms, 99), 2), "max_ms": round(max(ms), 2), "longest": filled}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--events":
        print("usage: probe.py --events FILE <hbmd arguments>", file=sys.stderr)
        return 2
    events_path, daemon_args = argv[1], argv[2:]
    from hbmd.daemon.main import main as daemon_main

    probe = daemon_probe()
    try:
        return daemon_main(daemon_args)
    finally:
        probe.restore()
        with open(events_path, "w") as out:
            json.dump(probe.events, out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
