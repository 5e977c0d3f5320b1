"""Properties of the codec: every message round-trips, and garbage is only ever a ProtocolError.

The daemon decodes whatever arrives on its two sockets; the codec's promise
is that decoding either returns a message or raises :class:`ProtocolError`,
so the daemon's one ``except HbmdError`` is enough to refuse any input.
Strategies are derived from the dataclass fields, so a message kind added
later is covered without touching this file.
"""

from __future__ import annotations

import dataclasses
import struct
import types
import typing

import msgpack
import pytest
from hbmd import proto
from hbmd.proto import codec
from hbmd.proto.errors import ProtocolError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.unit

MSGPACK_INT_MIN, MSGPACK_INT_MAX = -(2**63), 2**64 - 1
# The registry is the set of kinds the daemon will try to decode.
KINDS = sorted(codec._KINDS.values(), key=lambda cls: cls.KIND)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PER_KIND = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCALARS = {
    int: st.integers(MSGPACK_INT_MIN, MSGPACK_INT_MAX),
    str: st.text(max_size=24),
    bool: st.booleans(),
    # NaN never equals itself, so it cannot show a round trip; infinities can.
    float: st.floats(allow_nan=False),
    type(None): st.none(),
}


def derive(tp: typing.Any, *, scalar, record, union, listing, mapping) -> typing.Any:
    """Fold a field type (scalars, ``list``, ``dict``, unions, nested records) into a value or a strategy.

    A field type the ``scalar`` table does not know fails here, loudly, rather than going untested.
    """
    def walk(tp: typing.Any) -> typing.Any:
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            return record(tp, {f.name: walk(hints[f.name]) for f in dataclasses.fields(tp)})
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            return union([walk(arg) for arg in args])
        if origin is list:
            return listing(walk(args[0]))
        if origin is dict:
            return mapping(walk(args[0]), walk(args[1]))
        return scalar[tp]

    return walk(tp)


def strategy_for(tp: typing.Any) -> st.SearchStrategy:
    """Valid values of a field type."""
    return derive(
        tp,
        scalar=SCALARS,
        record=lambda cls, fields: st.builds(cls, **fields),
        union=st.one_of,
        listing=lambda item: st.lists(item, max_size=4),
        mapping=lambda key, value: st.dictionaries(key, value, max_size=4),
    )


MSGPACK_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(MSGPACK_INT_MIN, MSGPACK_INT_MAX)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12))
)
MSGPACK_VALUES = st.recursive(
    MSGPACK_SCALARS,
    lambda children: st.lists(children, max_size=4)
    # Integer keys are legal msgpack that the decoder must refuse (strict_map_key).
    | st.dictionaries(st.text(max_size=8) | st.binary(max_size=8) | st.integers(-5, 5), children, max_size=4),
    max_leaves=12,
)
KIND_BYTES = st.sampled_from([cls.KIND.encode() for cls in KINDS]) | st.binary(max_size=24)
KIND_STRINGS = st.sampled_from([cls.KIND for cls in KINDS]) | st.text(max_size=24)


def decodes_or_refuses(decode: typing.Callable, *args: typing.Any) -> None:
    """Call ``decode``; a ProtocolError is a refusal, any other exception fails the test."""
    try:
        decode(*args)
    except ProtocolError:
        pass


@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.KIND)
@PER_KIND
@given(data=st.data())
def test_every_kind_round_trips_through_frames_and_datagrams(cls, data):
    msg = data.draw(strategy_for(cls))
    request_id = data.draw(st.integers(0, 2**63 - 1))
    token = data.draw(st.text(max_size=40))
    frames = proto.encode_frames(msg, request_id, token)
    assert frames[0] == cls.KIND.encode()
    assert proto.decode_frames(frames) == proto.Envelope(request_id, token, msg)
    assert proto.decode_datagram(proto.encode_datagram(msg)) == msg


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), max_size=5), kind=KIND_BYTES)
def test_arbitrary_frames_are_decoded_or_refused(frames, kind):
    decodes_or_refuses(proto.decode_frames, frames)
    decodes_or_refuses(proto.decode_frames, [kind, *frames[:1]])
    # The daemon asks for the request id of anything, to address its refusal.
    for candidate in (frames, [kind, *frames[:1]]):
        request_id = proto.peek_request_id(candidate)
        assert type(request_id) is int and 0 <= request_id < 2**63


@FUZZ
@given(data=st.binary(max_size=256))
def test_arbitrary_datagrams_are_decoded_or_refused(data):
    decodes_or_refuses(proto.decode_datagram, data)


@FUZZ
@given(value=MSGPACK_VALUES, kind=KIND_BYTES, kind_name=KIND_STRINGS, request_id=MSGPACK_VALUES, token=MSGPACK_VALUES)
def test_arbitrary_msgpack_values_are_decoded_or_refused(value, kind, kind_name, request_id, token):
    packed = msgpack.packb(value, use_bin_type=True)
    decodes_or_refuses(proto.decode_frames, [kind, packed])
    decodes_or_refuses(proto.decode_datagram, packed)
    envelope = {"id": request_id, "token": token, "body": value}
    decodes_or_refuses(proto.decode_frames, [kind, msgpack.packb(envelope, use_bin_type=True)])
    datagram = {"kind": kind_name, "body": value}
    decodes_or_refuses(proto.decode_datagram, msgpack.packb(datagram, use_bin_type=True))


def paths_of(tree: typing.Any, prefix: tuple = ()) -> list[tuple]:
    """Every position in a decoded msgpack tree: map keys and list indices, outermost first."""
    found = [prefix]
    if isinstance(tree, dict):
        for key, child in tree.items():
            found += paths_of(child, (*prefix, key))
    elif isinstance(tree, list):
        for index, child in enumerate(tree):
            found += paths_of(child, (*prefix, index))
    return found


def replaced(tree: typing.Any, path: tuple, value: typing.Any) -> typing.Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {**tree, head: replaced(tree[head], rest, value)}
    return [replaced(child, rest, value) if i == head else child for i, child in enumerate(tree)]


@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.KIND)
@PER_KIND
@given(data=st.data())
def test_a_valid_message_with_a_field_of_the_wrong_type_is_decoded_or_refused(cls, data):
    wire = codec.to_wire(data.draw(strategy_for(cls)))
    path = data.draw(st.sampled_from(paths_of(wire)))
    body = replaced(wire, path, data.draw(MSGPACK_VALUES))
    payload = {"id": data.draw(st.integers(0, 2**63 - 1)), "token": "t", "body": body}
    decodes_or_refuses(proto.decode_frames, [cls.KIND.encode(), msgpack.packb(payload, use_bin_type=True)])
    decodes_or_refuses(proto.decode_datagram, msgpack.packb({"kind": cls.KIND, "body": body}, use_bin_type=True))


def sample(tp: typing.Any) -> typing.Any:
    """One valid value of a field type, with one element in every list and map (so they can be replaced)."""
    return derive(
        tp,
        scalar={int: 1, str: "s", bool: True, float: 0.5, type(None): None},
        record=lambda cls, fields: cls(**fields),
        union=lambda options: options[0],
        listing=lambda item: [item],
        mapping=lambda key, value: {"k": value},
    )


PLACEHOLDER = "\x00placeholder\x00"


def packed_with(tree: typing.Any, path: tuple, raw: bytes) -> bytes:
    """``tree`` packed with the value at ``path`` replaced by the raw msgpack bytes ``raw``.

    Lets a test send what ``msgpack.packb`` itself refuses to build (nesting
    deeper than its recursion limit).
    """
    packed = msgpack.packb(replaced(tree, path, PLACEHOLDER), use_bin_type=True)
    marker = msgpack.packb(PLACEHOLDER, use_bin_type=True)
    assert packed.count(marker) == 1
    return packed.replace(marker, raw)


def nested(depth: int, container: str) -> bytes:
    """msgpack bytes of ``depth`` nested one-element lists (or one-key maps) around an int."""
    layer = b"\x91" if container == "list" else b"\x81" + msgpack.packb("k")
    return layer * depth + b"\x01"


# The unpacker's own limit is 1024 levels in all; the envelope and the records above the field use up to 5.
DEPTHS = [10, 990, 1015]


def decode_body_both_ways(kind: str, packed_body: bytes) -> None:
    """Decode ``packed_body`` (raw msgpack) as the body of a control frame and of a datagram."""
    frame_payload = b"\x83" + msgpack.packb("id") + b"\x07" + msgpack.packb("token") + msgpack.packb("t")
    frame_payload += msgpack.packb("body") + packed_body
    datagram = b"\x82" + msgpack.packb("kind") + msgpack.packb(kind) + msgpack.packb("body") + packed_body
    decodes_or_refuses(proto.decode_frames, [kind.encode(), frame_payload])
    decodes_or_refuses(proto.decode_datagram, datagram)


@pytest.mark.parametrize("container", ["list", "map"])
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.KIND)
def test_deeply_nested_values_in_any_field_are_a_protocol_error(cls, depth, container):
    """As deep as msgpack unpacks, in every position of every kind: refused, never a RecursionError."""
    body = codec.to_wire(sample(cls))
    raw = nested(depth, container)
    # A kind without fields gets the deep value as its whole body.
    for packed_body in [packed_with(body, path, raw) for path in paths_of(body)[1:]] or [raw]:
        decode_body_both_ways(cls.KIND, packed_body)


# What msgpack.packb cannot build but a peer can send: integers past 64 bits spelled as
# other types, extension types (the timestamp, code -1, is decoded by msgpack itself),
# invalid UTF-8 in a str, reserved bytes and containers that claim more than the frame holds.
RAW_VALUES = {
    "2**70 as float64": b"\xcb" + struct.pack(">d", 2.0**70),
    "2**70 as ext": b"\xc7\x09\x01" + (2**70).to_bytes(9, "big"),
    "timestamp ext": b"\xd6\xff" + struct.pack(">I", 7),
    "bad timestamp ext": b"\xc7\x05\xff" + b"\x00" * 5,
    "ext -128": b"\xd4\x80\x00",
    "bin": b"\xc4\x02\x01\x02",
    "invalid utf-8": b"\xa2\xff\xfe",
    "reserved 0xc1": b"\xc1",
    "array claiming 2**32-1 items": b"\xdd\xff\xff\xff\xff",
    "map claiming 2**32-1 entries": b"\xdf\xff\xff\xff\xff",
    "str claiming 2**32-1 bytes": b"\xdb\xff\xff\xff\xff",
    "nan": b"\xcb" + struct.pack(">d", float("nan")),
}


@pytest.mark.parametrize("raw", RAW_VALUES.values(), ids=RAW_VALUES.keys())
@pytest.mark.parametrize("cls", KINDS, ids=lambda cls: cls.KIND)
def test_values_msgpack_cannot_build_in_any_field_are_decoded_or_refused(cls, raw):
    body = codec.to_wire(sample(cls))
    for packed_body in [packed_with(body, path, raw) for path in paths_of(body)[1:]] or [raw]:
        decode_body_both_ways(cls.KIND, packed_body)


@pytest.mark.parametrize("depth", DEPTHS)
def test_deeply_nested_envelopes_are_a_protocol_error(depth):
    for container in ("list", "map"):
        raw = nested(depth, container)
        decodes_or_refuses(proto.decode_frames, [b"admin.status", raw])
        decodes_or_refuses(proto.decode_datagram, raw)
        envelope = b"\x83" + msgpack.packb("id") + raw + msgpack.packb("token") + raw + msgpack.packb("body") + raw
        decodes_or_refuses(proto.decode_frames, [b"admin.status", envelope])
        assert proto.peek_request_id([b"admin.status", envelope]) == 0
