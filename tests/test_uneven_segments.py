"""vLLM 0.34's ExtensibleTensor interface on hbmd's host backend: uneven segments, per-segment growth, its errors."""

from __future__ import annotations

import pytest
from hbmd.client import ExtensibleKVCacheBuffers, ExtensibleTensor, VersionMismatch
from hbmd.client import session as client_session
from helpers import GRANULE, MiB, filled

pytestmark = [pytest.mark.ipc, pytest.mark.torch]

CAPACITIES = [3 * MiB, 8 * MiB, 5 * MiB]  # offsets 0, 3 MiB, 11 MiB: two granules straddle segments


def uneven(client, **kwargs) -> ExtensibleTensor:
    return ExtensibleTensor(sum(CAPACITIES), "cpu", segment_capacities=CAPACITIES, client=client, **kwargs)


def test_segments_lie_back_to_back_and_report_as_vllms_do(client):
    t = uneven(client)
    assert t.segment_capacities == CAPACITIES
    assert t.segment_offsets == [0, 3 * MiB, 11 * MiB]
    assert t.num_segments == 3 and t.num_bytes == 0 and t.physical_bytes == 0
    assert t.granularity == GRANULE and t.capacity_bytes == 16 * MiB
    with pytest.raises(ValueError, match="Segments differ"):
        t.segment_capacity_bytes
    assert [t.segment_view(i).numel() for i in range(3)] == [0, 0, 0]
    with pytest.raises(IndexError, match=r"Segment 3 out of range \(3\)"):
        t.segment_view(3)


def test_each_segment_grows_on_its_own_and_keeps_its_data_and_address(client):
    t = uneven(client)
    base = t.full_view().data_ptr()
    t.resize_segments_([1 * MiB, 2 * MiB, 0], zero_new=True)
    for i in range(2):
        t.segment_view(i).fill_(i + 1)
    t.resize_segments_([3 * MiB, 8 * MiB, 5 * MiB], zero_new=True)
    assert t.full_view().data_ptr() == base == t.base_ptr
    assert filled(t.segment_view(0)[: MiB], 1) and int(t.segment_view(0)[MiB:].sum()) == 0
    assert filled(t.segment_view(1)[: 2 * MiB], 2) and int(t.segment_view(1)[2 * MiB :].sum()) == 0
    assert t.segment_view(2).numel() == 5 * MiB and int(t.segment_view(2).sum()) == 0
    assert t.physical_bytes == 16 * MiB and t.num_bytes == 16 * MiB
    assert client.buffers(client.session_id)[0].segment_sizes == CAPACITIES
    with pytest.raises(ValueError, match="Segments differ"):
        t.bytes_per_segment


def test_a_granule_two_segments_share_is_backed_once(client):
    t = uneven(client)
    t.resize_segments_([3 * MiB, 1 * MiB, 0])  # segment 0 ends and segment 1 starts inside granule 1
    assert t.physical_bytes == 2 * GRANULE


@pytest.mark.parametrize(
    "sizes, error",
    [
        ([MiB, MiB], "Expected 3 sizes, got 2"),
        ([4 * MiB, 0, 0], "exceeds the segment capacity"),
    ],
)
def test_bad_sizes_are_refused_and_change_nothing(client, sizes, error):
    t = uneven(client)
    t.resize_segments_([MiB, MiB, MiB])
    with pytest.raises(ValueError, match=error):
        t.resize_segments_(sizes)
    assert t.segment_sizes == [MiB, MiB, MiB]
    with pytest.raises(ValueError, match="grow-only"):
        t.resize_segments_([0, MiB, MiB])


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(segment_capacities=[]), "non-empty and positive"),
        (dict(segment_capacities=[MiB, 0]), "non-empty and positive"),
        (dict(segment_capacities=[MiB, MiB]), "sum to"),
    ],
)
def test_bad_capacity_lists_are_vllms_value_errors(client, kwargs, error):
    with pytest.raises(ValueError, match=error):
        ExtensibleTensor(3 * MiB, "cpu", client=client, **kwargs)
    assert client.buffers(client.session_id) == []


def test_segments_backed_by_one_chunk_follow_the_chunks(client):
    t = ExtensibleTensor(12 * MiB, "cpu", segment_capacities=[4 * MiB, 8 * MiB], client=client)
    t.resize_segments_([2 * MiB, 2 * MiB])
    t.resize_segments_([4 * MiB, 4 * MiB])  # a second chunk in each segment
    assert t.segments_backed_by_one_chunk([2 * MiB, 2 * MiB]) == [True, True]
    assert t.segments_backed_by_one_chunk([4 * MiB, 4 * MiB]) == [False, False]
    assert t.num_physical_chunks == 4
    t.segment_view(1).fill_(5)
    t.defragment(preserve=True)
    assert t.segments_backed_by_one_chunk([4 * MiB, 4 * MiB]) == [True, True]
    assert filled(t.segment_view(1), 5)


def test_the_earlier_single_segment_api_returns_tensors(client):
    t = ExtensibleTensor(8 * MiB, "cpu", client=client)
    first = t.resize_(1024)
    assert first.data_ptr() == t.base_ptr and first.numel() == 1024
    first.fill_(3)
    more = t.append(MiB)
    assert more.data_ptr() == t.base_ptr + 1024 and more.numel() == MiB
    assert t.tensor.numel() == 1024 + MiB and filled(t.tensor[:1024], 3)


def test_a_fabric_export_request_is_served_with_fd_chunks(client, caplog):
    t = ExtensibleTensor(4 * MiB, "cpu", export_handle_types=0x1 | 0x8, client=client)
    t.resize_(2 * MiB)
    assert "FABRIC" in caplog.text and t.physical_bytes == 2 * MiB


def test_an_uneven_persistent_buffer_is_attached_with_its_layout(daemon, client):
    t = uneven(client, name="kv-uneven", persistent=True)
    t.resize_segments_([MiB, 3 * MiB, 2 * MiB])
    t.segment_view(1).fill_(7)
    client.close()
    other = daemon.connect()
    back = ExtensibleTensor.attach("kv-uneven", "cpu", client=other)
    assert back.segment_capacities == CAPACITIES and back.segment_sizes == [MiB, 3 * MiB, 2 * MiB]
    assert filled(back.segment_view(1), 7)


def test_a_client_of_protocol_1_0_is_refused_an_uneven_buffer(daemon, client, monkeypatch):
    uneven(client, name="kv-new", persistent=True).resize_segments_([MiB, MiB, MiB])
    client.close()
    monkeypatch.setattr(client_session, "PROTOCOL_VERSION", (1, 0))
    old = daemon.connect()
    with pytest.raises(VersionMismatch, match=r"protocol 1\.1"):
        ExtensibleTensor.attach("kv-new", "cpu", client=old)
    assert [b.session_id for b in old.buffers()] == [0]  # still an orphan


def test_kv_buffers_commit_blocks_over_uneven_segments(client):
    t = ExtensibleTensor(14 * MiB, "cpu", segment_capacities=[4 * MiB, 10 * MiB], client=client)
    kv = ExtensibleKVCacheBuffers([(t, [MiB // 4, MiB // 2])], num_blocks_capacity=16)
    kv.commit(4)
    assert t.segment_sizes == [MiB, 2 * MiB] and kv.bytes_per_block == 3 * MiB // 4
    kv.release_physical()
    assert t.physical_bytes == 0
    kv.recommit()
    assert t.segment_sizes == [MiB, 2 * MiB]


def test_status_says_what_this_session_may_still_commit(client):
    ExtensibleTensor(64 * MiB, "cpu", client=client).resize_(40 * MiB)
    assert client.status().admissible_bytes == 256 * MiB - 40 * MiB
    assert client.device_memory().budget_left == 216 * MiB
