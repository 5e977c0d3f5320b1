"""The client's listener: a thread that serves what the daemon sends unasked on the handle socket.

Leased granules, credit and their revokes, requests for room (served by
:class:`~hbmd.client.leasing.Leasing` and :class:`~hbmd.client.pressure.Pressure`),
and the daemon's hang-up: the listener takes the session back as soon as
the daemon serves again, so a restart is over before the engine's next
call, however long that is.
"""

from __future__ import annotations

import logging
import threading
import weakref

from .core import SessionCore
from .leasing import Leasing
from .pressure import Pressure
from .recovery import Recovery
from .transport import HandleChannel

log = logging.getLogger("hbmd.client")

POLL_S = 0.2
"""How often the thread looks whether its client was dropped or closed, with nothing arriving."""


class Listener:
    """One listener thread per handle channel of a session, started on demand: it serves ``leasing`` and
    ``pressure`` what arrived, and takes the session back through ``recovery`` when the daemon hangs up.

    The thread holds the listener weakly, and strongly only while serving
    what arrived: a client dropped unclosed drops its listener, and the
    thread ends.
    """

    def __init__(self, core: SessionCore, recovery: Recovery, leasing: Leasing, pressure: Pressure) -> None:
        self._core = core
        self._recovery = recovery
        self._leasing = leasing
        self._pressure = pressure
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Whether a listener reads the handle socket beside the engine's calls."""
        return self._thread is not None

    def start(self) -> None:
        """Listen on the session's handle channel, where no thread does yet."""
        if self._thread is None:
            self._thread = threading.Thread(target=_listen, args=(weakref.ref(self), self._core.handles),
                                            name="hbmd-listener", daemon=True)
            self._thread.start()

    def moved(self) -> None:
        """The session speaks on a new handle channel (it was taken back): listen there. The old thread ends with its
        channel."""
        self._thread = None
        self.start()

    def stop(self) -> None:
        """End the thread (its client is closing the session's handle channel), waiting for what it serves; nothing
        from itself."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            self._core.handles.shut()  # wakes the thread at once: its socket reads EOF
            thread.join()

    def _serve(self) -> None:
        """What arrived: grants, revokes and credit, then the daemon's requests for room."""
        try:
            self._leasing.serve()
            self._pressure.serve()
        except Exception:
            if not self._core.closed:
                log.exception("the hbmd listener thread failed on a datagram")

    def _hung_up(self, handles: HandleChannel) -> None:
        """The daemon closed ``handles``: take the session back, where it is still this session's channel."""
        core = self._core
        gone = not core.closed and core.handles is handles and self._recovery.credential
        if gone and not self._recovery.resumed() and not core.closed:
            log.warning("%s", self._recovery.lost)


def _listen(listener_ref: weakref.ref[Listener], handles: HandleChannel) -> None:
    while handles.inbox.poll(POLL_S):
        listener = listener_ref()
        if listener is None or listener._core.closed:
            return
        listener._serve()
        del listener
    listener = listener_ref()
    if listener is not None:
        listener._hung_up(handles)
