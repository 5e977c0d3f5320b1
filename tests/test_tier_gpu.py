"""The host tier on a real GPU: host-NUMA chunks at the same addresses as the device chunks they replace.

Skipped, with the reason, where CUDA VMM with POSIX-FD handles is absent. What
a user checks: the bytes and ``base_ptr`` survive a demote and a promote,
kernels run on the demoted bytes in place, a CUDA graph captured on the
device replays correctly after each move, the budgets follow, and a worker
killed midway loses nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from hbmd.client import ExtensibleTensor, connect
from helpers import MiB, cuda_vmm_status, wait_until

GPU_OK, GPU_REASON = cuda_vmm_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=GPU_REASON)]

if GPU_OK:
    import torch

GiB = 1 << 30


@pytest.fixture
def tiered_gpu(start_daemon):
    return start_daemon("--device", "0", "--budget", "16GiB", "--host-budget", "8GiB", "--host-pool", "1GiB",
                        backend="cuda")


@pytest.fixture
def gpu_client(tiered_gpu):
    torch.cuda.init()
    client = connect("cuda:0", run_dir=tiered_gpu.run_dir, client_name="tier-test", lease=False)
    yield client
    client.close()


def kv_cache(client, **kwargs) -> tuple[ExtensibleTensor, torch.Tensor]:
    """A 1 GiB two-segment buffer grown in four commits, its committed bytes random."""
    t = ExtensibleTensor(GiB, "cuda", num_segments=2, client=client, **kwargs)
    for size in (64 * MiB, 128 * MiB, 256 * MiB, 384 * MiB):
        t.resize_per_segment_(size)
    data = torch.randint(0, 256, (2, 384 * MiB), dtype=torch.uint8, device="cuda",
                         generator=torch.Generator("cuda").manual_seed(5))
    for index in (0, 1):
        t.segment_view(index).copy_(data[index])
    torch.cuda.synchronize()
    return t, data


def intact(t: ExtensibleTensor, data: torch.Tensor) -> bool:
    return all(torch.equal(t.segment_view(i), data[i]) for i in (0, 1))


def test_the_host_pool_is_made_while_idle(tiered_gpu, gpu_client):
    wait_until(lambda: gpu_client.status().host_pool_bytes == GiB, timeout=30)
    assert gpu_client.status().host_budget_bytes == 8 * GiB


def test_demote_and_promote_keep_bytes_and_base_and_a_captured_graph_replays(gpu_client):
    t, data = kv_cache(gpu_client)
    view = t.full_view()
    base, physical = t.base_ptr, t.physical_bytes
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        view[: 4 * MiB].add_(1)  # warm-up outside the capture, as graph capture asks
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            view[: 4 * MiB].add_(1)
    torch.cuda.synchronize()
    data[0, : 4 * MiB] += 1

    t.demote()
    assert t.tier == "host" and t.base_ptr == base and view.data_ptr() == base and intact(t, data)
    status = gpu_client.status()
    assert status.committed_bytes == 0 and status.host_bytes == physical
    graph.replay()  # the graph's kernel now writes host-NUMA memory, at the addresses it captured
    torch.cuda.synchronize()
    data[0, : 4 * MiB] += 1
    assert intact(t, data)
    # A kernel reads the demoted bytes in place.
    assert int(t.segment_view(1).sum(dtype=torch.int64)) == int(data[1].sum(dtype=torch.int64))

    t.promote()
    assert t.tier == "device" and t.base_ptr == base and intact(t, data)
    graph.replay()
    torch.cuda.synchronize()
    data[0, : 4 * MiB] += 1
    assert intact(t, data)
    status = gpu_client.status()
    assert status.committed_bytes == physical and status.host_bytes == 0
    del view
    t.free()


def test_a_persistent_buffer_is_attached_in_the_host_tier_by_another_process(tiered_gpu, gpu_client):
    t, data = kv_cache(gpu_client, name="kv", persistent=True)
    t.demote()
    expected = int(data.sum(dtype=torch.int64))
    t.detach()
    reader = textwrap.dedent(
        """
        import torch
        from hbmd.client import ExtensibleTensor
        kv = ExtensibleTensor.attach("kv", "cuda")
        print(kv.tier, sum(int(kv.segment_view(i).sum(dtype=torch.int64)) for i in (0, 1)), flush=True)
        kv.detach()
        """
    )
    out = subprocess.run([sys.executable, "-c", reader], env=dict(os.environ, HBMD_RUN_DIR=str(tiered_gpu.run_dir)),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["host", str(expected)]


MOVER = textwrap.dedent(
    """
    import random, sys, torch
    from hbmd.client import ExtensibleTensor, connect

    kv = ExtensibleTensor.attach("kv", "cuda", client=connect("cuda:0", lease=False))
    print("ready", flush=True)
    rng = random.Random(int(sys.argv[1]))
    while True:
        kv.demote() if rng.random() < 0.6 else kv.promote()
    """
)


def test_workers_killed_mid_move_lose_nothing(tiered_gpu, gpu_client):
    import random
    import time

    t, data = kv_cache(gpu_client, name="kv", persistent=True)
    physical = t.physical_bytes
    t.detach()
    rng = random.Random(3)
    for round_number in range(8):
        worker = subprocess.Popen([sys.executable, "-c", MOVER, str(round_number)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env=dict(os.environ, HBMD_RUN_DIR=str(tiered_gpu.run_dir)))
        try:
            assert worker.stdout.readline().strip() == "ready", worker.stderr.read()[-2000:]
            time.sleep(rng.uniform(0, 0.5))
        finally:
            worker.send_signal(signal.SIGKILL)
            worker.wait(30)
            worker.stdout.close()
            worker.stderr.close()

        def settled() -> bool:
            s = gpu_client.status()
            return s.num_sessions == 1 and s.committed_bytes + s.host_bytes == physical

        wait_until(settled, timeout=30)
        kv = ExtensibleTensor.attach("kv", "cuda", client=gpu_client)
        assert intact(kv, data), f"round {round_number}: bytes lost in the {kv.tier} tier"
        kv.detach()
    gpu_client.delete("kv")
    assert gpu_client.status().host_bytes == 0


def test_a_commit_that_does_not_fit_demotes_an_idle_demotable_tenant_and_room_brings_it_back(start_daemon, tmp_path):
    config = tmp_path / "hbmd.toml"
    config.write_text('[[tenants]]\nname = "batch"\ndemote = 1\n')
    daemon = start_daemon("--device", "0", "--budget", "2GiB", "--host-budget", "4GiB", "--host-pool", "1GiB",
                          "--config", str(config), "--demote-idle", "0", backend="cuda")
    torch.cuda.init()
    batch = connect("cuda:0", run_dir=daemon.run_dir, client_name="batch", tenant="batch", lease=False)
    online = connect("cuda:0", run_dir=daemon.run_dir, client_name="online", lease=False)
    sleeping, data = kv_cache(batch)  # 768 MiB committed
    sleeping.set_idle()  # its engine leaves it alone: only then may its client move it
    growing = ExtensibleTensor(2 * GiB, "cuda", client=online)
    growing.resize_(1536 * MiB)  # does not fit beside it: its client demotes it, the commit goes through
    assert sleeping.tier == "host" and intact(sleeping, data)
    growing.free()
    wait_until(lambda: sleeping.tier == "device", timeout=30)  # room again: promoted back by its client
    assert intact(sleeping, data)
    online.close()
    batch.close()
