"""The session core: what every part of a client shares, and nothing else.

A :class:`~hbmd.client.Client` is composed of parts, each given this core
and the other parts it uses when it is made (see ``Client.__init__``):
:class:`~hbmd.client.recovery.Recovery` (calls, and the session across a
daemon restart), :class:`~hbmd.client.leasing.Leasing` (commits without a
round trip), :class:`~hbmd.client.pressure.Pressure` (the daemon's requests
for room) and :class:`~hbmd.client.listener.Listener` (the thread that
serves what the daemon sends unasked). The core holds the session's facts
and channels; no part reaches into another's private state.
"""

from __future__ import annotations

import os
import threading
import weakref

from hbmd.proto import Hello, Message, Welcome
from hbmd.proto.errors import HbmdError
from hbmd.proto.instance import InstancePaths
from hbmd.proto.undo import Undo

from .mapper import Mapper
from .transport import ControlChannel, FdCloser, HandleChannel


class ForkedClient(HbmdError):
    """A client was used in a child process after ``fork()``; connect anew there."""


class SessionCore:
    """One session's channels, its call lock and the facts its welcome gave.

    ``handles`` and ``welcome`` change when the session is taken back from a
    restarted daemon (:meth:`go_on`); read them afresh rather than keep them.

    Lock order. A thread that holds one of these locks may take those below
    it, never one above; only the call lock is held while waiting for the
    daemon:

    1. :attr:`lock`, the call lock (``Client.exclusive``, reentrant): one call
       of the session at a time, held from a request to the last FD batch
       of its delivery, across a resume, a growth from the lease, and a
       demote served for the daemon.
    2. a :class:`~hbmd.client.lease.Lease`'s or
       :class:`~hbmd.client.lease.Credit`'s own lock: which granules and
       bytes this process holds. The credit's is held while it sends a bind
       or a return and lets go of a chunk made ahead (so it takes 3 and 4);
       the lease's is never held while it sends or maps.
    3. the handle socket's lock (:attr:`Inbox.lock <hbmd.client.inbox.Inbox.lock>`):
       a read, a filing or a send on the socket.
    4. the mapper's lock (:attr:`mapper`): making the mapper, once.

    3 and 4 are leaves: nothing is taken under either.
    """

    def __init__(
        self, paths: InstancePaths, hello: Hello, *, timeout: float, resume_timeout: float, spin: float,
        mapper: Mapper | None,
    ) -> None:
        self.paths = paths
        self.timeout = timeout
        self.resume_timeout = resume_timeout
        """Seconds a call waits for a daemon that went away to come back."""
        self.pid = os.getpid()
        """The process the session belongs to: in a child forked from it, every call raises :class:`ForkedClient`."""
        self.hello = hello
        """The hello of a new session: sent again where the session must start over."""
        with Undo() as undo:
            self.handles = HandleChannel(paths, timeout)
            undo.push(self.handles.close)
            self.welcome = self.handles.handshake(hello)
            self.control = ControlChannel(paths, self.welcome.token, timeout, session=self.handles,
                                          replies_with_fds=self._replies_with_fds(self.welcome), spin=spin)
        self.lock = threading.RLock()
        """The call lock (1 in the lock order): the reclaim listener's callback may call in while the engine does."""
        self.closed = False
        self._mapper = mapper
        self._mapper_lock = threading.Lock()
        self._closer: FdCloser | None = None
        _cores.add(self)

    @property
    def session_id(self) -> int:
        return self.welcome.session_id

    @property
    def granularity(self) -> int:
        return self.welcome.granularity

    @property
    def mapper(self) -> Mapper:
        """Maps the instance's chunks into this process: host ``mmap`` or CUDA VMM, made at first use."""
        if self._mapper is None:
            with self._mapper_lock:  # the listener imports leased granules with it too
                if self._mapper is not None:
                    return self._mapper
                if self.welcome.backend == "host":
                    from .host import HostMapper

                    self._mapper = HostMapper(self.granularity)
                else:
                    from .cuda import CudaMapper

                    self._mapper = CudaMapper(self.welcome.device_uuid, self.granularity)
        return self._mapper

    def send(self, msg: Message) -> None:
        """Send a datagram on the session's handle channel, whichever it is now."""
        self.handles.send(msg)

    def fd_closer(self) -> FdCloser:
        """The thread that closes received FDs off the commit's path, started at first use."""
        if self._closer is None:
            self._closer = FdCloser()
        return self._closer

    @property
    def forked(self) -> bool:
        """Whether this process is a child forked from the one the session belongs to."""
        return os.getpid() != self.pid

    def check_not_forked(self) -> None:
        """Raise :class:`ForkedClient` in a process forked from this session's: the session is the parent's."""
        if self.forked:
            raise ForkedClient(
                "this hbmd client belongs to the parent process; call hbmd.client.connect() in the child"
            )

    def go_on(self, handles: HandleChannel, welcome: Welcome) -> None:
        """Speak to the daemon that took the session back (or started it over) through ``handles``, as ``welcome``
        says."""
        self.handles = handles
        self.control.resume(welcome.token, handles, self._replies_with_fds(welcome))
        self.welcome = welcome

    def _replies_with_fds(self, welcome: Welcome) -> bool:
        """Whether a commit's reply rides with its FDs: the client's hellos ask for it, and the daemon of ``welcome``
        knows to (1.7)."""
        return self.hello.replies_with_fds and tuple(welcome.version) >= (1, 7)

    def close(self) -> None:
        """Close both channels and the FD closer; the caller holds the call lock."""
        self.control.close()
        self.handles.close()
        if self._closer is not None:
            self._closer.stop()

    def let_go_after_fork(self) -> None:
        """In a forked child: close the inherited handle socket, so the child never keeps the parent's session.

        Only the raw socket: the ZeroMQ one belongs to a context that must
        not be touched after fork. The session counts as closed here.
        """
        self.closed = True
        self.handles.close()


_cores: weakref.WeakSet[SessionCore] = weakref.WeakSet()
"""Every session core of this process, for the fork hook."""


def _let_go_after_fork() -> None:
    for core in list(_cores):
        core.let_go_after_fork()


os.register_at_fork(after_in_child=_let_go_after_fork)
