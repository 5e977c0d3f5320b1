"""Receiving a datagram and the file descriptors it carries (``SCM_RIGHTS``), close-on-exec.

``socket.recv_fds`` drops its ``flags`` argument (CPython 3.11 and 3.12), so
neither ``MSG_CMSG_CLOEXEC`` nor ``MSG_DONTWAIT`` reach the kernel through it.
Client and daemon both receive chunk FDs this way instead: an FD that is not
close-on-exec from the moment it arrives is inherited by any process spawned
meanwhile, and with it a chunk's memory.
"""

from __future__ import annotations

import array
import socket

_INT = array.array("i").itemsize


def receive_with_fds(sock: socket.socket, bufsize: int, maxfds: int, flags: int = 0) -> tuple[bytes, list[int], int]:
    """One datagram, the FDs that came with it (close-on-exec) and the message flags (``MSG_CTRUNC``...)."""
    data, ancillary, msg_flags, _ = sock.recvmsg(
        bufsize, socket.CMSG_SPACE(maxfds * _INT), flags | socket.MSG_CMSG_CLOEXEC
    )
    fds = array.array("i")
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % _INT])
    return data, list(fds), msg_flags
