"""Message registry and msgpack codec.

A message is a frozen dataclass registered under a ``KIND`` string. On the
wire it is a string-keyed msgpack map of its fields; fields the receiver does
not know are ignored (so a minor version can add fields), missing required
fields and values of the wrong type are a :class:`ProtocolError`. Never pickle.

Control-plane frames are ``[kind, payload]`` where ``payload`` is a map
``{"id": request id, "token": session token, "body": fields}``; routing reads
only the ``kind`` frame. Handle-plane datagrams are one map
``{"kind": kind, "body": fields}``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

import msgpack

from .errors import HbmdError, InvalidRequest, ProtocolError, error_from_wire

PROTOCOL_VERSION = (1, 14)
"""1.1 added uneven segments (``segment_capacities``, ``CommitSegments``), ``Detach``, ``Remap``, the
``session_lost`` error code and the status figures ``admissible_bytes`` and ``held_back_bytes``; 1.2 an
admin's ``Delete.owner_uid``, ``StatusReply.tenants_left_out`` and sealed buffers (``Seal``, ``readonly`` on
``Attach`` and ``Detach``, ``sealed`` and ``readers`` in ``BufferInfo``); 1.3 leases (``Hello.lease``,
``Welcome.lease_bytes``, the ``LeaseGrant``/``LeaseRevoke``/``LeasePlace``/``LeaseReturn`` datagrams,
``BufferInfo.shareable`` and ``leased_bytes`` in status and sessions); 1.4 resuming a session across a daemon
restart (``Hello.resume_session``/``resume_credential``, ``Welcome.resume_credential``/``lease_chunk_ids``, a
request sent again under its id is answered again, not done twice); 1.5 declaring a buffer again after a restart
after a cold restart (``Redeclare``, ``BufferInfo.held_elsewhere``), the config file and its last reload in status
(``config_path``, ``config_loaded_at``, ``config_reload_failed_at``, ``config_reload_error``); 1.6 the host tier
(``Move``, ``BufferInfo.tier``, ``TenantInfo.host_bytes``, the host figures in status); 1.7 a commit's reply riding
with its FDs on the handle socket (``Hello.replies_with_fds``, ``FdBatch.reply``); 1.8 credit, commits in chunks
the client makes itself (``Welcome.credit_bytes``, the ``CreditGrant``/``CreditRevoke``/``OwnChunks``/
``CreditReturn`` datagrams); 1.9 the tenant charged in the welcome (``Welcome.tenant``/``tenant_note``), and in status
the bytes held for other tenants' guarantees and the credit (``StatusReply.held_for_guarantees_bytes``/
``credit_bytes``); 1.10 lists of sessions and buffers in pages (``after``, ``more``) and asked for by session, name
or user (``ListSessions.session_id``, ``ListBuffers.name``/``owner_uid``); 1.11 grafting an orphan's chunks into a
session's empty buffer (``Graft``) and an orphan's grace period (``CreateBuffer.keep_orphan_s``; in ``BufferInfo`` it,
``orphaned_at``, ``expires_at``, ``last_holder`` and ``last_holder_pid``); 1.12 starting a session over after a
cold restart on the credential that resumed it (``Hello.start_over``, ``Welcome.started_over``); 1.13 the proof that a
session held a persistent buffer's name, to declare it again under that name (``BufferInfo.name_proof``,
``Redeclare.name_proof``); 1.14 how long a persistent buffer's name has been held unsealed
(``BufferInfo.unsealed_since``). A 1.0 peer ignores what it does not know."""
MAX_FRAME_BYTES = 4 << 20
MAX_REQUEST_BYTES = 1 << 20
"""The largest request a daemon reads: the longest a client sends, a buffer's 65,536 segment sizes, takes under
600 KiB. A larger one is refused before it is decoded, which for megabytes of small items would take long."""
MAX_MESSAGE_CHARS = 1000
MAX_DETAIL_CHARS = 256

M = TypeVar("M", bound="Message")
T = TypeVar("T")

_KINDS: dict[str, type[Message]] = {}


class Message:
    """Base of every wire message; subclasses are made with :func:`message`."""

    KIND: ClassVar[str] = ""
    max_list_items: ClassVar[int] = 0
    """A longer list than the receiver's bound that this kind may carry (:func:`read_envelope`); 0: none."""


R = TypeVar("R", bound=Message)


class Request(Message, Generic[R]):
    """A control-plane request answered by a reply of type ``R`` (or an :class:`ErrorReply`).

    The reply type is named once, as the base's parameter
    (``class Commit(Request[Committed])``), and read back as ``Reply``: the
    client's typed ``call`` and the daemon's handler table both come from it.
    """

    Reply: ClassVar[type[Message]]
    changes_state: ClassVar[bool] = True
    """False for a request that only reads: sent again after a daemon restart, it is simply answered anew, so its
    answer is not kept (nor journaled) for that."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for base in getattr(cls, "__orig_bases__", ()):
            if typing.get_origin(base) is Request:
                (reply,) = typing.get_args(base)
                if not (isinstance(reply, type) and issubclass(reply, Message)) or issubclass(reply, Request):
                    raise TypeError(f"{cls.__name__}: a request's reply must be a message that is not a request")
                cls.Reply = reply
                return
        if not hasattr(cls, "Reply"):
            raise TypeError(f"{cls.__name__}: name the reply type, as in Request[ReplyMessage]")


def requests() -> list[type[Request]]:
    """Every registered request kind, in kind order: what a server must handle."""
    return sorted((cls for cls in _KINDS.values() if issubclass(cls, Request)), key=lambda cls: cls.KIND)


@typing.dataclass_transform(frozen_default=True)
def message(kind: str) -> Callable[[type[M]], type[M]]:
    """Class decorator: make a frozen dataclass and register it under ``kind``."""

    def register(cls: type[M]) -> type[M]:
        if kind in _KINDS:
            raise ValueError(f"message kind {kind!r} registered twice")
        cls = dataclasses.dataclass(frozen=True)(cls)
        cls.KIND = kind
        _KINDS[kind] = cls
        return cls

    return register


@typing.dataclass_transform(frozen_default=True)
def record(cls: type[T]) -> type[T]:
    """Class decorator for a plain frozen value nested inside messages."""
    return dataclasses.dataclass(frozen=True)(cls)


def kind_class(kind: str) -> type[Message]:
    try:
        return _KINDS[kind]
    except KeyError:
        raise ProtocolError(f"unknown message kind {kind[:64]!r}") from None


_SCALARS = frozenset({int, str, bool, float, bytes, type(None)})
_ENCODERS: dict[type, Callable[[Any], dict[str, Any]]] = {}


def to_wire(value: Any) -> Any:
    """Turn a message or record (recursively) into msgpack-ready values.

    Every request and reply goes through here, so a record type's encoder
    is built once (:func:`_record_encoder`) and found first.
    """
    encode = _ENCODERS.get(type(value))
    if encode is not None:
        return encode(value)
    cls = type(value)
    if cls in _SCALARS:
        return value
    if isinstance(value, (list, tuple)):
        if all(type(v) in _SCALARS for v in value):
            return value  # sizes, ids: msgpack packs them as they are
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        encode = _ENCODERS[cls] = _record_encoder(cls)
        return encode(value)
    return value


def _record_encoder(cls: type) -> Callable[[Any], dict[str, Any]]:
    """The encoder of a record type: its fields read in one pass, and only those whose type can hold a record
    converted further (most are ints, strings and lists of them, which msgpack packs as they are)."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    try:
        hints = typing.get_type_hints(cls)
    except NameError:
        hints = {}  # a type it cannot resolve: every field is converted, as any value is
    nested = tuple(name for name in names if not _plain(hints.get(name)))
    by_dict = "__slots__" not in vars(cls)  # its own: typing.Generic, a request's base, declares empty ones

    def encode(value: Any) -> dict[str, Any]:
        # A dataclass's __init__ sets its fields, in order, and nothing else: a copy of its __dict__ is the map, far
        # faster than reading them one by one, unless something else was stored there.
        wire = value.__dict__.copy() if by_dict else {}
        if len(wire) != len(names):
            wire = {name: getattr(value, name) for name in names}
        for name in nested:
            wire[name] = to_wire(wire[name])
        return wire

    return encode


def _plain(tp: Any) -> bool:
    """Whether values of field type ``tp`` are msgpack-ready as they are: scalars, and lists, maps and unions of
    them."""
    if tp in _SCALARS:
        return True
    args = typing.get_args(tp)
    return typing.get_origin(tp) in (list, dict, typing.Union, types.UnionType) and all(_plain(a) for a in args)


def from_wire(cls: type[M], data: Any) -> M:
    """Build ``cls`` from a decoded map, checking every field's type."""
    return _decoder(cls)(data, cls.__name__)


Decoder = Callable[[Any, str], Any]
"""Checks and converts one decoded value of a field type; the string names the field for errors."""

_DECODERS: dict[Any, Decoder] = {}


def _decoder(tp: Any) -> Decoder:
    """The decoder of field type ``tp``, built once: every request and reply is decoded through these."""
    decoder = _DECODERS.get(tp)
    if decoder is None:
        decoder = _DECODERS[tp] = _build_decoder(tp)
    return decoder


def _build_decoder(tp: Any) -> Decoder:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _record_decoder(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(tp)
    if origin is list:
        return _list_decoder(*typing.get_args(tp))
    if origin is dict:
        key, value = (_decoder(arg) for arg in typing.get_args(tp))

        def mapping(data: Any, where: str) -> dict:
            if not isinstance(data, dict):
                raise ProtocolError(f"{where}: expected a map, got {type(data).__name__}")
            return {key(k, f"{where} key"): value(v, f"{where}[]") for k, v in data.items()}

        return mapping
    if tp is float:

        def real(data: Any, where: str) -> float:
            if type(data) is int:
                return float(data)
            if type(data) is not float:
                raise ProtocolError(f"{where}: expected float, got {type(data).__name__}")
            return data

        return real

    def exact(data: Any, where: str) -> Any:
        # bool is an int subclass: an int field must not accept True, nor a bool field 1.
        if type(data) is not tp:
            raise ProtocolError(f"{where}: expected {tp.__name__}, got {type(data).__name__}")
        return data

    return exact


def _record_decoder(tp: type) -> Decoder:
    hints = typing.get_type_hints(tp)
    fields = [
        (
            f.name,
            # Most fields are ints, strings, bools or floats: their check is made here, without a call (an int sent
            # for a float goes to its decoder, which converts it).
            hints[f.name] if hints[f.name] in (int, str, bool, float) else None,
            _decoder(hints[f.name]),
            _default_of(f),
        )
        for f in dataclasses.fields(tp)
    ]
    # The values go straight into a new instance's __dict__, in field order, as the frozen dataclass's __init__ would
    # set them one object.__setattr__ at a time (a third of a status reply's decoding); no message has a __post_init__.
    if "__slots__" in vars(tp) or hasattr(tp, "__post_init__"):
        raise TypeError(f"{tp.__name__}: a wire record has no __slots__ and no __post_init__")
    new = object.__new__

    def record(data: Any, where: str) -> Any:
        if not isinstance(data, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(data).__name__}")
        values: dict[str, Any] = {}
        for name, exact, decode, default in fields:
            value = data.get(name, _ABSENT)
            if value is _ABSENT:
                if default is None:
                    raise ProtocolError(f"{where}: missing field {name!r}")
                values[name] = default()
            elif type(value) is exact:
                values[name] = value
            else:
                values[name] = decode(value, f"{where}.{name}")
        instance: object = new(tp)
        instance.__dict__.update(values)
        return instance

    return record


def _default_of(field: dataclasses.Field) -> Callable[[], Any] | None:
    """What makes a field's default (a fresh one each time, for a factory's); None for a required field."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory
    if field.default is not dataclasses.MISSING:
        default = field.default
        return lambda: default
    return None


_ABSENT = object()


def _union_decoder(tp: Any) -> Decoder:
    args = typing.get_args(tp)
    nullable = type(None) in args
    options = [_decoder(arg) for arg in args if arg is not type(None)]

    def union(data: Any, where: str) -> Any:
        if data is None and nullable:
            return None
        for option in options:
            try:
                return option(data, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where}: a {type(data).__name__} matches none of {tp}")

    return union


def _list_decoder(item_type: Any) -> Decoder:
    item = _decoder(item_type)
    scalar = item_type in (int, str, bool)

    def sequence(data: Any, where: str) -> list:
        if not isinstance(data, (list, tuple)):
            raise ProtocolError(f"{where}: expected a list, got {type(data).__name__}")
        where = f"{where}[]"  # one label for every item: a long list costs no string per item
        if scalar and all(type(v) is item_type for v in data):
            return list(data)
        return [item(v, where) for v in data]

    return sequence


def packb(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"value cannot be encoded: {exc}") from None


def unpackb(data: bytes, max_bytes: int = MAX_FRAME_BYTES, max_items: int | None = None) -> Any:
    """Decode ``data`` of at most ``max_bytes``; ``max_items``: the longest array or map accepted, refused from its
    header before any item is decoded (a peer's list of four million sizes costs nothing then)."""
    if len(data) > max_bytes:
        raise ProtocolError(f"frame of {len(data)} bytes exceeds {max_bytes}")
    bounds = {} if max_items is None else {"max_array_len": max_items, "max_map_len": max_items}
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, **bounds)
    except ValueError as exc:
        # msgpack says "N exceeds max_array_len(M)": the one refusal a well-formed message meets, worth naming.
        if max_items is not None and "exceeds max_" in str(exc):
            raise ProtocolError(
                f"a list or map of {str(exc).split()[0]} items is longer than the {max_items} one message may carry"
            ) from None
        raise ProtocolError(f"malformed msgpack: {type(exc).__name__}") from None
    except Exception as exc:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(f"malformed msgpack: {type(exc).__name__}") from None


def encode_frames(msg: Message, request_id: int, token: str = "") -> list[bytes]:
    """Control-plane frames for a request or a reply."""
    payload = {"id": request_id, "token": token, "body": to_wire(msg)}
    return [msg.KIND.encode(), packb(payload)]


@dataclasses.dataclass(frozen=True)
class Envelope:
    """A decoded control-plane message with its request id and token."""

    request_id: int
    token: str
    body: Message


PEEK_BYTES = 64 << 10
"""Bytes of a payload :func:`peek_request_id` looks at, from its start."""
PEEK_ENTRIES = 8
"""Entries of a payload's map :func:`peek_request_id` looks at, from the first."""


def peek_request_id(frames: list[bytes]) -> int:
    """Best-effort request id of a frame list, for error replies to garbage (0 if none).

    Only the payload map's ``id`` is decoded (the last one, as a decoded map
    keeps it), among its first :data:`PEEK_ENTRIES` entries and within its
    first :data:`PEEK_BYTES` bytes; every other value is skipped unbuilt. A
    client writes the id first: an id after millions of entries, or after a
    body longer than that, is not looked for (walking a 4 MiB map for it
    took 150-240 ms of the daemon's loop, issue #61).
    """
    rid = None
    try:
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=PEEK_BYTES)
        unpacker.feed(frames[1][:PEEK_BYTES])
        for _ in range(min(unpacker.read_map_header(), PEEK_ENTRIES)):
            if unpacker.unpack() == "id":
                rid = unpacker.unpack()
            else:
                unpacker.skip()
    except Exception:  # garbage, no map, or cut short at PEEK_BYTES: the id read before it, if any
        pass
    return rid if type(rid) is int and 0 <= rid < 2**63 else 0


def read_envelope(
    frames: list[bytes], max_bytes: int = MAX_FRAME_BYTES, max_items: int | None = None
) -> tuple[type[Message], int, str, Any]:
    """``[kind, payload]`` opened but the body not yet checked: ``(kind class, request id, token, raw body)``.

    Lets a server refuse a kind or a token before it spends time on the body.
    ``max_bytes`` and ``max_items`` bound the payload as :func:`unpackb` does;
    a kind that carries longer lists says so (:attr:`Message.max_list_items`).
    """
    if len(frames) != 2:
        raise ProtocolError(f"expected 2 frames, got {len(frames)}")
    try:
        kind = frames[0].decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("message kind is not ASCII") from None
    cls = kind_class(kind)
    if max_items is not None:
        max_items = max(max_items, cls.max_list_items)
    payload = unpackb(frames[1], max_bytes, max_items)
    if not isinstance(payload, dict):
        raise ProtocolError("payload is not a map")
    rid, token, body = payload.get("id"), payload.get("token", ""), payload.get("body", {})
    if type(rid) is not int or not 0 <= rid < 2**63:
        raise ProtocolError("request id missing or out of range")
    if type(token) is not str:
        raise ProtocolError("token is not a string")
    return cls, rid, token, body


def decode_body(cls: type[M], body: Any) -> M:
    """:func:`from_wire` that also turns pathological nesting into a :class:`ProtocolError`."""
    try:
        return from_wire(cls, body)
    except RecursionError:
        raise ProtocolError(f"{cls.KIND}: nested too deeply") from None


def decode_frames(frames: list[bytes]) -> Envelope:
    """Decode ``[kind, payload]``; raises :class:`ProtocolError` on any defect."""
    cls, rid, token, body = read_envelope(frames)
    return Envelope(rid, token, decode_body(cls, body))


def encode_datagram(msg: Message) -> bytes:
    """A handle-plane datagram."""
    return packb({"kind": msg.KIND, "body": to_wire(msg)})


def decode_datagram(data: bytes, max_items: int | None = None) -> Message:
    """A handle-plane datagram; ``max_items`` bounds its lists and maps as :func:`unpackb` does."""
    payload = unpackb(data, max_items=max_items)
    if not isinstance(payload, dict) or type(payload.get("kind")) is not str:
        raise ProtocolError("datagram is not a {kind, body} map")
    return decode_body(kind_class(payload["kind"]), payload.get("body", {}))


@message("error")
class ErrorReply(Message):
    """Daemon → client refusal of any request: an error-table ``code`` and a one-line ``message``.

    ``details`` carries the numbers behind it (budget, used, requested, ...).
    """

    code: str
    message: str
    retryable: bool
    details: dict[str, int | str | bool | float] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, exc: HbmdError) -> ErrorReply:
        """The reply for ``exc``; echoed input is cut short so the reply always fits a frame."""
        details = {
            k: v
            for k, v in exc.details.items()
            if isinstance(v, (int, bool, float)) or (isinstance(v, str) and len(v) <= MAX_DETAIL_CHARS)
        }
        return cls(exc.code.wire, exc.message[:MAX_MESSAGE_CHARS], exc.retryable, details)

    def exception(self) -> HbmdError:
        return error_from_wire(self.code, self.message, self.details)
