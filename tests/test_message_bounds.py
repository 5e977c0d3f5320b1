"""What one message costs the daemon is bounded before it runs.

Every request on a buffer, and its reply, costs time in proportion to the
buffer's segments: no buffer has more than :data:`MAX_SEGMENTS`, and no
message carries a longer list (but a declaration's chunks), refused from its
header with an error that says so, nothing changed. Before, a commit of 65,536
segments took the daemon's loop 50 ms, and every session waited behind it.
"""

from __future__ import annotations

import time

import pytest
from hbmd import proto
from hbmd.proto import MAX_SEGMENTS
from hbmd.proto.errors import InvalidRequest, ProtocolError
from helpers import GRANULE, wait_until

pytestmark = pytest.mark.ipc

TOO_LONG = f"of {MAX_SEGMENTS + 1} items is longer than the {MAX_SEGMENTS} one message may carry"


def state_of(client) -> tuple:
    status = client.status()
    return status.committed_bytes, status.num_buffers, status.num_chunks, client.buffers()


def test_a_list_longer_than_a_message_carries_is_refused_and_changes_nothing(daemon, client):
    wide = client.create_buffer(MAX_SEGMENTS * GRANULE, MAX_SEGMENTS)
    before = state_of(client)
    with pytest.raises(ProtocolError, match=TOO_LONG):
        client.call(proto.CommitSegments(wide.buffer_id, [1] * (MAX_SEGMENTS + 1)))
    with pytest.raises(ProtocolError, match=TOO_LONG):
        client.call(proto.CreateBuffer((MAX_SEGMENTS + 1) * GRANULE, segment_capacities=[GRANULE] * (MAX_SEGMENTS + 1)))
    assert state_of(client) == before


def test_no_buffer_has_more_segments_than_a_message_carries(daemon, client):
    assert MAX_SEGMENTS == 4096  # a commit of them all takes the daemon's loop about 3 ms
    with pytest.raises(InvalidRequest, match="num_segments 4097 is out of range"):
        client.create_buffer(4097 * GRANULE, 4097)
    assert client.status().num_buffers == 0


def test_a_long_placement_is_refused_from_its_header(daemon, client):
    """On the handle plane the refusal is the daemon's to log: a datagram has no reply."""
    wide = client.create_buffer(MAX_SEGMENTS * GRANULE, MAX_SEGMENTS)
    before = state_of(client)
    too_long = proto.LeasePlace(wide.buffer_id, [1] * (MAX_SEGMENTS + 1), [], [])
    client._core.handles.sock.send(proto.encode_datagram(too_long))
    wait_until(lambda: TOO_LONG in daemon.log())
    assert state_of(client) == before


def test_the_widest_buffer_grows_segment_by_segment_in_one_message(daemon, client):
    wide = client.create_buffer(MAX_SEGMENTS * 4096, MAX_SEGMENTS)
    sizes = [4096 - index % 4096 for index in range(MAX_SEGMENTS)]
    started = time.monotonic()
    client.commit_segments(wide.buffer_id, sizes).close()
    assert time.monotonic() - started < 1.0
    (info,) = client.buffers(client.session_id)
    assert info.segment_sizes == sizes and info.physical_bytes == MAX_SEGMENTS * 4096
