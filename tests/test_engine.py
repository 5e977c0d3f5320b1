"""Engine features on the host backend: persistent buffers, re-attach, defragment, layouts, sizing."""

from __future__ import annotations

import json
import os
import signal

import pytest
from hbmd.client import (
    Conflict,
    ExtensibleKVCacheBuffers,
    ExtensibleTensor,
    InvalidRequest,
    NotFound,
    OutOfBudget,
    kv_blocks_that_fit,
    kv_view,
    narrow_blocks,
)
from helpers import MiB, filled, hbmctl, torch, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]

CREATOR = """
import os, sys, torch
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu", client_name="creator")
t = ExtensibleTensor(64 << 20, "cpu", num_segments=2, client=c, name="kv-layer0", persistent=True)
for step in range(1, 6):
    t.resize_per_segment_(step * (2 << 20))  # five commits: five chunks per segment
g = torch.Generator().manual_seed(7)
data = torch.randint(0, 256, (10 << 20,), dtype=torch.uint8, generator=g)
t.full_view()[: 10 << 20] = data
t.full_view()[32 << 20 : 42 << 20] = data.flip(0)
print(os.getpid(), t.num_chunks, flush=True)
sys.stdin.readline()
"""

ATTACHER = """
import sys, torch
from hbmd.client import ExtensibleTensor
t = ExtensibleTensor.attach("kv-layer0", "cpu")
g = torch.Generator().manual_seed(7)
data = torch.randint(0, 256, (10 << 20,), dtype=torch.uint8, generator=g)
v = t.full_view()
ok = torch.equal(v[: 10 << 20], data) and torch.equal(v[32 << 20 : 42 << 20], data.flip(0))
print(ok, t.max_num_bytes, t.num_segments, t.bytes_per_segment, t.num_chunks, t.persistent, flush=True)
"""


def start_creator(daemon, spawn_worker):
    worker = spawn_worker(daemon, CREATOR)
    pid, chunks = map(int, worker.readline().split())
    return worker, pid, chunks


@pytest.mark.system
def test_a_sigkilled_workers_persistent_buffer_is_attached_with_its_data(daemon, client, spawn_worker):
    worker, pid, chunks = start_creator(daemon, spawn_worker)
    assert chunks == 10
    os.kill(pid, signal.SIGKILL)
    worker.wait()
    wait_until(lambda: all(s.pid != pid for s in client.sessions()))
    assert client.status().committed_bytes == 20 * MiB  # the orphan keeps its memory
    (orphan,) = client.buffers()
    assert orphan.session_id == 0 and orphan.persistent and orphan.name == "kv-layer0"
    attacher = spawn_worker(daemon, ATTACHER)
    assert attacher.readline() == f"True {64 * MiB} 2 {10 * MiB} 10 True"
    assert attacher.wait() == 0
    # The attacher exited cleanly: the buffer is orphaned again, not freed.
    wait_until(lambda: client.buffers()[0].session_id == 0)
    assert client.status().committed_bytes == 20 * MiB


@pytest.mark.system
def test_a_name_attached_by_a_live_session_is_refused(daemon, client, spawn_worker):
    start_creator(daemon, spawn_worker)
    with pytest.raises(Conflict, match="attached by session"):
        ExtensibleTensor.attach("kv-layer0", "cpu", client=client)
    with pytest.raises(NotFound):
        ExtensibleTensor.attach("no-such-buffer", "cpu", client=client)


def test_persistent_names_are_unique_and_required(client):
    ExtensibleTensor(4 * MiB, "cpu", client=client, name="a", persistent=True)
    with pytest.raises(Conflict, match="already exists"):
        ExtensibleTensor(4 * MiB, "cpu", client=client, name="a", persistent=True)
    with pytest.raises(InvalidRequest, match="needs a name"):
        ExtensibleTensor(4 * MiB, "cpu", client=client, persistent=True)
    ExtensibleTensor(4 * MiB, "cpu", client=client, name="a")  # a plain label may repeat


def test_session_end_frees_anonymous_buffers_and_keeps_persistent_ones(daemon, client):
    other = daemon.connect()
    ExtensibleTensor(16 * MiB, "cpu", client=other).resize_(4 * MiB)
    ExtensibleTensor(16 * MiB, "cpu", client=other, name="keep", persistent=True).resize_(6 * MiB)
    assert client.status().committed_bytes == 10 * MiB
    other.close()
    wait_until(lambda: client.status().committed_bytes == 6 * MiB)
    assert [b.name for b in client.buffers()] == ["keep"]


@pytest.mark.system
def test_hbmctl_deletes_an_orphan_but_not_a_live_buffer(daemon, client, spawn_worker):
    worker, pid, _ = start_creator(daemon, spawn_worker)
    rd = str(daemon.run_dir)
    refused = hbmctl("--run-dir", rd, "delete", "kv-layer0")
    assert refused.returncode == 3 and "attached by session" in refused.stderr
    os.kill(pid, signal.SIGKILL)
    worker.wait()
    wait_until(lambda: client.buffers() and client.buffers()[0].session_id == 0)
    done = hbmctl("--run-dir", rd, "--json", "delete", "kv-layer0")
    assert done.returncode == 0 and json.loads(done.stdout)["freed_bytes"] == 20 * MiB
    assert client.status().committed_bytes == 0 and client.buffers() == []
    assert hbmctl("--run-dir", rd, "delete", "kv-layer0").returncode == 3


def grown_in_steps(client, steps=8, **kwargs):
    t = ExtensibleTensor(64 * MiB, "cpu", num_segments=2, client=client, **kwargs)
    for step in range(1, steps + 1):
        t.resize_per_segment_(step * 2 * MiB)
    return t


@pytest.mark.system
def test_defragment_preserving_keeps_data_and_makes_one_chunk_per_segment(daemon, client):
    t = grown_in_steps(client)
    assert t.num_chunks == 16
    view = t.full_view()
    data = torch.randint(0, 256, (64 * MiB,), dtype=torch.uint8)
    view[: 16 * MiB] = data[: 16 * MiB]
    view[32 * MiB : 48 * MiB] = data[32 * MiB : 48 * MiB]
    t.defragment(preserve=True)
    assert t.num_chunks == 2 and t.full_view().data_ptr() == view.data_ptr()
    assert torch.equal(view[: 16 * MiB], data[: 16 * MiB])
    assert torch.equal(view[32 * MiB : 48 * MiB], data[32 * MiB : 48 * MiB])
    assert client.status().committed_bytes == 32 * MiB  # the old chunks are gone
    table = hbmctl("--run-dir", str(daemon.run_dir), "--json", "buffers")
    assert json.loads(table.stdout)["buffers"][0]["num_chunks"] == 2
    t.defragment()  # already one chunk per segment: nothing to do
    assert t.num_chunks == 2
    t.resize_per_segment_(20 * MiB)  # and it still grows (its new granules leased or not)
    assert t.segment_sizes == [20 * MiB] * 2 and torch.equal(view[: 16 * MiB], data[: 16 * MiB])


@pytest.mark.system
def test_defragment_preserving_needs_budget_for_both_copies(client):
    t = ExtensibleTensor(256 * MiB, "cpu", client=client)
    for step in range(1, 81):
        t.resize_(step * 2 * MiB)
    t.full_view()[:MiB] = 4
    with pytest.raises(OutOfBudget, match="defragment"):
        t.defragment(preserve=True)
    assert t.num_chunks == 80 and filled(t.full_view()[:MiB], 4)
    assert client.status().committed_bytes == 160 * MiB
    t.defragment(preserve=False)  # discarding needs no more than the buffer itself
    assert t.num_chunks == 1 and client.status().committed_bytes == 160 * MiB


@pytest.mark.system
def test_kv_commit_grows_and_defragments_in_one_step(client):
    k = ExtensibleTensor(64 * MiB, "cpu", num_segments=2, client=client)
    kv = ExtensibleKVCacheBuffers([(k, 2 * MiB)], num_blocks_capacity=16)
    for n in range(1, 9):
        kv.commit(n)
    assert k.num_chunks == 16
    k.full_view()[: 16 * MiB] = 1
    kv.commit(10, defragment=True)
    assert k.num_chunks == 2 and kv.num_blocks_committed == 10
    assert int(k.full_view()[: 20 * MiB].sum()) == 0  # discarded: every block reads as zero
    k.full_view()[: 20 * MiB] = 3
    kv.commit(12, defragment=True, preserve=True)
    assert k.num_chunks == 2 and filled(k.full_view()[: 20 * MiB], 3)


MID_DEFRAGMENT = """
import os, sys, torch
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu")
t = ExtensibleTensor(64 << 20, "cpu", num_segments=2, client=c, name="kv-defrag", persistent=True)
for step in range(1, 9):
    t.resize_per_segment_(step * (2 << 20))
t.full_view()[: 16 << 20] = 5
t.full_view()[32 << 20 : 48 << 20] = 6
def stall(fresh):
    print("copying", flush=True)
    sys.stdin.readline()
ExtensibleTensor._move_into = lambda self, fresh, started_over, to_tier: stall(fresh)
print(os.getpid(), flush=True)
t.defragment(preserve=True)
"""


@pytest.mark.system
def test_a_worker_killed_mid_defragment_loses_nothing(daemon, client, spawn_worker):
    worker = spawn_worker(daemon, MID_DEFRAGMENT)
    pid = int(worker.readline())
    assert worker.readline() == "copying"
    assert client.status().committed_bytes == 64 * MiB  # old and new chunks side by side
    os.kill(pid, signal.SIGKILL)
    worker.wait()
    wait_until(lambda: client.status().committed_bytes == 32 * MiB)
    t = ExtensibleTensor.attach("kv-defrag", "cpu", client=client)
    assert t.num_chunks == 16 and t.bytes_per_segment == 16 * MiB
    assert filled(t.full_view()[: 16 * MiB], 5)
    assert filled(t.full_view()[32 * MiB : 48 * MiB], 6)
    t.defragment()  # the interrupted work can be done now
    assert t.num_chunks == 2 and filled(t.full_view()[32 * MiB : 48 * MiB], 6)


def test_device_memory_and_kv_sizing(client):
    memory = client.device_memory()
    assert memory.budget == 256 * MiB and memory.committed == 0 and memory.free > 0 and memory.total > memory.budget
    ExtensibleTensor(64 * MiB, "cpu", client=client).resize_(56 * MiB)
    memory = client.device_memory()
    assert memory.committed == 56 * MiB and memory.budget_left == 200 * MiB
    assert kv_blocks_that_fit(client, 2 * MiB) == 100
    assert kv_blocks_that_fit(client, 2 * MiB, margin_bytes=20 * MiB) == 90
    assert kv_blocks_that_fit(client, 2 * MiB, margin_bytes=1 << 40) == 0
    with pytest.raises(ValueError):
        kv_blocks_that_fit(client, 0)


@pytest.mark.system
def test_sizing_an_engine_after_warm_up(client):
    # The engine flow: a small prefix for warm-up, then the final size from what is left.
    layers = [ExtensibleTensor(128 * MiB, "cpu", num_segments=2, client=client) for _ in range(2)]
    kv = ExtensibleKVCacheBuffers([(t, MiB) for t in layers], num_blocks_capacity=64)
    kv.commit(2)
    blocks = kv.num_blocks_committed + kv_blocks_that_fit(client, kv.bytes_per_block, margin_bytes=16 * MiB)
    assert kv.bytes_per_block == 4 * MiB and blocks == 2 + (256 - 8 - 16) // 4
    kv.commit(min(blocks, kv.num_blocks_capacity), defragment=True)
    assert client.status().committed_bytes == 4 * MiB * 60


@pytest.mark.system
def test_kv_views_keep_base_pointers_and_strides(client):
    blocks, block_size, heads, head_dim = 8, 16, 4, 32
    shape = (2, blocks, block_size, heads, head_dim)
    t = ExtensibleTensor(2 * blocks * block_size * heads * head_dim * 2, "cpu", num_segments=2, client=client)
    t.resize_per_segment_(3 * block_size * heads * head_dim * 2)
    kv = kv_view(t, shape, (0, 1, 2, 3, 4), torch.float16)
    assert kv.shape == shape and kv.data_ptr() == t.base_ptr
    committed = narrow_blocks(kv, 1, 3)
    assert committed.shape == (2, 3, block_size, heads, head_dim)
    assert committed.data_ptr() == kv.data_ptr() and committed.stride() == kv.stride()
    committed.fill_(1.5)
    assert float(committed[1, 2].mean()) == 1.5
    blocks_first = kv_view(t, shape, (1, 0, 2, 3, 4), torch.float16)
    assert blocks_first.stride(1) > blocks_first.stride(0) and blocks_first.data_ptr() == t.base_ptr
    with pytest.raises(ValueError):
        kv_view(t, (2, blocks + 1, block_size, heads, head_dim), (0, 1, 2, 3, 4), torch.float16)


@pytest.mark.system
def test_kv_buffers_over_attached_tensors_start_at_their_committed_blocks(daemon, client):
    creator = daemon.connect()
    kv = ExtensibleKVCacheBuffers(
        [(ExtensibleTensor(32 * MiB, "cpu", num_segments=2, client=creator, name="kv-a", persistent=True), MiB)], 16
    )
    kv.commit(5)
    creator.close()
    wait_until(lambda: client.buffers()[0].session_id == 0)
    attached = ExtensibleKVCacheBuffers([(ExtensibleTensor.attach("kv-a", "cpu", client=client), MiB)], 16)
    assert attached.num_blocks_committed == 5
    attached.commit(3)  # smaller: ignored, nothing shrinks
    attached.commit(8)
    assert attached.num_blocks_committed == 8 and attached.physical_bytes == 16 * MiB
