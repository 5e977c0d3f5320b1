"""The messages of the takeover channel (:mod:`.takeover`), each a type with its wire form and its checks.

Every message but the state's raw pieces is one msgpack value in one
datagram; the wire form is that of takeover wire version 1, which daemons
before these types spoke too, so either side may be an older daemon. A peer
is another process of the same uid (the kernel vouches for that), yet a
faulty one must cost the takeover, never the daemon: ``decode`` checks every
field's type and range, and raises ``ValueError`` saying what does not hold.
Sizes this process can afford (the state's, the FD count) are the channel's
to judge, not the message's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hbmd.proto.codec import packb

from ..notify import check_fdname

MAX_REASON_CHARS = 1000
"""A refusal's reason is cut to this on either side: it ends up in a log line."""


def _count(message: dict[Any, Any], key: str) -> int | None:
    """The field ``key`` where it is a non-negative integer (a bool is not one); None otherwise."""
    value = message.get(key)
    return value if type(value) is int and value >= 0 else None


@dataclasses.dataclass(frozen=True)
class TakeoverRequest:
    """New → old, first: ``{"takeover": wire version, "protocol": protocol major}``."""

    wire_version: int
    protocol_major: int

    def encode(self) -> bytes:
        return packb({"takeover": self.wire_version, "protocol": self.protocol_major})

    @classmethod
    def decode(cls, message: dict[Any, Any]) -> TakeoverRequest:
        version, major = message.get("takeover"), message.get("protocol")
        if type(version) is not int or type(major) is not int:
            raise ValueError("malformed request: 'takeover' and 'protocol' must be integers")
        return cls(version, major)


@dataclasses.dataclass(frozen=True)
class Refused:
    """Old → new, instead of an offer, and the end: ``{"refused": why}``."""

    reason: str

    def encode(self) -> bytes:
        return packb({"refused": self.reason[:MAX_REASON_CHARS]})

    @classmethod
    def decode(cls, message: dict[Any, Any]) -> Refused:
        """Any refusal refuses: a reason that is not text is shown as what it is, cut short."""
        reason = message["refused"]
        return cls(reason[:MAX_REASON_CHARS] if type(reason) is str else repr(reason)[:80])


@dataclasses.dataclass(frozen=True)
class Offer:
    """Old → new: ``{"state_bytes": n, "fds": m}``, the size of the state that follows in raw pieces, then how many
    FDs follow, in batches of :class:`FdNames`."""

    state_bytes: int
    fd_count: int

    def encode(self) -> bytes:
        return packb({"state_bytes": self.state_bytes, "fds": self.fd_count})

    @classmethod
    def decode(cls, message: dict[Any, Any]) -> Offer:
        state_bytes, fd_count = _count(message, "state_bytes"), _count(message, "fds")
        if state_bytes is None or fd_count is None:
            raise ValueError(f"malformed offer: {sorted(map(str, message))[:8]}")
        return cls(state_bytes, fd_count)


def answer_to_request(message: dict[Any, Any]) -> Refused | Offer:
    """What the old daemon answered a :class:`TakeoverRequest` with; ``ValueError`` where it is neither."""
    return Refused.decode(message) if "refused" in message else Offer.decode(message)


@dataclasses.dataclass(frozen=True)
class FdNames:
    """Old → new: the names of the FDs attached to the same datagram, in order, as a msgpack list of strings."""

    names: tuple[str, ...]

    def encode(self) -> bytes:
        return packb(list(self.names))

    @classmethod
    def decode(cls, value: Any) -> FdNames:
        """Every name one the FD store accepts (:func:`hbmd.daemon.notify.check_fdname`)."""
        if not isinstance(value, list) or not all(type(name) is str for name in value):
            raise ValueError("FD names that are not a list of strings")
        for name in value:
            try:
                check_fdname(name)
            except ValueError as exc:
                raise ValueError(f"an FD name the FD store refuses ({exc})") from None
        return cls(tuple(value))


@dataclasses.dataclass(frozen=True)
class Serving:
    """New → old, last: ``{"serving": true}``, the new daemon serves and the old one may exit. Closing without it
    abandons the takeover."""

    def encode(self) -> bytes:
        return packb({"serving": True})

    @classmethod
    def decode(cls, message: dict[Any, Any]) -> Serving:
        if message.get("serving") is not True:
            raise ValueError(f"not the word that it serves: {sorted(map(str, message))[:8]}")
        return cls()
