"""Every client operation completes or leaves the tensor as the daemon records it; nothing deletes a persistent buffer.

The faults come through a seam, not private attributes: the client is given
a host mapper that fails on demand (``connect(..., mapper=...)``).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest
from hbmd.client import Conflict, ExtensibleTensor, TensorUnusable
from hbmd.client.host import HostMapper
from helpers import GRANULE, MiB, filled, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]


class FlakyMapper(HostMapper):
    """The host mapper, with ``reserve`` and mapping failing on the calls named (1-based, counted from arming)."""

    def __init__(self, granularity: int) -> None:
        super().__init__(granularity)
        self.fail_reserve: set[int] = set()
        self.fail_map: set[int] = set()
        self.reserves = self.maps = 0

    def arm(self, *, reserve: set[int] = frozenset(), map: set[int] = frozenset()) -> None:
        self.fail_reserve, self.fail_map = set(reserve), set(map)
        self.reserves = self.maps = 0

    def reserve(self, size: int) -> int:
        self.reserves += 1
        if self.reserves in self.fail_reserve:
            raise OSError(12, "injected: cannot reserve address space")
        return super().reserve(size)

    def map_prepared(self, address, chunk, prepared, readonly=False) -> None:
        # Every map goes through here: a chunk the daemon sent and a leased granule alike.
        self.maps += 1
        if self.maps in self.fail_map:
            raise OSError(12, "injected: cannot map")
        super().map_prepared(address, chunk, prepared, readonly)


@pytest.fixture
def flaky(daemon):
    mapper = FlakyMapper(GRANULE)
    with daemon.connect(client_name="flaky", mapper=mapper) as client:
        yield client, mapper


def agree(client, tensor) -> None:
    """The daemon's record of the buffer is what the tensor says, and every committed byte can be read."""
    (info,) = [b for b in client.buffers() if b.buffer_id == tensor.buffer_id]
    assert info.segment_sizes == tensor.segment_sizes and info.physical_bytes == tensor.physical_bytes
    for i in range(tensor.num_segments):
        tensor.segment_view(i).sum()


def test_a_failed_attach_keeps_the_persistent_buffer_and_its_data(daemon, client, flaky):
    t = ExtensibleTensor(16 * MiB, "cpu", client=client, name="kv", persistent=True)
    t.resize_(8 * MiB).fill_(5)
    t.detach()
    other, mapper = flaky
    mapper.arm(reserve={1})
    with pytest.raises(OSError, match="cannot reserve"):
        ExtensibleTensor.attach("kv", "cpu", client=other)
    mapper.arm(map={1})
    with pytest.raises(OSError, match="cannot map"):
        ExtensibleTensor.attach("kv", "cpu", client=other)
    back = ExtensibleTensor.attach("kv", "cpu", client=client)
    assert filled(back.tensor, 5) and back.num_bytes == 8 * MiB


def test_a_map_that_fails_midway_through_a_commit_is_repaired_and_the_commit_completes(flaky):
    client, mapper = flaky
    t = ExtensibleTensor(32 * MiB, "cpu", num_segments=4, client=client)
    t.resize_per_segment_(2 * MiB)
    t.full_view()[: 2 * MiB].fill_(3)
    mapper.arm(map={2})  # the second of four new chunks
    t.resize_per_segment_(4 * MiB)
    assert t.segment_sizes == [4 * MiB] * 4
    agree(client, t)
    assert filled(t.full_view()[: 2 * MiB], 3)
    t.resize_per_segment_(4 * MiB)  # the same size again: nothing left to map


def test_a_leased_granule_that_fails_to_map_is_repaired_from_the_daemons_record(flaky):
    client, mapper = flaky
    t = ExtensibleTensor(32 * MiB, "cpu", num_segments=2, client=client)
    t.resize_per_segment_(2 * MiB)
    t.full_view()[: 2 * MiB].fill_(5)
    wait_until(lambda: client.leased_granules >= 2)
    sent = client.requests_sent
    mapper.arm(map={2})  # the second of the two leased granules
    t.resize_per_segment_(4 * MiB)
    assert client.requests_sent == sent + 1  # no commit request: only the Remap that repaired the mapping
    assert t.segment_sizes == [4 * MiB] * 2
    agree(client, t)
    t.full_view()[16 * MiB : 20 * MiB].fill_(6)  # every granule the daemon recorded is mapped
    assert filled(t.full_view()[: 2 * MiB], 5)


def test_when_the_repair_fails_too_the_tensor_says_it_is_unusable(flaky):
    client, mapper = flaky
    t = ExtensibleTensor(16 * MiB, "cpu", num_segments=2, client=client)
    t.resize_per_segment_(2 * MiB)
    mapper.arm(map={1, 2, 3, 4, 5})
    with pytest.raises(TensorUnusable, match="free it"):
        t.resize_per_segment_(4 * MiB)
    with pytest.raises(TensorUnusable):
        t.segment_view(0)
    t.free()
    assert client.status().committed_bytes == 0


def test_a_refused_discarding_defragment_leaves_everything_mapped(flaky):
    client, _ = flaky
    t = ExtensibleTensor(16 * MiB, "cpu", client=client)
    for step in (2, 4, 6):
        t.resize_(step * MiB)
    t.tensor.fill_(9)
    client.defragment(t.buffer_id, True).close()  # a preserving defragment left unfinished
    with pytest.raises(Conflict):
        t.defragment(preserve=False)
    assert t.num_bytes == 6 * MiB and filled(t.tensor, 9)
    agree(client, t)


def test_a_view_that_outlives_free_keeps_its_range_from_being_reused(client):
    t = ExtensibleTensor(64 * MiB, "cpu", client=client)
    view = t.full_view()
    base = t.base_ptr
    t.free()
    with pytest.raises(ValueError, match="freed"):
        t.segment_view(0)
    others = [ExtensibleTensor(64 * MiB, "cpu", client=client) for _ in range(4)]
    assert all(abs(o.base_ptr - base) >= 64 * MiB for o in others)

    def reserved(address: int) -> bool:
        with open("/proc/self/maps") as maps:
            return any(int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16) for line in maps)

    assert reserved(base)
    del view
    gc.collect()
    assert not reserved(base)


@pytest.mark.system
def test_touching_a_view_after_free_faults_rather_than_reading_other_memory(daemon):
    code = textwrap.dedent(
        """
        from hbmd.client import ExtensibleTensor, connect
        c = connect("cpu")
        t = ExtensibleTensor(8 << 20, "cpu", client=c)
        view = t.resize_(4 << 20)
        view.fill_(1)
        t.free()
        print("freed", flush=True)
        view.sum()
        """
    )
    env = dict(os.environ, HBMD_RUN_DIR=str(daemon.run_dir))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.strip() == "freed" and out.returncode == -11  # SIGSEGV, documented
