"""Processes that may still write an orphan's pages: its last holder, where its session ended while it lived.

A session ends when its handle socket closes or, after a restart, when its
client does not come back in time; its persistent buffers become orphans.
Its process may live on and map them: a client that closed without a
detach, an engine stopped past ``--resume-timeout`` (issue #61). A graft or
an attach by another process would hand it pages that process can still
write. So the daemon watches the last holder (a pidfd, readable once the
process has exited) and hands the orphan to another process only once it is
gone. What it cannot see it cannot promise: a child the holder forked
(the client's host mappings are not inherited, ``MADV_DONTFORK``; on a GPU
a child has no context to reach them) or a process whose pid the daemon
reads as 0 and whose pidfd the kernel does not give (before Linux 6.5).
"""

from __future__ import annotations

import os
import select


class Writer:
    """The last holder of an orphan, watched through a pidfd of its own (closed by :meth:`close`)."""

    __slots__ = ("_pidfd", "pid")

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd = pidfd

    @classmethod
    def of(cls, pid: int, pidfd: int) -> Writer | None:
        """A watch of process ``pid`` through a copy of ``pidfd`` (-1: one opened on ``pid``, where it is not 0), or
        None where it has exited already or cannot be watched."""
        try:
            own = os.dup(pidfd) if pidfd >= 0 else os.pidfd_open(pid) if pid > 0 else -1
        except OSError:
            return None  # exited (ESRCH), or a kernel without pidfds: nothing the daemon can watch
        if own < 0:
            return None
        writer = cls(pid, own)
        if writer.gone():
            writer.close()
            return None
        return writer

    def copy(self) -> Writer:
        """Another watch of the same process, closed on its own."""
        return Writer(self.pid, os.dup(self._pidfd))

    def gone(self) -> bool:
        """Whether the process has exited."""
        poller = select.poll()
        poller.register(self._pidfd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
