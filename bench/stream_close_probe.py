"""Why the daemon does not serve its control plane with a ZMQ_STREAM socket: a connection it closes can stay open.

A STREAM socket hands over each connection's bytes and reads a bounded
number of chunks ahead (``RCVHWM``). A peer sends more than that and hangs
up; the application reads the first chunk, finds it wrong and asks libzmq to
close the connection (an empty message). libzmq ends a connection only on a
read error ("The engine is not terminated until we detect input error",
``stream_engine_base.cpp``), and once asked to close it reads no more: the
descriptor stays open, the peer's bytes unread in the kernel, for good, and
terminating the context waits for it forever (so this probe never does).

    python3 bench/stream_close_probe.py    # prints one JSON line; exit 1 where a descriptor was kept

Each case connects a raw Unix socket, sends a ZMTP greeting and READY and
then ``bytes`` of a message that never ends, hangs up, and lets the STREAM
socket's owner read what it can and close the connection at the first chunk.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import tempfile
import time

import zmq

GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
READY = b"\x04\x1a\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"


def sockets_open() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except FileNotFoundError:
            pass  # the listing's own descriptor
    return count


def case(context: zmq.Context, sent_bytes: int, hang_up_first: bool) -> dict[str, object]:
    with tempfile.TemporaryDirectory(dir="/tmp") as directory:
        stream = context.socket(zmq.STREAM)
        stream.setsockopt(zmq.LINGER, 0)
        stream.setsockopt(zmq.RCVHWM, 16)
        stream.bind(f"ipc://{directory}/control")
        peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        peer.connect(f"{directory}/control")
        peer.setblocking(False)
        data = GREETING + READY + b"\x03" + struct.pack(">Q", 1 << 30) + bytes(sent_bytes)
        sent = 0
        try:
            while sent < len(data):
                sent += peer.send(data[sent:])
        except BlockingIOError:
            pass
        time.sleep(0.1)
        both_ends = sockets_open()  # the peer's and the one libzmq accepted
        if hang_up_first:
            peer.close()
        closed = set()
        refused: list[str] = []
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if not stream.poll(50):
                continue
            identity, chunk = stream.recv_multipart()
            if chunk and identity not in closed:
                try:
                    stream.send_multipart([identity, b""], zmq.NOBLOCK)
                    closed.add(identity)
                except zmq.ZMQError as exc:
                    refused.append(exc.strerror)
        if not hang_up_first:
            peer.close()
            time.sleep(0.5)
        kept = sockets_open() - (both_ends - 2)
        stream.close(linger=0)
    return {"bytes_sent": sent, "peer_hung_up_before_the_close": hang_up_first, "closes_refused": refused[:1],
            "descriptors_kept": kept}


def main() -> int:
    context = zmq.Context()
    cases = [case(context, size, first) for size in (1000, 100_000, 400_000) for first in (False, True)]
    print(json.dumps({"zmq": zmq.zmq_version(), "pyzmq": zmq.__version__, "cases": cases}), flush=True)
    return 1 if any(c["descriptors_kept"] for c in cases) else 0


if __name__ == "__main__":
    os._exit(main())  # not sys.exit: the context's end would wait for the descriptors kept
