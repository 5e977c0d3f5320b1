"""The host tier on the host backend: demote and promote at the same addresses, over a real daemon and sockets.

What a user checks: the bytes written before a demote read back after it
and after the promote, ``base_ptr`` and views unchanged, the device budget
freed at once and the host budget charged, refusals that change nothing,
persistent buffers attachable in either tier, and workers killed midway
that lose no byte and leak nothing.
"""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from hbmd.client import Conflict, ExtensibleKVCacheBuffers, ExtensibleTensor, InvalidRequest, OutOfBudget
from hbmd.client.pressure import DEMOTE_WAIT_S
from hbmd.proto import Move, PromoteRequest, ReclaimRequest
from helpers import DEMOTABLE, MiB, filled, hbmctl, torch, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]

PIECE = 8 * MiB
TIER = ("--host-budget", "96MiB", "--host-pool", "16MiB", "--host-piece", "8MiB")
KILL_ROUNDS = int(os.environ.get("HBMD_KILL_ROUNDS", "40")) // 2


@pytest.fixture
def tiered(start_daemon):
    """A host-backend daemon with a 64 MiB device budget and a 96 MiB host tier cut into 8 MiB pieces."""
    return start_daemon("--budget", "64MiB", *TIER)


def pattern(size: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def written(client, sizes=(20 * MiB, 6 * MiB), **kwargs) -> tuple[ExtensibleTensor, list[torch.Tensor]]:
    """A buffer of two 32 MiB segments grown in three steps (several chunks), each segment's prefix random."""
    t = ExtensibleTensor(64 * MiB, "cpu", num_segments=2, client=client, **kwargs)
    for quarters in (1, 2, 4):
        t.resize_segments_([size * quarters // 4 // (2 * MiB) * (2 * MiB) for size in sizes])
    data = [pattern(size, seed) for seed, size in enumerate(sizes)]
    for index, values in enumerate(data):
        t.segment_view(index)[:] = values
    return t, data


def intact(t: ExtensibleTensor, data: list[torch.Tensor]) -> bool:
    return all(torch.equal(t.segment_view(i), values) for i, values in enumerate(data))


@pytest.mark.system
def test_demote_and_promote_keep_bytes_address_and_views_and_move_the_charge(tiered):
    client = tiered.connect(client_name="sleeper", tenant="team-a", lease=False)
    t, data = written(client)
    view = t.full_view()
    base, physical, chunks = t.base_ptr, t.physical_bytes, t.num_chunks
    assert chunks > 2 and t.tier == "device"
    assert client.status().committed_bytes == physical

    t.demote()
    assert t.tier == "host" and intact(t, data)
    assert t.base_ptr == base and t.full_view().data_ptr() == base and view.data_ptr() == base
    # The device pages went back at once; the host tier holds the bytes, in pieces of at most 8 MiB.
    status = client.status()
    assert status.committed_bytes == 0 and status.host_bytes == physical
    assert [tn.host_bytes for tn in status.tenants if tn.name == "team-a"] == [physical]
    assert [tn.used_bytes for tn in status.tenants if tn.name == "team-a"] == [0]
    assert t.physical_bytes == physical and t.num_chunks == 4  # 20 MiB: 8 + 8 + 4; 6 MiB: 6
    view[: 4 * MiB] = 1  # a write through the old view lands in the demoted pages
    data[0][: 4 * MiB] = 1
    t.demote()  # there already: nothing changes
    assert t.tier == "host" and intact(t, data)

    t.promote()
    assert t.tier == "device" and intact(t, data) and t.base_ptr == base
    status = client.status()
    assert status.committed_bytes == physical and status.host_bytes == 0
    t.resize_segments_([24 * MiB, 6 * MiB], zero_new=True)  # grows again on the device
    assert torch.equal(t.segment_view(0)[: 20 * MiB], data[0]) and not t.segment_view(0)[20 * MiB :].any()
    t.free()
    wait_until(lambda: client.status().committed_bytes == 0)


@pytest.mark.parametrize("lease", [False, True])
@pytest.mark.system
def test_a_demoted_buffer_is_refused_growth_and_defragment_until_promoted(tiered, lease):
    client = tiered.connect(lease=lease)
    t, data = written(client)
    t.demote()
    with pytest.raises(Conflict, match="promote it"):
        t.resize_segments_([22 * MiB, 6 * MiB])
    with pytest.raises(Conflict, match="promote it"):
        t.resize_segments_([20 * MiB, 8 * MiB])  # one granule: what a lease would place
    with pytest.raises(Conflict, match="promote it"):
        t.defragment()
    assert t.tier == "host" and intact(t, data) and t.segment_sizes == [20 * MiB, 6 * MiB]
    t.release_physical()  # releasing is allowed: the host pages go
    assert client.status().host_bytes == 0 and t.tier == "device"
    t.recommit()
    assert t.segment_sizes == [20 * MiB, 6 * MiB] and client.status().committed_bytes == t.physical_bytes
    t.free()


def test_without_a_host_tier_a_demote_is_refused_naming_the_flag(start_daemon):
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect(lease=False)
    t, data = written(client)
    with pytest.raises(OutOfBudget, match="--host-budget"):
        t.demote()
    assert t.tier == "device" and intact(t, data)
    status = client.status()
    assert status.committed_bytes == t.physical_bytes and status.host_bytes == 0 and status.host_budget_bytes == 0


@pytest.mark.system
def test_a_demote_past_the_host_budget_is_refused_and_changes_nothing(start_daemon):
    daemon = start_daemon("--budget", "64MiB", "--host-budget", "16MiB", "--host-pool", "0")
    client = daemon.connect(lease=False)
    t, data = written(client)
    with pytest.raises(OutOfBudget, match="host budget"):
        t.demote()
    assert t.tier == "device" and intact(t, data)
    status = client.status()
    assert status.committed_bytes == t.physical_bytes and status.host_bytes == 0
    small, small_data = written(client, sizes=(8 * MiB, 8 * MiB))
    small.demote()  # 16 MiB: exactly the host budget
    assert client.status().host_bytes == 16 * MiB and intact(small, small_data)


@pytest.mark.system
def test_demoting_an_idle_buffer_makes_room_for_another_and_promote_waits_for_room(tiered):
    idle = tiered.connect(client_name="idle", lease=False)
    busy = tiered.connect(client_name="busy", lease=False)
    sleeping, data = written(idle, sizes=(32 * MiB, 16 * MiB))
    growing = ExtensibleTensor(64 * MiB, "cpu", client=busy)
    with pytest.raises(OutOfBudget):
        growing.resize_(32 * MiB)
    sleeping.release_physical(keep=True)  # the sleep that keeps the data
    assert sleeping.tier == "host"
    growing.resize_(32 * MiB)
    with pytest.raises(OutOfBudget):
        sleeping.recommit()  # the device is full: it stays in the host tier, whole
    assert sleeping.tier == "host" and intact(sleeping, data)
    assert idle.status().committed_bytes == 32 * MiB and idle.status().host_bytes == 48 * MiB
    growing.free()
    sleeping.recommit()
    assert sleeping.tier == "device" and intact(sleeping, data)
    assert idle.status().host_bytes == 0


def test_kv_cache_buffers_sleep_keeping_their_blocks(tiered):
    client = tiered.connect(lease=False)
    k = ExtensibleTensor(32 * MiB, "cpu", num_segments=2, client=client)
    v = ExtensibleTensor(32 * MiB, "cpu", num_segments=2, client=client)
    cache = ExtensibleKVCacheBuffers([(k, 1 * MiB), (v, 1 * MiB)], 16)
    cache.commit(10)
    k.full_view()[: 10 * MiB] = 3
    v.full_view()[16 * MiB : 26 * MiB] = 4
    cache.release_physical(keep=True)
    assert cache.num_blocks_committed == 10 and k.tier == v.tier == "host"
    assert client.status().committed_bytes == 0
    cache.recommit()
    assert k.tier == v.tier == "device" and cache.num_blocks_committed == 10
    assert filled(k.full_view()[: 10 * MiB], 3)
    assert filled(v.full_view()[16 * MiB : 26 * MiB], 4)


@pytest.mark.system
def test_a_persistent_buffer_stays_attachable_in_the_host_tier(tiered):
    owner = tiered.connect(lease=False)
    t, data = written(owner, name="kv", persistent=True)
    t.demote()
    t.detach()
    status = owner.status()
    assert status.committed_bytes == 0 and status.host_bytes == 26 * MiB  # an orphan, still in the host tier

    again = ExtensibleTensor.attach("kv", "cpu", client=tiered.connect(lease=False))
    assert again.tier == "host" and intact(again, data)
    again.promote()
    assert again.tier == "device" and intact(again, data)
    again.free()


@pytest.mark.system
def test_a_sealed_buffer_does_not_move_and_says_why(tiered):
    client = tiered.connect(lease=False)
    t, data = written(client, name="weights", persistent=True)
    t.seal()
    reader = ExtensibleTensor.attach("weights", "cpu", client=tiered.connect(lease=False), readonly=True)
    with pytest.raises(InvalidRequest, match="sealed"):
        t.demote()
    with pytest.raises(InvalidRequest, match="readers map its chunks"):
        client.move(t.buffer_id, "host")  # what the daemon answers a client that asks anyway
    assert t.tier == "device" and intact(reader, data)


@pytest.mark.system
def test_the_host_pool_is_made_while_idle_within_the_host_budget(tiered):
    client = tiered.connect(lease=False)
    wait_until(lambda: client.status().host_pool_bytes == 16 * MiB)
    t, data = written(client, sizes=(32 * MiB, 32 * MiB))
    t.demote()  # 64 MiB of the 96: the pool may only refill into the 32 left
    assert intact(t, data)
    wait_until(lambda: client.status().host_pool_bytes == 16 * MiB)
    other, _ = written(tiered.connect(lease=False), sizes=(0, 24 * MiB))
    other.demote()  # 88 MiB of 96: 8 MiB left, the pool gives back what does not fit
    wait_until(lambda: client.status().host_pool_bytes == 8 * MiB)


@pytest.mark.system
def test_moves_leave_no_fd_behind_and_an_unknown_tier_changes_nothing(tiered):
    client = tiered.connect(lease=False)
    t, data = written(client)
    wait_until(lambda: client.status().host_pool_bytes == 16 * MiB)
    fds = tiered.open_fds()
    with pytest.raises(InvalidRequest, match="tier"):
        client.call(Move(t.buffer_id, "nvme"))
    for _ in range(3):
        t.demote()
        t.promote()
    assert intact(t, data) and client.status().host_bytes == 0
    wait_until(lambda: client.status().host_pool_bytes == 16 * MiB)  # used pieces are made anew, never reused
    # Promoted, the buffer has one chunk a run where it had one a commit: fewer descriptors, never more.
    assert tiered.open_fds() <= fds


def test_a_demote_that_fails_midway_maps_the_old_chunks_back_and_the_daemon_keeps_them(tiered, monkeypatch):
    client = tiered.connect(lease=False)
    t, data = written(client)
    view, base, chunks = t.full_view(), t.base_ptr, t.num_chunks
    mapper = type(t._reservation.mapper)
    mapped = []

    def map_twice_then_fail(self, address, chunk, fd, readonly=False):
        if len(mapped) == 2:
            raise OSError(errno.ENOMEM, "no room to map")
        mapped.append(chunk.chunk_id)
        original(self, address, chunk, fd, readonly)

    original = mapper.map
    monkeypatch.setattr(mapper, "map", map_twice_then_fail)
    with pytest.raises(OSError, match="no room to map"):
        t.demote()
    monkeypatch.setattr(mapper, "map", original)
    # Two host pieces were mapped in place before the third failed: the old chunks are back where they were.
    assert mapped and t.tier == "device" and t.num_chunks == chunks and intact(t, data)
    assert view.data_ptr() == base and torch.equal(view[: 20 * MiB], data[0])
    status = client.status()
    assert status.host_bytes == 0 and status.committed_bytes == t.physical_bytes
    view[:MiB] = 7  # still the buffer's own pages: the write is there after a demote that works
    data[0][:MiB] = 7
    t.demote()
    assert t.tier == "host" and intact(t, data)


@pytest.mark.system
def test_hbmctl_shows_bytes_per_tier_per_tenant(tiered):
    client = tiered.connect(tenant="team-a", lease=False)
    t, _ = written(client)
    t.demote()
    status = hbmctl("--run-dir", str(tiered.run_dir), "--json", "status")
    assert status.returncode == 0, status.stderr
    record = json.loads(status.stdout)["instances"][0]
    assert record["host_bytes"] == 26 * MiB and record["host_budget_bytes"] == 96 * MiB
    assert [x["host_bytes"] for x in record["tenants"] if x["name"] == "team-a"] == [26 * MiB]
    table = hbmctl("--run-dir", str(tiered.run_dir), "status")
    assert "host tier" in table.stdout and "26.0 MiB" in table.stdout
    listing = hbmctl("--run-dir", str(tiered.run_dir), "--json", "buffers")
    assert [b["tier"] for b in json.loads(listing.stdout)["buffers"]] == ["host"]


@pytest.mark.system
def test_metrics_show_bytes_per_tier_per_tenant(start_daemon):
    from test_metrics import free_port, scrape

    port = free_port()
    daemon = start_daemon("--budget", "64MiB", *TIER, "--metrics-addr", f"127.0.0.1:{port}")
    _awake, _ = written(daemon.connect(tenant="team-a", lease=False), sizes=(4 * MiB, 4 * MiB))
    asleep, _ = written(daemon.connect(tenant="team-b", lease=False))
    asleep.demote()
    samples = scrape(port)
    tier = {
        (dict(labels)["tenant"], dict(labels)["tier"]): v
        for (name, labels), v in samples.items() if name == "hbmd_tenant_tier_bytes"
    }
    assert tier == {("team-a", "device"): 8 * MiB, ("team-a", "host"): 0, ("team-b", "device"): 0,
                    ("team-b", "host"): 26 * MiB}
    totals = {name: v for (name, _), v in samples.items() if name.startswith("hbmd_host_")}
    assert totals == {"hbmd_host_budget_bytes": 96 * MiB, "hbmd_host_bytes": 26 * MiB,
                      "hbmd_host_pool_bytes": totals["hbmd_host_pool_bytes"]}


@pytest.mark.system
def test_a_restart_keeps_each_buffers_tier(start_daemon, run_dir, systemd):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    flags = ("--budget", "64MiB", *TIER, "--state-dir", str(state_dir))
    daemon = start_daemon(*flags, env={"NOTIFY_SOCKET": str(systemd.path)})
    wait_until(lambda: systemd.saw("READY=1"))
    client = daemon.connect(lease=False)
    t, data = written(client, name="kv", persistent=True)
    device, _ = written(client, name="stays", persistent=True)
    t.demote()
    t.detach()
    device.detach()
    client.close()
    assert daemon.stop() == 0
    again = start_daemon(*flags, **systemd.relaunch())
    assert "2 buffers" in again.log()
    client = again.connect(lease=False)
    status = client.status()
    assert status.host_bytes == 26 * MiB and status.committed_bytes == 26 * MiB
    assert {b.name: b.tier for b in client.buffers()} == {"kv": "host", "stays": "device"}
    kv = ExtensibleTensor.attach("kv", "cpu", client=client)
    assert kv.tier == "host" and intact(kv, data)
    kv.promote()
    assert intact(kv, data) and client.status().host_bytes == 0


MOVER = textwrap.dedent(
    """
    import random, sys
    from hbmd.client import ExtensibleTensor, connect

    client = connect("cpu", client_name="mover", lease=False)
    kv = ExtensibleTensor.attach("kv", "cpu", client=client)
    print("ready", flush=True)
    rng = random.Random(int(sys.argv[1]))
    while True:
        kv.demote() if rng.random() < 0.6 else kv.promote()
    """
)


@pytest.mark.system
def test_workers_killed_mid_demote_and_promote_lose_no_byte_and_leak_nothing(tiered):
    client = tiered.connect(client_name="checker", lease=False)
    t, data = written(client, name="kv", persistent=True)
    physical = t.physical_bytes
    t.detach()
    env = dict(os.environ, HBMD_RUN_DIR=str(tiered.run_dir))
    rng = random.Random(20261203)
    wait_until(lambda: client.status().host_pool_bytes == 16 * MiB)
    fds_before = tiered.open_fds()
    tiers: set[str] = set()
    for round_number in range(KILL_ROUNDS):
        worker = subprocess.Popen([sys.executable, "-c", MOVER, str(round_number)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        try:
            assert worker.stdout.readline().strip() == "ready", worker.stderr.read()[-2000:]
            time.sleep(rng.uniform(0, 0.2))
        finally:
            worker.send_signal(signal.SIGKILL)
            status = worker.wait(10)
            errors = worker.stderr.read()
            worker.stdout.close()
            worker.stderr.close()
        assert status == -signal.SIGKILL, f"round {round_number}: the worker died of its own: {errors[-2000:]}"

        def settled() -> bool:
            s = client.status()
            return s.num_sessions == 1 and s.committed_bytes + s.host_bytes == physical

        wait_until(settled, timeout=10)  # the dead worker's session is gone, and its move's unconfirmed chunks
        kv = ExtensibleTensor.attach("kv", "cpu", client=client)
        tiers.add(kv.tier)
        assert intact(kv, data), f"round {round_number}: bytes lost ({kv.tier} tier)"
        kv.detach()
    assert tiers == {"device", "host"}, f"every round ended in {tiers}"
    client.delete("kv")
    assert client.status().committed_bytes == client.status().host_bytes == 0
    wait_until(lambda: tiered.open_fds() <= fds_before, timeout=10)
    print(f"\ntier kill loop: rounds={KILL_ROUNDS}, {physical >> 20} MiB checked each round, bytes lost=0")


@pytest.mark.system
def test_a_cold_restart_declares_a_demoted_buffer_in_the_host_tier(start_daemon):
    flags = ("--budget", "64MiB", *TIER)
    daemon = start_daemon(*flags)
    client = daemon.connect(client_name="engine", lease=False)
    t, data = written(client)
    t.demote()
    daemon.kill()
    daemon = start_daemon(*flags)
    with daemon.connect(observer=True) as look:
        wait_until(lambda: look.status().host_bytes == 26 * MiB)  # the client declared it where it is
        assert look.status().committed_bytes == 0 and [b.tier for b in look.buffers()] == ["host"]
    assert client.resumed() and intact(t, data)
    t.promote()  # the client copies out of what it maps: nothing needs the old daemon's chunks
    assert t.tier == "device" and intact(t, data)
    with daemon.connect(observer=True) as look:
        assert (look.status().committed_bytes, look.status().host_bytes) == (26 * MiB, 0)


@pytest.mark.parametrize("to_tier", ["host", "device"])
@pytest.mark.system
def test_a_cold_restart_between_a_moves_remap_and_its_finish_declares_the_new_tier(start_daemon, to_tier,
                                                                                             monkeypatch):
    flags = ("--budget", "64MiB", *TIER)
    daemon = start_daemon(*flags)
    client = daemon.connect(client_name="engine", lease=False)
    t, data = written(client)
    if to_tier == "device":
        t.demote()
    finish = ExtensibleTensor._finish_defragment
    restarted = []

    def restart_first(self, keep_new, started_over):
        if not restarted:  # the remap is done, the old daemon never hears of it
            daemon.kill()
            restarted.append(start_daemon(*flags))
        finish(self, keep_new, started_over)

    monkeypatch.setattr(ExtensibleTensor, "_finish_defragment", restart_first)
    t.demote() if to_tier == "host" else t.promote()
    with restarted[0].connect(observer=True) as look:
        on_device, in_host = (0, 26 * MiB) if to_tier == "host" else (26 * MiB, 0)
        wait_until(lambda: (look.status().committed_bytes, look.status().host_bytes) == (on_device, in_host))
        assert [b.tier for b in look.buffers()] == [to_tier]  # where the bytes are, not where they were
    assert t.tier == to_tier and intact(t, data)
    monkeypatch.undo()
    t.promote() if to_tier == "host" else t.demote()
    assert intact(t, data)


@pytest.mark.parametrize("demote, lease", [(True, False), (True, True), (False, False)])
@pytest.mark.system
def test_a_commit_that_does_not_fit_demotes_an_idle_demotable_tenants_buffers_instead(start_daemon, tmp_path, demote,
                                                                                       lease):
    config = tmp_path / "hbmd.toml"
    config.write_text(DEMOTABLE if demote else DEMOTABLE.replace("demote = 1\n", ""))
    # Idle at once: the batch engine's last growth, a moment ago, does not make it busy.
    daemon = start_daemon("--budget", "64MiB", *TIER, "--config", str(config), "--demote-idle", "0")
    batch = daemon.connect(client_name="batch", tenant="batch", lease=False)
    sleeping, data = written(batch, sizes=(32 * MiB, 16 * MiB))
    sleeping.set_idle()
    online = daemon.connect(client_name="online", tenant="online", lease=lease)
    growing = ExtensibleTensor(64 * MiB, "cpu", client=online)
    if lease:
        # The room left is leased to the online engine: its refusal gives the lease back first, and the retry then
        # meets the demote under way, which it waits for as well.
        growing.resize_(2 * MiB)
        wait_until(lambda: online.status().leased_bytes > 0)
    if not demote:
        with pytest.raises(OutOfBudget):
            growing.resize_(32 * MiB)
        assert sleeping.tier == "device"
        return
    growing.resize_(32 * MiB)  # its client demoted the batch buffer by itself; the commit went through
    assert sleeping.tier == "host" and intact(sleeping, data) and sleeping.base_ptr == sleeping.full_view().data_ptr()
    status = online.status()
    assert (status.committed_bytes, status.host_bytes) == (32 * MiB, 48 * MiB)
    leased = status.leased_bytes
    assert {t.name: (t.used_bytes, t.host_bytes) for t in status.tenants if t.name in ("batch", "online")} == {
        "batch": (0, 48 * MiB), "online": (32 * MiB + leased, 0)}
    growing.free()
    wait_until(lambda: sleeping.tier == "device")  # room again: its client promoted it back by itself
    assert intact(sleeping, data) and online.status().host_bytes == 0


@pytest.mark.system
def test_a_buffer_its_engine_writes_is_never_moved_under_it_and_one_declared_idle_comes_back_on_taking_it_back(
        start_daemon, tmp_path):
    """A demotable tenant's engine writes its buffer without growing it (idle, as the daemon counts idleness): its
    client does not move it, so no write is lost and no address goes unmapped under the writer; declared idle, it
    moves for another tenant's commit, and the engine takes it back, promoted, with every byte it wrote."""
    config = tmp_path / "hbmd.toml"
    config.write_text(DEMOTABLE)
    daemon = start_daemon("--budget", "64MiB", *TIER, "--config", str(config), "--demote-idle", "0")
    batch = daemon.connect(client_name="batch", tenant="batch", lease=False)
    busy, _ = written(batch, sizes=(32 * MiB, 16 * MiB))
    stop, rounds = threading.Event(), []

    def write() -> None:
        value = 0
        while not stop.is_set():
            value = value % 250 + 1
            busy.segment_view(0)[:] = value
            busy.segment_view(1)[:] = value
            rounds.append(value)

    writer = threading.Thread(target=write)
    writer.start()
    online = daemon.connect(client_name="online", tenant="online", lease=False)
    growing = ExtensibleTensor(64 * MiB, "cpu", client=online)
    try:
        with pytest.raises(OutOfBudget):
            growing.resize_(32 * MiB)  # asked, the batch client moved nothing its engine was writing
    finally:
        stop.set()
        writer.join()
    last = rounds[-1]
    assert busy.tier == "device" and filled(busy.segment_view(0), last) and filled(busy.segment_view(1), last)
    busy.set_idle()
    growing.resize_(32 * MiB)
    assert busy.tier == "host"
    with pytest.raises(OutOfBudget):
        busy.set_idle(False)  # no room on the device yet: it stays idle, in the host tier, intact
    assert busy.idle and busy.tier == "host" and filled(busy.segment_view(0), last)
    growing.free()
    busy.set_idle(False)
    assert not busy.idle and busy.tier == "device" and filled(busy.segment_view(1), last)


def test_a_demotable_tenant_that_grew_within_the_demote_idle_time_is_busy_and_not_asked(start_daemon, tmp_path):
    config = tmp_path / "hbmd.toml"
    config.write_text(DEMOTABLE)
    daemon = start_daemon("--budget", "64MiB", *TIER, "--config", str(config), "--demote-idle", "3600")
    batch = daemon.connect(client_name="batch", tenant="batch", lease=False)
    busy, data = written(batch, sizes=(32 * MiB, 16 * MiB))
    online = daemon.connect(client_name="online", tenant="online", lease=False)
    growing = ExtensibleTensor(64 * MiB, "cpu", client=online)
    with pytest.raises(OutOfBudget) as refused:
        growing.resize_(32 * MiB)
    assert "demoting" not in refused.value.details
    assert busy.tier == "device" and intact(busy, data) and online.status().host_bytes == 0


@pytest.mark.system
def test_a_buffer_demoted_under_pressure_is_promoted_back_by_a_restarted_daemon(start_daemon, run_dir, tmp_path,
                                                                                 systemd):
    config = tmp_path / "hbmd.toml"
    config.write_text(DEMOTABLE)
    state_dir = run_dir / "state"
    state_dir.mkdir()
    flags = ("--budget", "64MiB", *TIER, "--config", str(config), "--state-dir", str(state_dir), "--demote-idle", "0")
    daemon = start_daemon(*flags, env={"NOTIFY_SOCKET": str(systemd.path)})
    wait_until(lambda: systemd.saw("READY=1"))
    batch = daemon.connect(client_name="batch", tenant="batch", lease=False)
    sleeping, data = written(batch, sizes=(32 * MiB, 16 * MiB))
    sleeping.set_idle()
    online = daemon.connect(client_name="online", tenant="online", lease=False)
    growing = ExtensibleTensor(64 * MiB, "cpu", client=online)
    growing.resize_(32 * MiB)
    assert sleeping.tier == "host"
    daemon.kill()
    daemon = start_daemon(*flags, **systemd.relaunch())
    wait_until(lambda: "session 2 resumed" in daemon.log() and "session 1 resumed" in daemon.log())
    growing.free()  # room again: the new daemon knows whom it had demoted, and tells them
    wait_until(lambda: sleeping.tier == "device")
    assert intact(sleeping, data) and online.status().host_bytes == 0


@pytest.mark.parametrize("flags, words", [
    (("--host-piece", "3MiB"), "--host-piece: 3MiB is not a positive whole number of 2 MiB granules"),
    (("--host-budget", "150%"), "a percentage must be in (0, 100]"),
    (("--host-budget", "lots"), "--host-budget/--host-pool/--host-piece: bad size"),
    (("--host-budget", "1000000TiB"), "--host-budget: "),
])
def test_host_tier_flags_that_make_no_sense_are_refused_as_usage_errors(run_dir, flags, words):
    out = subprocess.run([sys.executable, "-m", "hbmd.daemon", "--backend", "host", "--run-dir", str(run_dir), *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and words in out.stderr, out.stderr


def test_a_demote_answer_the_restarted_daemon_does_not_know_does_not_hold_up_the_promote_behind_it(daemon):
    """The daemon that asked for a demote was replaced before the answer reached it; the promote its successor sends
    next is served all the same (it waited behind the refused answer, unserved, until the next datagram)."""
    with daemon.connect(lease=False) as client:
        demotes = client._core.handles.inbox.demotes
        demotes.extend([ReclaimRequest(999, 0, "asked by a daemon since restarted", demote=True), PromoteRequest(0)])
        client._pressure.serve_demotes()
        assert not demotes


@pytest.mark.system
def test_a_commit_is_refused_at_once_where_the_demotable_tenant_has_nothing_idle(start_daemon, tmp_path):
    """The batch engine declared nothing idle: its client answers the demote with nothing. Its refused commit was
    told room was being demoted, retried, and the daemon asked again, over and over, for the client's 10 s
    (``DEMOTE_WAIT_S``, issue #61); the daemon asks a client that had nothing idle no more for a while, so the
    refusal comes once it has answered."""
    config = tmp_path / "hbmd.toml"
    config.write_text(DEMOTABLE)
    daemon = start_daemon("--budget", "64MiB", *TIER, "--config", str(config), "--demote-idle", "0")
    batch = daemon.connect(client_name="batch", tenant="batch", lease=False)
    busy, data = written(batch, sizes=(32 * MiB, 16 * MiB))
    online = daemon.connect(client_name="online", tenant="online", lease=False)
    growing = ExtensibleTensor(64 * MiB, "cpu", client=online)
    started = time.monotonic()
    with pytest.raises(OutOfBudget):
        growing.resize_(32 * MiB)
    assert time.monotonic() - started < DEMOTE_WAIT_S / 2
    assert busy.tier == "device" and intact(busy, data)
