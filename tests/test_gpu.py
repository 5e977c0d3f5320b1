"""The GPU tier: the same promises on a real CUDA device, plus what only a GPU can show.

Skipped, with the reason, where CUDA VMM with POSIX-FD handles is absent.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import threading
from typing import ClassVar

import pytest
from hbmd import driver, memfd, proto
from hbmd.client import (
    DriverError,
    ExtensibleKVCacheBuffers,
    ExtensibleTensor,
    OutOfDeviceMemory,
    connect,
)
from hbmd.client.lease import Credit, Lease
from hbmd.testing.spawn import DaemonProcess
from helpers import MiB, credited, cuda_vmm_status, daemon_view, filled, wait_until

GPU_OK, GPU_REASON = cuda_vmm_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=GPU_REASON)]

if GPU_OK:
    import torch


@pytest.fixture
def gpu_daemon(start_daemon):
    return start_daemon("--device", "0", "--budget", "16GiB", backend="cuda")


@pytest.fixture
def gpu_client(gpu_daemon):
    torch.cuda.init()
    client = connect("cuda:0", run_dir=gpu_daemon.run_dir, client_name="gpu-test")
    yield client
    client.close()


def test_the_daemon_serves_gpu0_by_uuid_and_says_so(gpu_daemon, gpu_client):
    info = json.loads((gpu_daemon.run_dir / "gpu0" / "instance.json").read_text())
    assert info["device_index"] == 0 and info["backend"] == "cuda"
    assert info["device_uuid"] == driver.device_uuid(0) == gpu_client.welcome.device_uuid
    first = gpu_daemon.log().splitlines()[0]
    assert "backend cuda" in first and "instance gpu0" in first and info["device_uuid"] in first
    status = gpu_client.status()
    assert status.granularity == 2 * MiB and status.total_bytes > 0
    # The default warm pool (four granules) and the export sentinel.
    assert status.budget_bytes == (16 << 30) - status.held_back_bytes == (16 << 30) - 10 * MiB


def test_growth_keeps_data_and_the_base_pointer(gpu_client):
    t = ExtensibleTensor(256 * MiB, "cuda", client=gpu_client)
    view = t.full_view()
    assert view.is_cuda and view.dtype == torch.uint8 and view.numel() == 256 * MiB
    base = view.data_ptr()
    t.resize_(4 * MiB)
    pattern = torch.randint(0, 256, (4 * MiB,), dtype=torch.uint8, device="cuda")
    view[: 4 * MiB].copy_(pattern)
    t.resize_(200 * MiB)
    assert t.full_view().data_ptr() == base == t.base_ptr
    assert torch.equal(view[: 4 * MiB], pattern)
    view[199 * MiB : 200 * MiB].fill_(3)
    torch.cuda.synchronize()
    assert t.physical_bytes == 200 * MiB and t.num_chunks == 2


def test_kv_split_segments_grow_in_lockstep_with_a_straddling_granule(gpu_client):
    # Two 3 MiB segments: granule [2, 4) MiB is shared by both and mapped once.
    t = ExtensibleTensor(6 * MiB, "cuda", num_segments=2, client=gpu_client)
    view = t.full_view()
    t.resize_per_segment_(MiB, zero_new=True)
    view[:MiB].fill_(1)
    view[3 * MiB : 4 * MiB].fill_(2)
    t.resize_per_segment_(3 * MiB, zero_new=True)
    assert int(view[:MiB].sum()) == MiB and int(view[3 * MiB : 4 * MiB].sum()) == 2 * MiB
    assert int(view[MiB : 3 * MiB].sum()) == 0 and int(view[4 * MiB :].sum()) == 0
    assert t.physical_bytes == 6 * MiB and t.num_chunks == 2


def test_value_errors_on_gpu(gpu_client):
    with pytest.raises(ValueError):
        ExtensibleTensor(-1, "cuda", client=gpu_client)
    with pytest.raises(ValueError):
        ExtensibleTensor(MiB, "cuda", num_segments=0, client=gpu_client)
    with pytest.raises(ValueError):
        ExtensibleTensor(MiB + 1, "cuda", num_segments=2, client=gpu_client)
    with pytest.raises(ValueError, match="cannot be served"):
        ExtensibleTensor(MiB, "cpu", client=gpu_client)
    t = ExtensibleTensor(16 * MiB, "cuda", num_segments=2, client=gpu_client)
    t.resize_per_segment_(2 * MiB)
    with pytest.raises(ValueError, match="grow-only"):
        t.resize_per_segment_(MiB)
    with pytest.raises(ValueError, match="exceeds the segment capacity"):
        t.resize_per_segment_(8 * MiB + 1)
    with pytest.raises(ValueError, match="single-segment"):
        t.resize_(4 * MiB)
    assert t.physical_bytes == 4 * MiB


def test_release_and_recommit_return_and_restore_memory(gpu_client):
    k = ExtensibleTensor(64 * MiB, "cuda", num_segments=2, client=gpu_client)
    kv = ExtensibleKVCacheBuffers([(k, 2 * MiB)], num_blocks_capacity=16)
    kv.commit(8)
    k.full_view()[: 16 * MiB].fill_(5)
    assert gpu_client.status().committed_bytes == 32 * MiB
    kv.release_physical()
    assert gpu_client.status().committed_bytes == 0 and k.physical_bytes == 0
    kv.recommit()
    assert kv.num_blocks_committed == 8 and gpu_client.status().committed_bytes == 32 * MiB
    assert int(k.full_view()[: 16 * MiB].sum()) == 0
    kv.free()
    assert gpu_client.status().num_buffers == 0


def test_a_cuda_graph_captured_before_growth_writes_the_new_blocks(gpu_client):
    block = 2 * MiB
    t = ExtensibleTensor(32 * block, "cuda", client=gpu_client)
    t.resize_(block, zero_new=True)
    blocks = t.full_view().view(32, block)
    index = torch.zeros(1, dtype=torch.long, device="cuda")
    source = torch.full((1, block), 7, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        blocks.index_copy_(0, index, source)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        blocks.index_copy_(0, index, source)
    # Only block 0 was mapped at capture time; grow under the graph, then aim it at the last block.
    t.resize_(32 * block, zero_new=True)
    index.fill_(31)
    source.fill_(9)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((blocks[31] == 9).all()) and bool((blocks[0] == 7).all()) and int(blocks[1:31].sum()) == 0


def test_uneven_segments_grow_on_their_own_and_keep_data_on_gpu(gpu_client):
    capacities = [3 * MiB, 8 * MiB, 5 * MiB]  # segment 1 starts and segment 2 starts inside shared granules
    t = ExtensibleTensor(sum(capacities), "cuda", segment_capacities=capacities, client=gpu_client)
    assert t.segment_offsets == [0, 3 * MiB, 11 * MiB]
    base = t.full_view().data_ptr()
    t.resize_segments_([MiB, 2 * MiB, 0], zero_new=True)
    t.segment_view(0).fill_(1)
    t.segment_view(1).fill_(2)
    t.resize_segments_(capacities, zero_new=True)
    assert t.full_view().data_ptr() == base == t.base_ptr
    assert filled(t.segment_view(0)[:MiB], 1) and int(t.segment_view(0)[MiB:].sum()) == 0
    assert filled(t.segment_view(1)[: 2 * MiB], 2) and int(t.segment_view(1)[2 * MiB :].sum()) == 0
    assert int(t.segment_view(2).sum()) == 0 and t.physical_bytes == 16 * MiB
    assert not all(t.segments_backed_by_one_chunk(capacities))
    t.defragment(preserve=True)
    assert all(t.segments_backed_by_one_chunk(capacities))
    assert filled(t.segment_view(1)[: 2 * MiB], 2)
    with pytest.raises(ValueError, match="grow-only"):
        t.resize_segments_([0, 8 * MiB, 5 * MiB])
    t.free()


def test_a_cuda_graph_captured_over_uneven_segments_writes_them_after_growth(gpu_client):
    # Per-layer segments of different strides, as vLLM 0.34 lays them out: 4 MiB and 8 MiB blocks.
    strides = [4 * MiB, 8 * MiB]
    t = ExtensibleTensor(16 * sum(strides), "cuda", segment_capacities=[16 * s for s in strides], client=gpu_client)
    t.resize_segments_(strides, zero_new=True)  # one block of each
    layers = [t.full_view()[offset : offset + 16 * stride].view(16, stride)
              for offset, stride in zip(t.segment_offsets, strides)]
    index = torch.zeros(1, dtype=torch.long, device="cuda")
    sources = [torch.full((1, stride), 5 + i, dtype=torch.uint8, device="cuda") for i, stride in enumerate(strides)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer, source in zip(layers, sources):
            layer.index_copy_(0, index, source)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer, source in zip(layers, sources):
            layer.index_copy_(0, index, source)
    t.resize_segments_([16 * s for s in strides], zero_new=True)
    index.fill_(15)
    graph.replay()
    torch.cuda.synchronize()
    for i, layer in enumerate(layers):
        assert bool((layer[15] == 5 + i).all()) and bool((layer[0] == 5 + i).all()) and int(layer[1:15].sum()) == 0
    t.free()


def test_attention_over_a_kv_layout_matches_cudamalloc_memory(gpu_client):
    num_blocks, block_size, heads, head_dim = 64, 16, 8, 128
    per_block = block_size * heads * head_dim * 2  # fp16 bytes per block per segment
    t = ExtensibleTensor(2 * num_blocks * per_block, "cuda", num_segments=2, client=gpu_client)
    t.resize_per_segment_(40 * per_block, zero_new=True)
    kv = t.full_view().view(torch.float16).view(2, num_blocks, block_size, heads, head_dim)
    torch.manual_seed(0)
    reference = torch.randn(2, 40, block_size, heads, head_dim, dtype=torch.float16, device="cuda")
    kv[:, :40].copy_(reference)
    block_table = torch.tensor([3, 17, 39, 0, 25], device="cuda")
    query = torch.randn(1, heads, 4, head_dim, dtype=torch.float16, device="cuda")

    def attend(cache):
        k = cache[0, block_table].reshape(-1, heads, head_dim).transpose(0, 1).unsqueeze(0)
        v = cache[1, block_table].reshape(-1, heads, head_dim).transpose(0, 1).unsqueeze(0)
        return torch.nn.functional.scaled_dot_product_attention(query, k, v)

    assert torch.equal(attend(kv), attend(reference.clone()))


WORKER = """
import sys, torch
from hbmd.client import ExtensibleTensor, connect
c = connect("cuda:0", client_name="gpu-worker")
t = ExtensibleTensor(64 << 20, "cuda", client=c)
t.resize_(int(sys.argv[1]) << 20 if len(sys.argv) > 1 else 32 << 20, zero_new=True)
t.full_view()[: 32 << 20].fill_(11)
torch.cuda.synchronize()
print(t.physical_bytes, flush=True)
sys.stdin.readline()
print(t.full_view()[: 32 << 20].unique().tolist(), flush=True)
"""


def test_two_worker_processes_map_one_daemon_at_once(gpu_daemon, gpu_client, spawn_worker):
    workers = [spawn_worker(gpu_daemon, WORKER) for _ in range(2)]
    assert [int(w.readline()) for w in workers] == [32 * MiB, 32 * MiB]
    assert gpu_client.status().committed_bytes == 64 * MiB
    for w in workers:
        w.send("go")
        assert w.readline() == "[11]"
        assert w.wait() == 0
    wait_until(lambda: gpu_client.status().committed_bytes == 0)


def test_a_sigkilled_gpu_worker_gives_its_memory_back(gpu_daemon, gpu_client, spawn_worker):
    worker = spawn_worker(gpu_daemon, WORKER)
    worker.readline()
    free_before_kill = torch.cuda.mem_get_info()[0]
    os.kill(worker.proc.pid, signal.SIGKILL)
    worker.wait()
    wait_until(lambda: gpu_client.status().committed_bytes == 0)
    # The daemon released its handles and the dead worker's mappings are gone: the pages are free.
    wait_until(lambda: torch.cuda.mem_get_info()[0] >= free_before_kill + 32 * MiB)


def compute_apps() -> dict[int, int]:
    """GPU memory (MiB) per process holding a context, as nvidia-smi lists them."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return {int(pid): int(mib) for pid, mib in (line.split(",") for line in out.stdout.strip().splitlines())}


def test_the_daemon_holds_no_cuda_context(gpu_daemon, gpu_client):
    t = ExtensibleTensor(1 << 30, "cuda", client=gpu_client)
    t.resize_(1 << 30)
    used = compute_apps()
    print(f"nvidia-smi compute apps (pid: MiB): {used}; daemon pid {gpu_daemon.pid}")
    assert os.getpid() in used  # this process holds a context, so the query does list processes
    assert used.get(gpu_daemon.pid, 0) == 0


def test_a_failed_set_access_undoes_the_import_and_the_map(gpu_client, monkeypatch):
    t = ExtensibleTensor(8 * MiB, "cuda", client=gpu_client)
    mapper = gpu_client.mapper
    real_set_access = driver.set_access
    attempts = []

    def map_twice(chunk, fd):
        def failing(*args):
            raise DriverError("injected", function="cuMemSetAccess", result="CUDA_ERROR_UNKNOWN")

        monkeypatch.setattr(driver, "set_access", failing)
        with pytest.raises(DriverError):
            mapper.map(t.base_ptr + chunk.offset, chunk, fd)
        monkeypatch.setattr(driver, "set_access", real_set_access)
        # Had the failed attempt left its mapping, mapping the same range again would fail.
        mapper.map(t.base_ptr + chunk.offset, chunk, fd)
        t._reservation.mapped.append((chunk.offset, chunk.size))
        attempts.append(chunk.chunk_id)

    with gpu_client.commit(t.buffer_id, 4 * MiB) as delivery:
        for chunk, fd in delivery:
            map_twice(chunk, fd)
    t._info = delivery.reply.buffer
    assert len(attempts) == 1
    t.full_view()[: 4 * MiB].fill_(1)
    assert int(t.full_view()[: 4 * MiB].sum()) == 4 * MiB


def test_a_failing_create_in_the_cuda_backend_leaks_no_device_memory():
    from hbmd.daemon.backends.cuda import CudaBackend
    from hbmd.daemon.state import State

    class FailingCuda(CudaBackend):
        calls = 0

        def create(self, arena, offset, size, tier="device"):
            FailingCuda.calls += 1
            if FailingCuda.calls == 3:
                raise OutOfDeviceMemory("injected", function="cuMemCreate", result="CUDA_ERROR_OUT_OF_MEMORY")
            return super().create(arena, offset, size, tier)

    torch.cuda.init()
    backend = FailingCuda(0)
    state = State(backend, budget_bytes=64 << 30)
    session = state.open_session(os.getpid(), 0, 0, "", "")
    buf = state.buffers.create(session, 8 * (1 << 30), 4)
    free_before = torch.cuda.mem_get_info()[0]
    with pytest.raises(OutOfDeviceMemory):
        state.commit(session, buf.buffer_id, 1 << 30)  # four separate 1 GiB runs; the third create fails
    assert state.tenants.committed_bytes == 0 and buf.chunks == []
    assert torch.cuda.mem_get_info()[0] >= free_before - 64 * MiB  # the two created GiB were released
    state.close_session(session)


GPU_CREATOR = """
import os, sys, torch
from hbmd.client import ExtensibleTensor, connect
c = connect("cuda:0")
t = ExtensibleTensor(256 << 20, "cuda", num_segments=2, client=c, name="gpu-kv", persistent=True)
for step in range(1, 9):
    t.resize_per_segment_(step * (8 << 20))
g = torch.Generator(device="cuda").manual_seed(3)
t.full_view()[: 64 << 20].copy_(torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda", generator=g))
t.full_view()[128 << 20 : 192 << 20].fill_(77)
torch.cuda.synchronize()
print(os.getpid(), t.num_chunks, flush=True)
if len(sys.argv) > 1:
    def stall(fresh):
        print("copying", flush=True)
        sys.stdin.readline()
    ExtensibleTensor._move_into = lambda self, fresh, started_over, to_tier: stall(fresh)
    t.defragment(preserve=True)
sys.stdin.readline()
"""


def expected_gpu_data():
    g = torch.Generator(device="cuda").manual_seed(3)
    return torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda", generator=g)


def test_a_sigkilled_gpu_workers_persistent_buffer_is_attached_with_its_data(gpu_daemon, gpu_client, spawn_worker):
    worker = spawn_worker(gpu_daemon, GPU_CREATOR)
    pid, chunks = map(int, worker.readline().split())
    assert chunks >= 16  # a chunk per run and commit, or (leased granules) one per granule
    os.kill(pid, signal.SIGKILL)
    worker.wait()
    wait_until(lambda: all(s.pid != pid for s in gpu_client.sessions()))
    t = ExtensibleTensor.attach("gpu-kv", "cuda", client=gpu_client)
    assert (t.max_num_bytes, t.num_segments, t.bytes_per_segment, t.num_chunks) == (256 * MiB, 2, 64 * MiB, chunks)
    view = t.full_view()
    assert torch.equal(view[: 64 * MiB], expected_gpu_data())
    assert bool((view[128 * MiB : 192 * MiB] == 77).all())
    t.defragment(preserve=True)
    assert t.num_chunks == 2 and view.data_ptr() == t.base_ptr
    assert torch.equal(view[: 64 * MiB], expected_gpu_data()) and bool((view[128 * MiB : 192 * MiB] == 77).all())
    assert gpu_client.status().committed_bytes == 128 * MiB


def test_a_gpu_worker_killed_mid_defragment_loses_nothing(gpu_daemon, gpu_client, spawn_worker):
    worker = spawn_worker(gpu_daemon, GPU_CREATOR.replace("if len(sys.argv) > 1:", "if True:"))
    pid, chunks = map(int, worker.readline().split())
    assert worker.readline() == "copying"
    assert gpu_client.status().committed_bytes == 256 * MiB
    os.kill(pid, signal.SIGKILL)
    worker.wait()
    wait_until(lambda: gpu_client.status().committed_bytes == 128 * MiB)
    t = ExtensibleTensor.attach("gpu-kv", "cuda", client=gpu_client)
    assert t.num_chunks == chunks and torch.equal(t.full_view()[: 64 * MiB], expected_gpu_data())


def test_defragment_discarding_and_kv_commit_on_gpu(gpu_client):
    k = ExtensibleTensor(64 * MiB, "cuda", num_segments=2, client=gpu_client)
    kv = ExtensibleKVCacheBuffers([(k, 2 * MiB)], num_blocks_capacity=16)
    for n in range(1, 9):
        kv.commit(n)
    k.full_view()[: 16 * MiB].fill_(1)
    kv.commit(10, defragment=True)
    assert k.num_chunks == 2 and int(k.full_view()[: 20 * MiB].sum()) == 0
    assert int(k.full_view()[32 * MiB : 52 * MiB].sum()) == 0


def test_device_memory_comes_from_nvml_and_follows_commits(gpu_client):
    before = gpu_client.device_memory()
    assert 0 < before.free <= before.total
    t = ExtensibleTensor(4 << 30, "cuda", client=gpu_client)
    t.resize_(4 << 30)
    after = gpu_client.device_memory()
    assert after.committed == before.committed + (4 << 30)
    assert before.free - after.free >= (4 << 30) - 64 * MiB


def test_a_restarted_cuda_daemon_re_adopts_its_parked_chunks(start_daemon, spawn_worker, run_dir):
    from fake_systemd import FakeSystemd

    systemd = FakeSystemd(run_dir / "notify.sock")
    state_dir = run_dir / "state"
    state_dir.mkdir()
    try:
        first = start_daemon("--device", "0", "--state-dir", str(state_dir), backend="cuda",
                             env={"NOTIFY_SOCKET": str(systemd.path)})
        worker = spawn_worker(first, GPU_CREATOR)
        _, chunks = map(int, worker.readline().split())
        worker.send("exit")  # the worker goes, and its mappings with it
        assert worker.wait() == 0
        wait_until(lambda: len(systemd.names()) == chunks)  # one exported FD per chunk
        assert first.stop() == 0
        second = start_daemon("--device", "0", "--state-dir", str(state_dir), backend="cuda", **systemd.relaunch())
        assert "restored: 0 sessions (resuming within 30s), 1 buffers" in second.log()
        torch.cuda.init()
        with connect("cuda:0", run_dir=run_dir) as client:
            kv = ExtensibleTensor.attach("gpu-kv", "cuda", client=client)
            view = kv.full_view()
            assert kv.num_chunks == chunks and torch.equal(view[: 64 * MiB], expected_gpu_data())
            assert bool((view[128 * MiB : 192 * MiB] == 77).all())
            apps = compute_apps()
            assert os.getpid() in apps and second.pid not in apps  # re-importing the FDs took no context
    finally:
        systemd.close()


def test_a_driver_out_of_memory_is_distinct_and_retryable(start_daemon):
    # The whole device as the budget: this process's own context (made first) leaves the driver short of it.
    torch.zeros(1, device="cuda")
    daemon = start_daemon("--device", "0", "--budget", "100%", backend="cuda")
    with connect("cuda:0", run_dir=daemon.run_dir) as client:
        budget = client.status().budget_bytes
        too_big = ExtensibleTensor(budget, "cuda", client=client)
        with pytest.raises(OutOfDeviceMemory) as info:
            too_big.resize_(budget // client.granularity * client.granularity)
        assert info.value.retryable and info.value.details.get("result") == "CUDA_ERROR_OUT_OF_MEMORY"
        assert client.status().committed_bytes == 0
        too_big.resize_(1 << 30)  # nothing half-done: the next commit works
        assert client.status().committed_bytes == 1 << 30


def test_warm_chunks_serve_small_commits_and_come_out_of_the_budget(start_daemon):
    torch.zeros(1, device="cuda")  # this process's context first: its ~500 MiB must not count as the pool's
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    daemon = start_daemon("--device", "0", "--budget", "1GiB", "--warm-chunks", "4", backend="cuda")
    with connect("cuda:0", run_dir=daemon.run_dir) as client:
        status = client.status()
        assert status.budget_bytes == (1 << 30) - 10 * MiB  # four warm granules and the export sentinel
        assert status.held_back_bytes == 10 * MiB
        wait_until(lambda: torch.cuda.mem_get_info()[0] <= free_before - 8 * MiB)  # the pool filled while idle
        t = ExtensibleTensor(64 * MiB, "cuda", num_segments=2, client=client)
        for step in range(1, 9):  # two single-granule runs per commit: warm chunks, then refills
            t.resize_per_segment_(step * 2 * MiB, zero_new=True)
            view = t.full_view()
            view[(step - 1) * 2 * MiB : step * 2 * MiB].fill_(step)
            view[32 * MiB + (step - 1) * 2 * MiB : 32 * MiB + step * 2 * MiB].fill_(100 + step)
        torch.cuda.synchronize()
        for step in range(1, 9):
            assert bool((view[(step - 1) * 2 * MiB : step * 2 * MiB] == step).all())
            assert bool((view[32 * MiB + (step - 1) * 2 * MiB : 32 * MiB + step * 2 * MiB] == 100 + step).all())
        assert t.num_chunks == 16 and client.status().committed_bytes == 32 * MiB
        t.free()
    assert daemon.stop() == 0
    wait_until(lambda: torch.cuda.mem_get_info()[0] >= free_before - 16 * MiB)  # the pool went with the daemon


def test_the_export_sentinel_is_held_out_of_the_budget_unless_turned_off(start_daemon):
    held = start_daemon("--device", "0", "--budget", "1GiB", "--warm-chunks", "0", backend="cuda")
    with connect("cuda:0", run_dir=held.run_dir) as client:
        status = client.status()
        assert status.held_back_bytes == 2 * MiB and status.budget_bytes == (1 << 30) - 2 * MiB
    assert held.stop() == 0
    plain = start_daemon("--device", "0", "--budget", "1GiB", "--no-export-sentinel", "--warm-chunks", "0",
                         backend="cuda")
    with connect("cuda:0", run_dir=plain.run_dir) as client:
        status = client.status()
        assert status.held_back_bytes == 0 and status.budget_bytes == 1 << 30


def test_a_cuda_map_that_fails_midway_is_repaired_and_a_failed_attach_keeps_the_buffer(gpu_daemon):
    from hbmd.client.cuda import CudaMapper

    class FlakyCudaMapper(CudaMapper):
        """The CUDA mapper, with the map calls numbered in ``fail`` failing."""

        fail: ClassVar[set[int]] = set()
        maps = 0

        def map_prepared(self, address, chunk, prepared, *args, **kwargs):
            # Every map goes through here: a chunk the daemon sent and a leased granule alike.
            self.maps += 1
            if self.maps in self.fail:
                raise DriverError("injected: cuMemMap failed", function="cuMemMap", result="CUDA_ERROR_OUT_OF_MEMORY")
            super().map_prepared(address, chunk, prepared, *args, **kwargs)

    torch.zeros(1, device="cuda")
    uuid = driver.device_uuid(0)
    mapper = FlakyCudaMapper(uuid, 2 * MiB)
    with connect("cuda:0", run_dir=gpu_daemon.run_dir, mapper=mapper) as client:
        t = ExtensibleTensor(64 * MiB, "cuda", num_segments=4, client=client, name="kv-flaky", persistent=True)
        t.resize_per_segment_(2 * MiB, zero_new=True)
        t.segment_view(0).fill_(4)
        mapper.maps, mapper.fail = 0, {2}  # the second of four new chunks
        t.resize_per_segment_(4 * MiB, zero_new=True)
        (info,) = client.buffers(client.session_id)
        assert info.segment_sizes == t.segment_sizes == [4 * MiB] * 4 and info.physical_bytes == t.physical_bytes
        torch.cuda.synchronize()
        assert filled(t.segment_view(0)[: 2 * MiB], 4)
        assert all(int(t.segment_view(i)[2 * MiB :].sum()) == 0 for i in range(4))  # mapped again, and zeroed
        t.detach()
        mapper.maps, mapper.fail = 0, {1}
        with pytest.raises(DriverError):
            ExtensibleTensor.attach("kv-flaky", "cuda", client=client)
        mapper.fail = set()
        back = ExtensibleTensor.attach("kv-flaky", "cuda", client=client)
        assert filled(back.segment_view(0)[: 2 * MiB], 4)
        back.free()




GPU_SEALER = """
import sys, torch
from hbmd.client import connect
from hbmd.client.weights import store_weights
c = connect("cuda:0", client_name="gpu-loader")
g = torch.Generator(device="cuda").manual_seed(18)
w = store_weights({"w": torch.randn(4096, 1024, device="cuda", generator=g).to(torch.bfloat16),
                   "b": torch.arange(1024, dtype=torch.int64, device="cuda")}, "gpu-weights", "cuda:0", client=c)
print(w.buffer_id, flush=True)
sys.stdin.readline()
"""

GPU_READER = """
import sys, torch
from hbmd.client import connect
from hbmd.client.weights import load_weights
c = connect("cuda:0", client_name="gpu-engine")
weights = load_weights("gpu-weights", "cuda:0", client=c)
# Position-weighted, so that bytes in the wrong place do not add up to the same sum.
checksum = sum(int(t.reshape(-1).view(torch.uint8).to(torch.int64).mul(torch.arange(1, t.numel() * t.element_size() + 1,
               device="cuda")).sum()) for t in weights.values())
print(checksum, flush=True)
if sys.stdin.readline().strip() == "write":
    weights["b"].fill_(7)
    torch.cuda.synchronize()
print(int(weights["b"].sum()), flush=True)
"""


def expected_weights():
    g = torch.Generator(device="cuda").manual_seed(18)
    return {"w": torch.randn(4096, 1024, device="cuda", generator=g).to(torch.bfloat16),
            "b": torch.arange(1024, dtype=torch.int64, device="cuda")}


def test_sealed_gpu_weights_are_read_by_two_processes_at_once(gpu_daemon, gpu_client, spawn_worker):
    from hbmd.client.weights import load_weights

    sealer = spawn_worker(gpu_daemon, GPU_SEALER)
    buffer_id = int(sealer.readline())
    readers = [spawn_worker(gpu_daemon, GPU_READER) for _ in range(2)]
    checksums = [int(r.readline()) for r in readers]
    assert checksums[0] == checksums[1]
    weights = load_weights("gpu-weights", "cuda:0", client=gpu_client)
    for name, tensor in expected_weights().items():
        assert weights[name].is_cuda and torch.equal(weights[name], tensor), name
    (info,) = [b for b in gpu_client.buffers() if b.buffer_id == buffer_id]
    assert info.sealed and info.readers == 3
    # Counted once, to the loader: three readers add nothing.
    assert gpu_client.status().committed_bytes == info.physical_bytes
    sealer.kill()
    wait_until(lambda: next(b for b in gpu_client.buffers() if b.buffer_id == buffer_id).session_id == 0)
    for r in readers:
        r.send("read")
        assert int(r.readline()) == sum(range(1024))


def test_a_write_through_a_read_only_cuda_mapping_fails_that_process_alone(gpu_daemon, gpu_client, spawn_worker):
    # Expected: the GPU's MMU refuses the store into a PROT_READ mapping, and the writing process's context
    # reports an illegal-address error (sticky: that process cannot use CUDA any more, so it fails). The
    # daemon holds no context and the other reader's context is its own: both carry on untouched.
    from hbmd.client.weights import load_weights

    sealer = spawn_worker(gpu_daemon, GPU_SEALER)
    sealer.readline()
    vandal, bystander = spawn_worker(gpu_daemon, GPU_READER), spawn_worker(gpu_daemon, GPU_READER)
    assert vandal.readline() == bystander.readline()
    vandal.send("write")
    assert vandal.wait() != 0
    stderr = vandal.stderr_tail()
    assert "illegal" in stderr.lower() or "fault" in stderr.lower(), stderr
    bystander.send("read")
    assert int(bystander.readline()) == sum(range(1024))
    assert torch.equal(load_weights("gpu-weights", "cuda:0", client=gpu_client)["b"], expected_weights()["b"])
    assert gpu_client.status().num_buffers == 1


# credit: chunks a client makes with cuMemCreate back its buffer with no round trip


def test_chunks_made_on_credit_back_the_buffer_and_outlive_their_maker(gpu_daemon, gpu_client):
    writer = gpu_client
    t = ExtensibleTensor(4 << 30, "cuda", client=writer, name="kv", persistent=True)
    first = 512 * MiB
    credited(writer, t, first, 1 << 30)  # credit for twice the commit the daemon served
    sent = writer.requests_sent
    t.resize_(first + (1 << 30), zero_new=True)
    assert writer.requests_sent == sent
    info = daemon_view(writer, t)
    assert info.physical_bytes == first + (1 << 30) and info.num_chunks == 2
    grown = t.full_view()[first : first + (1 << 30)]
    assert int(grown.sum()) == 0
    pattern = torch.randint(0, 256, (1 << 30,), dtype=torch.uint8, device="cuda")
    grown.copy_(pattern)
    torch.cuda.synchronize()
    del grown
    writer.close()  # its mappings and handles go: the daemon's FD alone keeps the chunk it made
    with connect("cuda:0", run_dir=gpu_daemon.run_dir, client_name="reader") as reader:
        again = ExtensibleTensor.attach("kv", "cuda", client=reader)
        assert torch.equal(again.full_view()[first : first + (1 << 30)], pattern)
        again.free()


def test_a_chunk_made_ahead_on_credit_is_taken_by_the_next_commit_of_its_size(gpu_client):
    client = gpu_client
    t = ExtensibleTensor(1 << 30, "cuda", client=client)
    credited(client, t, 64 * MiB, 128 * MiB)
    t.resize_(128 * MiB, zero_new=True)  # on credit: the listener then makes the next 64 MiB ahead
    wait_until(lambda: client.leasing.credit._spare is not None)
    t.full_view()[: 128 * MiB].fill_(7)
    sent = client.requests_sent
    t.resize_(192 * MiB, zero_new=True)
    assert client.requests_sent == sent
    view = t.full_view()
    assert int(view[128 * MiB : 192 * MiB].sum()) == 0 and int(view[128 * MiB - 1]) == 7
    info = daemon_view(client, t)
    assert info.physical_bytes == 192 * MiB and info.num_chunks == 3
    view[128 * MiB : 192 * MiB].fill_(9)
    torch.cuda.synchronize()
    assert int(view[128 * MiB : 192 * MiB].sum()) == 9 * 64 * MiB


def test_chunks_made_and_imported_beside_a_graph_capture_do_not_fail_it(gpu_client):
    """The listener makes chunks ahead on credit and imports leased granules while the engine may be capturing a CUDA
    graph, in torch's default mode, which fails on another thread's unsafe driver call."""
    mapper = gpu_client.mapper
    credit = Credit(lambda msg: None, lambda: mapper)
    credit.serve(collections.deque([proto.CreditGrant(128 * MiB)]))
    assert credit.spend(64 * MiB, lambda: None, ahead=64 * MiB)
    lease = Lease(2 * MiB, lambda: mapper, lambda msg: None)
    handle = driver.create(0, 2 * MiB, rdma=False)
    try:
        fd = driver.export_fd(handle)
    finally:
        driver.release(handle)
    grants = collections.deque([(proto.LeaseGrant([1], 2 * MiB), [fd])])

    def listener() -> None:
        credit.make_spare()
        lease.serve(grants, collections.deque())

    x = torch.zeros(1024, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
        beside = threading.Thread(target=listener)
        beside.start()
        beside.join()
        x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert int(x[0]) == 2
    spare = credit.take_spare(64 * MiB)
    assert spare is not None and len(lease) == 1
    os.close(spare.fd)
    mapper.discard(spare.prepared)
    lease.close()


def forged(kind: str, granule: int) -> int:
    """An FD of ``kind`` sent for a chunk of one granule of GPU 0."""
    if kind == "larger":
        handle = driver.create(0, 2 * granule, rdma=False)
    elif kind == "host memory":
        handle = driver.create_host(driver.host_numa_node(0), granule)
    else:
        return memfd.sealed_memfd(granule)
    try:
        return driver.export_fd(handle)
    finally:
        driver.release(handle)


@pytest.mark.parametrize("kind", ["larger", "host memory", "a memfd"])
def test_a_chunk_that_is_not_what_it_claims_is_refused(gpu_daemon, gpu_client, kind):
    client = gpu_client
    t = ExtensibleTensor(1 << 30, "cuda", client=client)
    credited(client, t, 32 * MiB, 64 * MiB)
    status = client.status()
    before = (daemon_view(client, t), status.committed_bytes, status.leased_bytes)
    fds_before = gpu_daemon.open_fds()
    granule = client.granularity
    fd = forged(kind, granule)
    try:
        msg = proto.OwnChunks(t.buffer_id, [32 * MiB + granule], [32 * MiB], [granule])
        socket.send_fds(client._core.handles.sock, [proto.encode_datagram(msg)], [fd])
    finally:
        os.close(fd)
    status = client.status()
    assert (daemon_view(client, t), status.committed_bytes, status.leased_bytes) == before
    assert gpu_daemon.open_fds() == fds_before
    assert "sent a datagram that was refused" in gpu_daemon.log()
    t.resize_(96 * MiB)
    assert daemon_view(client, t).physical_bytes == 96 * MiB


def test_a_second_daemon_of_the_gpu_is_refused_whatever_its_run_directory(start_daemon, run_dir, tmp_path):
    """The device lock keyed by the card's own UUID, as the driver reports it (tests/test_device_lock.py checks the
    lock's wiring on the host backend)."""
    locks = str(tmp_path / "locks")
    first = start_daemon("--device", "0", "--budget", "1GiB", "--device-lock-dir", locks, backend="cuda")
    uuid = driver.device_uuid(0)
    assert uuid.startswith("GPU-")
    second = DaemonProcess(run_dir / "other", "--backend", "cuda", "--device", "0", "--budget", "1GiB",
                           "--device-lock-dir", locks)
    with pytest.raises(RuntimeError, match=f"(?s)hbmd exited with 1:.*GPU {uuid} is already served by hbmd pid "
                                           f"{first.pid}"):
        second.start()
    assert first.alive() and first.stop() == 0
    assert second.start().alive()  # the card is free once the first has stopped
    second.kill()
