"""A graft: a restarted engine's own buffer takes the memory its predecessor left, data and all, at its own address.

The predecessor (a process of its own) writes a known pattern into a
persistent multi-segment buffer and exits, leaving it an orphan. The
successor makes its own buffer of the same layout first, as vLLM must (its
warm-up writes into it, and its CUDA graphs capture its address), lets go
of every page, and grafts: the orphan's chunks are mapped in its
reservation at their offsets, without a copy and without a byte charged
twice.
"""

from __future__ import annotations

import json

import pytest
from hbmd.client import ExtensibleTensor
from hbmd.daemon.restart.persist import Journal
from hbmd.proto.errors import Conflict, InvalidRequest, NotFound, OutOfBudget
from helpers import MiB, filled, hbmctl, torch, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]

CAPACITIES = [16 * MiB, 24 * MiB, 8 * MiB]
SIZES = [6 * MiB, 10 * MiB, 4 * MiB]
"""The predecessor's layout: uneven segments, each committed to its own size."""

PREDECESSOR = f"""
import torch
from hbmd.client import ExtensibleTensor, connect

c = connect("cpu", client_name="predecessor")
kv = ExtensibleTensor({sum(CAPACITIES)}, "cpu", segment_capacities={CAPACITIES}, client=c, name="kv", persistent=True)
kv.resize_segments_({SIZES})
g = torch.Generator().manual_seed(50)
for index, size in enumerate({SIZES}):
    kv.segment_view(index).copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g))
print("written", flush=True)
"""


def pattern() -> list:
    """What the predecessor wrote into each segment."""
    g = torch.Generator().manual_seed(50)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for size in SIZES]


def successor_buffer(client, name: str = "kv-next", capacities=CAPACITIES, **kwargs) -> ExtensibleTensor:
    """The successor's own buffer, warmed up (garbage written into it) and released, as vLLM leaves it."""
    own = ExtensibleTensor(sum(capacities), "cpu", segment_capacities=capacities, client=client, name=name,
                           persistent=True, **kwargs)
    own.resize_per_segment_(min(capacities))
    own.full_view()[: min(capacities)] = 255
    own.release_physical()
    return own


def orphan_left(daemon, spawn_worker) -> None:
    predecessor = spawn_worker(daemon, PREDECESSOR)
    assert predecessor.readline() == "written"
    assert predecessor.wait() == 0
    with daemon.connect(observer=True) as look:
        wait_until(lambda: [b.session_id for b in look.buffers()] == [0])


@pytest.mark.system
def test_a_graft_maps_the_orphans_bytes_at_the_buffers_own_address(daemon, spawn_worker):
    orphan_left(daemon, spawn_worker)
    client = daemon.connect(client_name="successor")
    own = successor_buffer(client)
    view, base = own.full_view(), own.base_ptr
    committed = client.status().committed_bytes
    assert committed == sum(SIZES)  # the orphan's; the successor's warm-up pages are gone

    own.graft("kv")
    assert own.base_ptr == base and view.data_ptr() == base
    assert own.segment_sizes == SIZES and own.physical_bytes == sum(SIZES)
    for index, written in enumerate(pattern()):
        start = own.segment_offsets[index]
        assert torch.equal(view[start : start + SIZES[index]], written)  # through the view made before the graft
    assert client.status().committed_bytes == committed  # nothing charged twice, nothing copied
    listed = json.loads(hbmctl("--run-dir", str(daemon.run_dir), "buffers", "--json").stdout)["buffers"]
    assert [(b["name"], b["session_id"], b["physical_bytes"]) for b in listed] == [
        ("kv-next", client.session_id, sum(SIZES))
    ]
    assert (f"session {client.session_id} grafted orphan 'kv' into buffer {own.buffer_id} (20.0 MiB in 3 chunks)"
            in daemon.log())

    own.resize_segments_([12 * MiB, 12 * MiB, 8 * MiB], zero_new=True)  # it grows on as any buffer
    assert filled(own.segment_view(0)[SIZES[0] :], 0) and torch.equal(own.segment_view(0)[: SIZES[0]], pattern()[0])
    assert client.status().committed_bytes == 32 * MiB
    with pytest.raises(NotFound):
        ExtensibleTensor.attach("kv", "cpu", client=daemon.connect())  # the orphan's name is free
    own.free()
    assert client.status().committed_bytes == 0


@pytest.mark.system
def test_a_graft_into_segments_of_other_capacities_keeps_each_chunk_where_it_was_in_its_segment(daemon, spawn_worker):
    """A restarted vLLM's reservation is a few blocks longer or shorter where its profiled memory moved (CUDA graphs
    make it vary): its layers lie elsewhere, each chunk goes to the same place of its layer."""
    orphan_left(daemon, spawn_worker)
    client = daemon.connect(client_name="successor")
    other = [18 * MiB, 10 * MiB, 30 * MiB]
    own = successor_buffer(client, capacities=other)
    own.graft("kv")
    assert own.segment_sizes == SIZES and own.physical_bytes == sum(SIZES)
    assert all(torch.equal(own.segment_view(i), written) for i, written in enumerate(pattern()))
    own.resize_segments_(other, zero_new=True)  # it grows on to its own capacities
    assert all(filled(own.segment_view(i)[SIZES[i] :], 0) for i in range(3))
    assert client.status().committed_bytes == sum(other)
    own.free()


def as_seen(client) -> tuple:
    """What a refusal must leave as it was: the totals, every buffer and every tenant's use (its leases too: the
    sessions that see it refused are leased nothing)."""
    status = client.status()
    return status.committed_bytes, status.num_chunks, sorted(map(repr, client.buffers())), repr(status.tenants)


def refused(look, own: ExtensibleTensor, name: str, error: type, match: str) -> None:
    before, mapped = as_seen(look), (own.segment_sizes, own.num_physical_chunks, own.base_ptr)
    with pytest.raises(error, match=match):
        own.graft(name)
    assert as_seen(look) == before
    assert (own.segment_sizes, own.num_physical_chunks, own.full_view().data_ptr()) == mapped


@pytest.mark.system
def test_each_refused_graft_changes_nothing(daemon, spawn_worker):
    orphan_left(daemon, spawn_worker)
    client = daemon.connect(client_name="successor", lease=False)  # no lease topped up meanwhile
    look = daemon.connect(observer=True)
    own = successor_buffer(client)

    refused(look, own, "nothing-of-that-name", NotFound, "no persistent buffer named")
    for other in ([24 * MiB, 24 * MiB], [16 * MiB, 24 * MiB, 8 * MiB, 2 * MiB]):
        wrong = successor_buffer(client, f"layout-{len(other)}-{other[0]}", other)
        refused(look, wrong, "kv", InvalidRequest, r"another layout than buffer \d+: 50331648 bytes in 3 segments of "
                r"\[16777216, 25165824, 8388608\] bytes, not \d+ bytes in \d segments of \[.*\] bytes")
        wrong.free()
    short = successor_buffer(client, "short", [4 * MiB, 24 * MiB, 16 * MiB])  # segment 0 holds 6 MiB of data
    refused(look, short, "kv", InvalidRequest, r"cannot be grafted into buffer \d+: its chunk at 0 ends 6291456 bytes "
            "into segment 0, past the 4194304 bytes")
    short.free()
    shareable = successor_buffer(client, "shareable", shareable=True)
    refused(look, shareable, "kv", InvalidRequest, "shareable")
    shareable.free()
    own.resize_per_segment_(2 * MiB)
    refused(look, own, "kv", InvalidRequest, "has 6.0 MiB committed: a graft fills a buffer with nothing committed")
    own.release_physical()

    holder = ExtensibleTensor.attach("kv", "cpu", client=daemon.connect(client_name="holder", lease=False))
    refused(look, own, "kv", Conflict, "is attached by session")
    holder.detach()

    weights = ExtensibleTensor(sum(CAPACITIES), "cpu", segment_capacities=CAPACITIES, client=client, name="weights",
                               persistent=True)
    weights.resize_per_segment_(2 * MiB)
    weights.seal()
    reader = ExtensibleTensor.attach("weights", "cpu", client=daemon.connect(lease=False), readonly=True)
    weights.detach()
    refused(look, own, "weights", InvalidRequest, "it is sealed")
    reader.free()
    refused(look, own, "weights", InvalidRequest, "it is sealed")

    # The orphan is whole after all of that: the graft goes through and finds every byte.
    own.graft("kv")
    assert all(torch.equal(own.segment_view(i), written) for i, written in enumerate(pattern()))


def test_a_demoted_orphan_is_not_grafted(start_daemon):
    daemon = start_daemon("--budget", "128MiB", "--host-budget", "64MiB", "--host-pool", "0")
    client = daemon.connect(lease=False)
    demoted = ExtensibleTensor(16 * MiB, "cpu", num_segments=2, client=client, name="demoted", persistent=True)
    demoted.resize_per_segment_(4 * MiB)
    demoted.demote()
    demoted.detach()
    own = ExtensibleTensor(16 * MiB, "cpu", num_segments=2, client=client, name="own", persistent=True)
    with daemon.connect(observer=True) as look:
        refused(look, own, "demoted", InvalidRequest, "demoted to the host tier: attach and promote it first")


def test_a_graft_past_the_tenants_maximum_is_refused(start_daemon, run_dir):
    config = run_dir / "hbmd.toml"
    config.write_text('[[tenants]]\nname = "small"\nmax = "16MiB"\n')
    daemon = start_daemon("--budget", "128MiB", "--config", str(config))
    first = daemon.connect(tenant="big", lease=False)
    kv = ExtensibleTensor(48 * MiB, "cpu", num_segments=2, client=first, name="kv", persistent=True)
    kv.resize_per_segment_(10 * MiB)
    kv.segment_view(0).fill_(9)
    kv.detach()
    small = daemon.connect(tenant="small", lease=False)
    own = ExtensibleTensor(48 * MiB, "cpu", num_segments=2, client=small, name="own", persistent=True)
    with daemon.connect(observer=True) as look:
        refused(look, own, "kv", OutOfBudget, "exceeds the budget of tenant 'small'")
    # Within another tenant's limits it goes through, and the charge moves to that tenant: the total stays.
    roomy = daemon.connect(tenant="roomy", lease=False)
    other = ExtensibleTensor(48 * MiB, "cpu", num_segments=2, client=roomy, name="other", persistent=True)
    other.graft("kv")
    assert filled(other.segment_view(0), 9) and filled(other.segment_view(1), 0)
    status = roomy.status()
    assert {t.name: t.used_bytes for t in status.tenants} == {"big": 0, "small": 0, "roomy": 20 * MiB}
    assert status.committed_bytes == 20 * MiB


def journaled_buffers(state_dir) -> list[tuple[str, int]]:
    buffers = Journal(state_dir / "host.journal").read()["buffers"].values()
    return sorted((b["name"], len(b["chunks"])) for b in buffers)


@pytest.mark.parametrize("capacities", [CAPACITIES, [18 * MiB, 14 * MiB, 30 * MiB]], ids=["same", "other"])
@pytest.mark.parametrize("how", ["fd-store", "takeover"])
@pytest.mark.system
def test_a_restart_right_after_a_graft_brings_back_the_grafted_buffer_and_no_orphan(
        start_daemon, spawn_worker, run_dir, systemd, how, capacities):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    args = ("--budget", "256MiB", "--state-dir", str(state_dir))
    first = start_daemon(*args, env={"NOTIFY_SOCKET": str(systemd.path)})
    orphan_left(first, spawn_worker)
    client = first.connect(client_name="successor")
    own = successor_buffer(client, capacities=capacities)
    own.graft("kv")
    view = own.full_view()
    wait_until(lambda: journaled_buffers(state_dir) == [("kv-next", 3)])

    if how == "fd-store":
        first.kill()  # right after: what it acknowledged is journaled, its chunks parked
        second = start_daemon(*args, **systemd.relaunch())
        assert "restored: 1 sessions (resuming within 30s), 1 buffers" in second.log()
    else:
        second = start_daemon(*args, "--takeover", env={"NOTIFY_SOCKET": str(systemd.path)})
        assert first.proc.wait(10) == 0
    wait_until(lambda: f"session {client.session_id} resumed" in second.log())
    with second.connect(observer=True) as look:
        assert [(b.name, b.session_id, b.segment_sizes) for b in look.buffers()] == [
            ("kv-next", client.session_id, SIZES)
        ]
        assert look.status().committed_bytes == sum(SIZES)
    for index, written in enumerate(pattern()):  # its pages never left this process
        start = own.segment_offsets[index]
        assert torch.equal(view[start : start + SIZES[index]], written)
    own.detach()
    again = ExtensibleTensor.attach("kv-next", "cpu", client=second.connect())  # the daemon's restored chunks
    assert all(torch.equal(again.segment_view(i), written) for i, written in enumerate(pattern()))
    again.resize_segments_([8 * MiB, 12 * MiB, 6 * MiB])
    assert torch.equal(again.segment_view(1)[: SIZES[1]], pattern()[1])
