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
from typing import TYPE_CHECKING

from .transport import HandleChannel

if TYPE_CHECKING:
    from .session import Client

log = logging.getLogger("hbmd.client")

POLL_S = 0.2
"""How often the thread looks whether its client was dropped or closed, with nothing arriving."""


class Listener:
    """One listener thread per handle channel of a client, started on demand; it holds its client only while serving
    what arrived."""

    def __init__(self, client: Client) -> None:
        self._client = weakref.ref(client)
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        """Whether a listener reads the handle socket beside the engine's calls."""
        return self._thread is not None

    def start(self) -> None:
        """Listen on the client's handle channel, where no thread does yet."""
        client = self._client()
        if self._thread is None and client is not None:
            self._thread = threading.Thread(target=_listen, args=(self._client, client._handles), name="hbmd-listener",
                                            daemon=True)
            self._thread.start()

    def moved(self) -> None:
        """The client speaks on a new handle channel (the session was taken back): listen there. The old thread ends
        with its channel."""
        self._thread = None
        self.start()

    def stop(self, handles: HandleChannel) -> None:
        """End the thread (its client is closing ``handles``), waiting for what it serves; nothing from itself."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            handles.shut()  # wakes the thread at once: its socket reads EOF
            thread.join()


def _listen(client_ref: weakref.ref[Client], handles: HandleChannel) -> None:
    while handles.inbox.poll(POLL_S):
        client = client_ref()
        if client is None or client.closed:
            return
        try:
            client.leasing.serve()
            client._pressure.serve()
        except Exception:
            if not client.closed:
                log.exception("the hbmd listener thread failed on a datagram")
        del client
    client = client_ref()
    if client is None:
        return
    gone = not client.closed and client._handles is handles and client._recovery.credential
    if gone and not client.resumed() and not client.closed:
        log.warning("%s", client._recovery.lost)
