"""Which method answers which request: request classes, the ``@handles`` mark, and the table checked before the daemon
starts."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from hbmd.proto import Message, Request

from ..backends import A, C
from ..state import State
from .handles import HandlePlane

Handler = TypeVar("Handler", bound=Callable[..., Message])


class HandlerTableError(RuntimeError):
    """The server's handlers and the protocol's requests do not match one to one: the daemon must not start."""


class RequestHandlers(Generic[A, C]):
    """The handlers of one protocol family: the state they serve and the handle plane their sessions are on."""

    def __init__(self, state: State[A, C], plane: HandlePlane[A, C]) -> None:
        self.state = state
        self.plane = plane


def handles(*kinds: type[Request]) -> Callable[[Handler], Handler]:
    """Mark a method of a :class:`RequestHandlers` as the handler of each request in ``kinds``.

    The method is called as ``(conn, request_id, msg)`` and returns the
    request's ``Reply``; one method may answer several requests of one
    family that differ only in how they say the same thing
    (``Commit`` and ``CommitSegments``).
    """
    if not kinds:
        raise TypeError("@handles needs at least one request kind")

    def mark(method: Handler) -> Handler:
        method.handles = kinds  # type: ignore[attr-defined]
        return method

    return mark


def handler_table(classes: Iterable[type], request_kinds: list[type[Request]]) -> dict[type[Request], tuple[type, str]]:
    """The class and method name handling each request kind, checked against ``request_kinds``.

    Raises :class:`HandlerTableError` when a request has no handler, a handler
    handles something that is not a request, or two handle the same one.
    """
    table: dict[type[Request], tuple[type, str]] = {}
    for cls in classes:
        for name in dir(cls):
            for kind in getattr(getattr(cls, name), "handles", ()):
                where = f"{cls.__name__}.{name}"
                if not (isinstance(kind, type) and issubclass(kind, Request)) or kind not in request_kinds:
                    raise HandlerTableError(f"{where} handles {kind!r}, which is not a request of the protocol")
                if kind in table:
                    first_class, first_name = table[kind]
                    first = f"{first_class.__name__}.{first_name}"
                    raise HandlerTableError(f"{kind.KIND} is handled twice: by {first} and {where}")
                table[kind] = (cls, name)
    missing = [kind.KIND for kind in request_kinds if kind not in table]
    if missing:
        raise HandlerTableError(f"the server has no handler for {', '.join(missing)}")
    return table
