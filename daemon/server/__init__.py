"""The daemon's sockets: the ZeroMQ control plane and the Unix handle plane: one module per job, named for it.

- ``loop.py``: :class:`Server`, the lifecycle (bind, publish, run, stop,
  close), the poll loop and the dispatch of control requests; what runs on
  which thread, and under which lock.
- ``registry.py``: the request handler classes, ``@handles`` and the handler table the
  daemon checks before it starts.
- ``buffers.py``, ``session.py``, ``admin.py``: the request handlers, one
  class per protocol family as in ``hbmd.proto``; ``session.py`` also sends
  what the daemon tells sessions unasked (reclaims, lease grants and revokes).
- ``handles.py``: the handle plane: accept, ``SO_PEERCRED``, pidfds, the
  hello, the datagrams clients send (leased granules placed and returned),
  the end of a session.
- ``outbox.py``: FDs on their way to sessions: deliveries, flow control and
  draining.
- ``control_socket.py``: the control endpoint's listener and connections,
  speaking ZMTP to the clients' DEALERs (``zmtp.py``, bytes in and frames
  out, within bounds); ``control.py``: control requests between it and
  their answers: queued by the process that sent them, uids and processes
  in turn.
- ``hellos.py``: handle-plane connections waiting for their hello, bounded
  per uid and in all.
- ``connection.py``: one handle-plane connection; ``ratelimit.py``: warnings
  a peer can provoke.
"""

from .admin import MAX_TENANTS_LISTED
from .control import MAX_QUEUED_PER_PEER
from .hellos import HELLO_TIMEOUT_S, MAX_PENDING_HELLOS, MAX_PENDING_HELLOS_PER_UID
from .loop import AlreadyRunning, InvariantViolated, Server
from .outbox import MAX_FDS_IN_FLIGHT, MAX_FDS_IN_FLIGHT_PER_UID, MAX_QUEUED_BATCHES
from .registry import HandlerTableError, RequestHandlers, handler_table, handles

__all__ = [
    "HELLO_TIMEOUT_S",
    "MAX_FDS_IN_FLIGHT",
    "MAX_FDS_IN_FLIGHT_PER_UID",
    "MAX_PENDING_HELLOS",
    "MAX_PENDING_HELLOS_PER_UID",
    "MAX_QUEUED_BATCHES",
    "MAX_QUEUED_PER_PEER",
    "MAX_TENANTS_LISTED",
    "AlreadyRunning",
    "HandlerTableError",
    "InvariantViolated",
    "RequestHandlers",
    "Server",
    "handler_table",
    "handles",
]
