"""Credit on a GPU: chunks a client makes with ``cuMemCreate`` back its buffer with no round trip, outlive the client
in the daemon, and a chunk that is not plain memory of this GPU of exactly the size claimed is refused."""

from __future__ import annotations

import os
import socket

import pytest
from hbmd import driver, memfd, proto
from hbmd.client import ExtensibleTensor, connect
from helpers import MiB, credited, cuda_vmm_status, daemon_view

GPU_OK, GPU_REASON = cuda_vmm_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=GPU_REASON)]

if GPU_OK:
    import torch


@pytest.fixture
def gpu_daemon(start_daemon):
    return start_daemon("--device", "0", "--budget", "16GiB", backend="cuda")


def gpu_connect(daemon, **kwargs):
    torch.cuda.init()
    return connect("cuda:0", run_dir=daemon.run_dir, **kwargs)


def test_chunks_made_on_credit_back_the_buffer_and_outlive_their_maker(gpu_daemon):
    writer = gpu_connect(gpu_daemon, client_name="writer")
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
    with gpu_connect(gpu_daemon, client_name="reader") as reader:
        again = ExtensibleTensor.attach("kv", "cuda", client=reader)
        assert torch.equal(again.full_view()[first : first + (1 << 30)], pattern)
        again.free()


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
def test_a_chunk_that_is_not_what_it_claims_is_refused(gpu_daemon, kind):
    with gpu_connect(gpu_daemon) as client:
        t = ExtensibleTensor(1 << 30, "cuda", client=client)
        credited(client, t, 32 * MiB, 64 * MiB)
        status = client.status()
        before = (daemon_view(client, t), status.committed_bytes, status.leased_bytes)
        fds_before = gpu_daemon.open_fds()
        granule = client.granularity
        fd = forged(kind, granule)
        try:
            msg = proto.OwnChunks(t.buffer_id, [32 * MiB + granule], [32 * MiB], [granule])
            socket.send_fds(client._handles.sock, [proto.encode_datagram(msg)], [fd])
        finally:
            os.close(fd)
        status = client.status()
        assert (daemon_view(client, t), status.committed_bytes, status.leased_bytes) == before
        assert gpu_daemon.open_fds() == fds_before
        assert "sent a datagram that was refused" in gpu_daemon.log()
        t.resize_(96 * MiB)
        assert daemon_view(client, t).physical_bytes == 96 * MiB
