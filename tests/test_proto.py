"""The wire protocol: round trips, golden bytes, strict decoding, and purity."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
from hbmd import proto
from hbmd.proto import codec
from hbmd.proto.errors import ERROR_CLASSES, ErrorCode, OutOfBudget, ProtocolError
from hbmd.proto.units import exact_bytes

pytestmark = pytest.mark.unit

BUFFER = proto.BufferInfo(7, "kv", False, 3, 1000, 64 << 20, 64 << 20, 2, 32 << 20, 4 << 20, 8 << 20, 2)
EXAMPLES = [
    proto.Hello([1, 0], 4242, "worker", "team-a"),
    proto.Welcome("ab" * 16, 3, "gpu0", "cuda", 2 << 20, [1, 0], "0.1.0", "GPU-1234", 0),
    proto.Refused("version_mismatch", "speak 1.x"),
    proto.FdBatch(9, [1, 2, 3], 0, 1),
    proto.CreateBuffer(64 << 20, 2, "kv", False, True),
    proto.BufferCreated(BUFFER),
    proto.Commit(7, 4 << 20),
    proto.Committed(BUFFER, [proto.ChunkInfo(11, 0, 4 << 20, 0), proto.ChunkInfo(12, 32 << 20, 4 << 20, 0)], 1),
    proto.Release(7),
    proto.Released(BUFFER, 8 << 20),
    proto.Detach(7),
    proto.Detached(BUFFER, 0),
    proto.Detach(7, readonly=True),
    proto.Attach("weights", readonly=True),
    proto.Graft(7, "kv"),
    proto.CreateBuffer(64 << 20, 2, "kv", True, False, [], 300.0),
    proto.Seal(7),
    proto.Sealed(proto.BufferInfo(7, "weights", True, 0, 1000, 4 << 20, 4 << 20, 1, 4 << 20, 4 << 20, 4 << 20, 1,
                                  [4 << 20], [4 << 20], sealed=True, readers=2)),
    proto.Free(7),
    proto.Freed(7, 0),
    proto.Status(),
    proto.ListSessions(),
    proto.SessionList([proto.SessionInfo(3, 4242, 1000, 1000, "worker", "", 1, 2, 1, 2, 0.5)]),
    proto.ListBuffers(3),
    proto.BufferList([BUFFER]),
    proto.ErrorReply("out_of_budget", "does not fit", True, {"budget": 1, "used": 2, "requested": 3}),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.KIND)
def test_control_frames_round_trip(msg):
    frames = proto.encode_frames(msg, 42, "tok")
    assert frames[0] == msg.KIND.encode()
    envelope = proto.decode_frames(frames)
    assert envelope == proto.Envelope(42, "tok", msg)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: m.KIND)
def test_datagrams_round_trip(msg):
    assert proto.decode_datagram(proto.encode_datagram(msg)) == msg


def test_golden_bytes_of_a_commit():
    # The exact bytes are the contract with every client shipped: a minor version may only add
    # fields (old readers skip them), anything else needs a new major.
    frames = proto.encode_frames(proto.Commit(buffer_id=7, bytes_per_segment=4 << 20), 42, "tok")
    assert frames == [
        b"buffer.commit",
        bytes.fromhex("83a269642aa5746f6b656ea3746f6ba4626f647982a96275666665725f696407b1627974"
                      "65735f7065725f7365676d656e74ce00400000"),
    ]


def test_golden_bytes_of_a_hello():
    # 1.4 appended resume_session and resume_credential (the body's map grew from 6 to 8 fields), 1.7 replies_with_fds
    # (9 fields), 1.10 start_over (10 fields); the rest is 1.3's.
    assert proto.encode_datagram(proto.Hello([1, 0], 4242, "w", "")) == bytes.fromhex(
        "82a46b696e64ad73657373696f6e2e68656c6c6fa4626f64798aa776657273696f6e920100a3706964cd1092"
        "ab636c69656e745f6e616d65a177a674656e616e74a0a86f62736572766572c2a56c65617365c2"
        "ae726573756d655f73657373696f6e00b1726573756d655f63726564656e7469616ca0"
        "b07265706c6965735f776974685f666473c2aa73746172745f6f766572c2"
    )


def test_unknown_fields_are_ignored_within_a_major():
    payload = {"id": 1, "token": "t", "body": {"buffer_id": 7, "bytes_per_segment": 5, "future_field": [1, 2]}}
    envelope = proto.decode_frames([b"buffer.commit", msgpack.packb(payload)])
    assert envelope.body == proto.Commit(7, 5)


def test_a_hello_from_an_older_minor_without_later_fields_decodes():
    old = msgpack.packb(
        {"kind": "session.hello", "body": {"version": [1, 0], "pid": 7, "client_name": "w", "tenant": ""}}
    )
    assert proto.decode_datagram(old) == proto.Hello([1, 0], 7, "w", "", observer=False)


def test_defaults_fill_missing_optional_fields():
    payload = {"id": 1, "token": "t", "body": {"capacity": 4096}}
    assert proto.decode_frames([b"buffer.create", msgpack.packb(payload)]).body == proto.CreateBuffer(4096)


@pytest.mark.parametrize(
    "frames",
    [
        [b"buffer.commit"],
        [b"buffer.commit", b"\xc1"],
        [b"no.such.kind", msgpack.packb({"id": 1, "token": "", "body": {}})],
        [b"\xff\xfe", msgpack.packb({"id": 1})],
        [b"buffer.commit", msgpack.packb([1, 2, 3])],
        [b"buffer.commit", msgpack.packb({"id": -1, "token": "", "body": {"buffer_id": 1, "bytes_per_segment": 1}})],
        [b"buffer.commit", msgpack.packb({"id": 1, "token": 5, "body": {"buffer_id": 1, "bytes_per_segment": 1}})],
        [b"buffer.commit", msgpack.packb({"id": 1, "token": "", "body": {"buffer_id": 1}})],
        [b"buffer.commit", msgpack.packb({"id": 1, "token": "", "body": {"buffer_id": "1", "bytes_per_segment": 1}})],
        [b"buffer.commit", msgpack.packb({"id": 1, "token": "", "body": {"buffer_id": True, "bytes_per_segment": 1}})],
        [b"buffer.create", msgpack.packb({"id": 1, "token": "", "body": {"capacity": 1, "persistent": 1}})],
        [b"buffer.commit", msgpack.packb({"id": 1, "token": "", "body": {1: 2}}, strict_types=False)],
        [b"buffer.commit", b"\x00" * (proto.MAX_FRAME_BYTES + 1)],
    ],
)
def test_malformed_frames_raise_protocol_error(frames):
    with pytest.raises(ProtocolError):
        proto.decode_frames(frames)


def test_peek_request_id_survives_garbage():
    assert proto.peek_request_id([b"x", b"\xc1"]) == 0
    assert proto.peek_request_id([b"x", msgpack.packb({"id": 17})]) == 17
    assert proto.peek_request_id([b"x"]) == 0


def test_a_request_past_a_daemons_bounds_is_refused_undecoded_and_keeps_its_id():
    sizes = [1] * (proto.MAX_SEGMENTS + 1)
    long_list = msgpack.packb({"id": 5, "token": "", "body": {"buffer_id": 1, "sizes": sizes}})
    with pytest.raises(ProtocolError, match=f"of {proto.MAX_SEGMENTS + 1} items is longer than the "
                                            f"{proto.MAX_SEGMENTS} one message may carry"):
        proto.read_envelope([b"buffer.commit_segments", long_list], proto.MAX_REQUEST_BYTES, proto.MAX_SEGMENTS)
    assert proto.read_envelope([b"buffer.commit_segments", long_list])[3]["sizes"] == sizes  # a client's bounds
    large = msgpack.packb({"id": 6, "token": "", "body": {"capacity": 1, "name": "n" * proto.MAX_REQUEST_BYTES}})
    with pytest.raises(ProtocolError, match="exceeds"):
        proto.read_envelope([b"buffer.create", large], proto.MAX_REQUEST_BYTES, proto.MAX_SEGMENTS)
    assert proto.peek_request_id([b"buffer.create", large]) == 6
    assert proto.peek_request_id([b"buffer.create", msgpack.packb({"body": {"sizes": sizes}, "id": 7})]) == 7


def test_error_table_round_trips_every_code():
    for code, cls in ERROR_CLASSES.items():
        exc = cls("boom", function="cuMemCreate", result="CUDA_ERROR_OUT_OF_MEMORY")
        reply = proto.ErrorReply.of(exc)
        assert reply.code == code.wire and reply.retryable == code.retryable
        back = proto.decode_datagram(proto.encode_datagram(reply)).exception()
        assert type(back) is cls and back.message == "boom"
        assert back.details["function"] == "cuMemCreate"


def test_retryable_families():
    assert ErrorCode.OUT_OF_MEMORY.retryable and ErrorCode.OUT_OF_BUDGET.retryable
    assert not ErrorCode.INVALID.retryable and not ErrorCode.PROTOCOL.retryable
    assert isinstance(OutOfBudget("x"), MemoryError)


def test_unknown_error_code_becomes_internal():
    assert type(proto.ErrorReply("from_the_future", "x", False).exception()) is proto.InternalError


def test_every_request_names_a_reply_that_is_a_registered_message_and_not_a_request():
    kinds = set(codec._KINDS.values())
    for request in proto.requests():
        assert request.Reply in kinds, request.KIND
        assert not issubclass(request.Reply, proto.Request), request.KIND


def test_the_requests_are_the_ones_clients_send():
    # The protocol's request set is the daemon's contract: a kind dropped from it (or one that stops
    # naming its reply) leaves a shipped client without an answer.
    assert {cls.KIND for cls in proto.requests()} == {
        "admin.status", "admin.sessions", "admin.buffers", "admin.reclaim", "buffer.create", "buffer.commit",
        "buffer.commit_segments", "buffer.remap", "buffer.release", "buffer.free", "buffer.attach", "buffer.detach",
        "buffer.delete", "buffer.redeclare", "buffer.graft",
        "buffer.defragment", "buffer.seal",
        "buffer.finish_defragment", "buffer.move", "session.reclaim_done",
    }


def test_a_request_that_names_no_reply_is_refused_at_definition():
    with pytest.raises(TypeError, match="name the reply type"):

        class NoReply(proto.Request):  # defining it is the test
            pass

    with pytest.raises(TypeError, match="not a request"):

        class RepliesWithARequest(proto.Request[proto.Status]):
            pass


def test_proto_imports_only_stdlib_and_msgpack():
    # Block zmq, torch and cuda: importing the protocol must not need them.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('zmq', 'torch', 'cuda', 'numpy'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import hbmd.proto, hbmd.proto.units, hbmd.proto.instance\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize(
    "n, shown",
    [(5, "5 B"), (64 << 20, "64.0 MiB"), ((64 << 20) + 1, "64.0 MiB (67108865 B)"), (3 << 29, "1.5 GiB"),
     (123456789, "117.7 MiB (123456789 B)"), (1 << 50, "1.0 PiB"), (1 << 62, "4096.0 PiB"),
     ((1 << 62) + 1, "4096.0 PiB (4611686018427387905 B)")],
)
def test_a_size_in_a_message_is_in_human_units_and_exact_where_they_round(n, shown):
    assert exact_bytes(n) == shown


def test_only_a_declaration_carries_more_items_than_a_buffer_has_segments():
    """A buffer grown a granule at a time has more chunks than segments: its declaration after a restart carries
    them all, and nothing else carries a list that long."""
    chunks = [proto.ChunkInfo(0, i * 4096, 4096) for i in range(proto.MAX_SEGMENTS + 1)]
    declaration = proto.Redeclare(len(chunks) * 4096, [len(chunks) * 4096], [len(chunks) * 4096], chunks)
    frames = proto.encode_frames(declaration, 3)
    kind, _, _, body = proto.read_envelope(frames, proto.MAX_REQUEST_BYTES, proto.MAX_SEGMENTS)
    assert kind is proto.Redeclare and len(body["chunks"]) == len(chunks)
    longer = [proto.ChunkInfo(0, i, 1) for i in range(proto.MAX_DECLARED_CHUNKS + 1)]
    with pytest.raises(ProtocolError, match="longer than the"):
        proto.read_envelope(proto.encode_frames(proto.Redeclare(1, [1], [1], longer), 4), 4 * proto.MAX_REQUEST_BYTES,
                            proto.MAX_SEGMENTS)
