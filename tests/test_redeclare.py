"""A cold restart: the clients declare again what they still map, and the new daemon counts it.

No systemd FD store and no ``--takeover``: a plain daemon is killed or
stopped and started again on the same run directory. It knows nothing of the
old one, but the memory lives on in the clients' mappings; each client starts
its session over and declares every buffer its tensors map, so that the new
daemon's budget counts memory still in use. Every daemon here runs with
``--check-invariants``.
"""

from __future__ import annotations

import functools
import os
import threading

import pytest
from hbmd.client import ExtensibleTensor, connect
from hbmd.client import recovery as recovery_module
from hbmd.daemon.rundir import RESUME_KEY
from hbmd.daemon.state.credentials import LINE_HEX, Credentials
from hbmd.proto import ChunkInfo, Hello, Redeclare
from hbmd.proto.errors import (
    Conflict,
    InvalidRequest,
    OutOfBudget,
    PermissionDenied,
    SessionLost,
    TensorUnusable,
)
from helpers import GpuKvCache, HostEngine, MiB, cuda_vmm_status, filled, hbmctl, torch, wait_until

GPU_OK, GPU_REASON = cuda_vmm_status()

pytestmark = [pytest.mark.ipc, pytest.mark.torch]


def restart(start_daemon, daemon, how: str, *args: str):
    if how == "kill":
        daemon.kill()
    else:
        assert daemon.stop() == 0
    return start_daemon(*args)


def committed(daemon) -> int:
    with daemon.connect(observer=True) as look:
        return look.status().committed_bytes


@pytest.mark.parametrize("how", ["kill", "term"])
@pytest.mark.parametrize("lease", [False, True])
@pytest.mark.system
def test_after_a_cold_restart_the_new_daemon_counts_what_the_clients_map(start_daemon, how, lease):
    daemon = start_daemon("--budget", "256MiB")
    client = daemon.connect(client_name="engine", lease=lease)
    engine = HostEngine(client)
    kv, weights = engine.kv, engine.weights
    base, ids = kv.base_ptr, (kv.buffer_id, weights.buffer_id)

    daemon = restart(start_daemon, daemon, how, "--budget", "256MiB")
    # It knew nothing of them; the listener declared them before any call of the engine, under the ids they had.
    wait_until(lambda: committed(daemon) == 22 * MiB)
    assert client.resumed() and (kv.buffer_id, weights.buffer_id) == ids
    with daemon.connect(observer=True) as look:
        held = {b.name: (b.held_elsewhere, b.physical_bytes, b.segment_sizes) for b in look.buffers()}
    assert held == {"": (True, 16 * MiB, [8 * MiB, 8 * MiB]), "weights": (True, 6 * MiB, [6 * MiB])}
    listing = hbmctl("--run-dir", str(daemon.run_dir), "-o", "wide", "buffers").stdout.splitlines()
    assert "KEPT-BY" in listing[0].split() and all(row.split()[-1] == "mappers" for row in listing[1:])

    engine.grows_on()  # the tensor goes on, at the same address
    assert kv.base_ptr == base
    assert committed(daemon) == 24 * MiB + 6 * MiB
    kv.defragment()  # the client copies out of what it maps: nothing needs the old daemon's chunks
    assert engine.intact()
    kv.release_physical()
    kv.resize_per_segment_(2 * MiB)
    engine.free()
    assert committed(daemon) == 0
    client.close()


@pytest.mark.system
def test_the_call_in_flight_goes_to_the_new_session_under_the_new_buffer_id(start_daemon):
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect(lease=False)
    kv = ExtensibleTensor(16 * MiB, "cpu", client=client)
    kv.resize_(4 * MiB)
    kv.full_view()[: 4 * MiB] = 6
    with client.exclusive:  # the listener cannot start over first: the call finds its session gone
        daemon.kill()
        daemon = start_daemon("--budget", "64MiB")
        other = ExtensibleTensor(2 * MiB, "cpu", client=daemon.connect())  # takes the id the buffer had
        assert other.buffer_id == kv.buffer_id
        kv.resize_(8 * MiB)
    assert kv.buffer_id != other.buffer_id
    assert filled(kv.full_view()[: 4 * MiB], 6)
    assert committed(daemon) == 8 * MiB


@pytest.mark.system
def test_a_sealed_buffer_its_readers_map_is_counted_once_and_goes_with_the_last_of_them(start_daemon):
    daemon = start_daemon("--budget", "64MiB")
    with daemon.connect() as loader:
        weights = ExtensibleTensor(8 * MiB, "cpu", client=loader, name="weights", persistent=True)
        weights.resize_(6 * MiB)
        weights.full_view()[: 6 * MiB] = 4
        weights.seal()
        weights.detach()  # the loader is done: the weights are an orphan its readers keep using
    first, second = daemon.connect(), daemon.connect()
    readers = [ExtensibleTensor.attach("weights", "cpu", client=c, readonly=True) for c in (first, second)]

    daemon = restart(start_daemon, daemon, "kill", "--budget", "64MiB")
    wait_until(lambda: committed(daemon) == 6 * MiB)
    with daemon.connect(observer=True) as look:
        wait_until(lambda: [(b.name, b.readers) for b in look.buffers()] == [("weights", 2)])
    assert all(filled(r.full_view()[: 6 * MiB], 4) for r in readers)
    with daemon.connect() as another, pytest.raises(Conflict, match="cannot hand it to another process"):
        ExtensibleTensor.attach("weights", "cpu", client=another, readonly=True)
    readers[0].free()
    assert committed(daemon) == 6 * MiB
    readers[1].free()  # nobody maps it any more: its memory is gone, and so is the buffer
    assert committed(daemon) == 0
    with daemon.connect(observer=True) as look:
        assert look.buffers() == []


def test_a_buffer_the_new_daemon_will_not_count_makes_its_tensor_unusable_and_the_rest_goes_on(start_daemon):
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect(lease=False)
    big = ExtensibleTensor(32 * MiB, "cpu", client=client)
    big.resize_(24 * MiB)
    small = ExtensibleTensor(8 * MiB, "cpu", client=client)
    small.resize_(4 * MiB)
    daemon = restart(start_daemon, daemon, "term", "--budget", "16MiB")  # restarted with a smaller budget
    wait_until(lambda: committed(daemon) == 4 * MiB)  # the small one only: the big one is past the budget
    assert client.resumed()  # waits for the listener to finish starting over
    with pytest.raises(TensorUnusable, match="refused to count it again"):
        big.resize_(28 * MiB)
    small.resize_(6 * MiB)
    big.free()  # nothing to free at the daemon: only the mapping goes
    assert committed(daemon) == 6 * MiB


def test_a_client_that_maps_nothing_through_tensors_gets_session_lost_at_once(start_daemon, monkeypatch):
    monkeypatch.setenv("HBMD_RESUME_TIMEOUT", "5")
    first = start_daemon("--budget", "64MiB")
    client = first.connect()
    client.status()
    assert first.stop() == 0
    start_daemon("--budget", "64MiB")
    with pytest.raises(SessionLost, match="came back without this session"):
        client.status()


def declaration(**fields) -> Redeclare:
    base = {"capacity": 8 * MiB, "segment_capacities": [8 * MiB], "segment_sizes": [4 * MiB],
            "chunks": [ChunkInfo(0, 0, 2 * MiB), ChunkInfo(0, 2 * MiB, 2 * MiB)]}
    return Redeclare(**{**base, **fields})


def earlier_credential(daemon, session_id: int = 999) -> str:
    """The credential an earlier run of ``daemon`` gave this process's session ``session_id``: made here under the
    instance's key, as that run made it."""
    return Credentials((daemon.run_dir / daemon.instance / RESUME_KEY).read_bytes()).issue(os.getuid(), session_id,
                                                                                        os.getpid())


def name_proof(daemon, name: str, credential: str, session_id: int = 999) -> str:
    """The proof that session ``session_id`` of the earlier run that issued ``credential`` held ``name``, as that run
    gave it to its client."""
    earlier = Credentials((daemon.run_dir / daemon.instance / RESUME_KEY).read_bytes())
    earlier.line = credential[:LINE_HEX]
    return earlier.name_proof(os.getuid(), session_id, os.getpid(), name)


def started_over(daemon, credential: str = "", **kwargs):
    """A session this process opens in place of session 999, which an earlier run of the daemon gave it, with that
    session's credential: it may declare what the process maps, before anything else."""
    hello = functools.partial(Hello, resume_session=999, start_over=True,
                              resume_credential=credential or earlier_credential(daemon))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("hbmd.client.session.Hello", hello)
        client = daemon.connect(lease=False, **kwargs)
    assert client.welcome.started_over
    return client


@pytest.mark.parametrize("fields, refusal", [
    ({"chunks": [ChunkInfo(0, 0, 2 * MiB)]}, InvalidRequest),  # short of the committed bytes
    ({"chunks": [ChunkInfo(0, 0, 4 * MiB), ChunkInfo(0, 2 * MiB, 2 * MiB)]}, InvalidRequest),  # overlapping
    ({"chunks": [ChunkInfo(0, 4096, 4 * MiB)]}, InvalidRequest),  # off the granules
    ({"chunks": [ChunkInfo(0, 0, 4 * MiB), ChunkInfo(0, 4 * MiB, 2 * MiB)]}, InvalidRequest),  # beyond the sizes
    ({"segment_sizes": [16 * MiB], "chunks": [ChunkInfo(0, 0, 16 * MiB)]}, InvalidRequest),  # beyond capacity
    ({"segment_sizes": [4 * MiB, 0]}, InvalidRequest),  # sizes for segments it does not have
    ({"capacity": 0, "segment_capacities": [], "segment_sizes": [], "chunks": []}, InvalidRequest),
    ({"readonly": True, "name": "w", "persistent": True}, InvalidRequest),  # a read claim on an unsealed buffer
    ({"sealed": True}, InvalidRequest),  # an anonymous buffer is never sealed
    ({"name": "x\x1b[2J"}, InvalidRequest),
    ({"capacity": 64 * MiB, "segment_capacities": [64 * MiB], "segment_sizes": [48 * MiB],
      "chunks": [ChunkInfo(0, 0, 48 * MiB)]}, OutOfBudget),  # more than the budget holds
    ({"name": "taken", "persistent": True}, Conflict),  # a name the daemon holds memory for itself
])
def test_a_declaration_is_checked_as_a_commit_would_be_and_a_refusal_changes_nothing(start_daemon, fields, refusal):
    daemon = start_daemon("--budget", "32MiB")
    with daemon.connect() as owner:
        kept = ExtensibleTensor(4 * MiB, "cpu", client=owner, name="taken", persistent=True)
        kept.resize_(2 * MiB)
        kept.detach()
    credential = earlier_credential(daemon)
    if fields.get("persistent") and not fields.get("readonly"):
        fields = {**fields, "name_proof": name_proof(daemon, fields["name"], credential)}
    with started_over(daemon, credential) as client:
        with pytest.raises(refusal):
            client.call(declaration(**fields))
        # What it could have committed, it may declare: counted, and held only by its own mappings.
        declared = client.call(declaration()).buffer
        assert (declared.held_elsewhere, declared.physical_bytes) == (True, 4 * MiB)
        assert sorted((b.name, b.physical_bytes) for b in client.buffers()) == [("", 4 * MiB), ("taken", 2 * MiB)]
        assert client.status().committed_bytes == 6 * MiB  # the refused declaration changed nothing
        with pytest.raises(Conflict, match="another process"):
            client.remap(declared.buffer_id)


def test_only_a_session_started_over_declares_and_only_before_anything_else(start_daemon):
    daemon = start_daemon("--budget", "64MiB")
    with daemon.connect(lease=False) as client:
        with pytest.raises(PermissionDenied, match="declared again only by a session whose process found its own gone"):
            client.call(declaration())
        assert client.status().committed_bytes == 0
    with started_over(daemon) as client:
        client.call(declaration())
        client.call(declaration(buffer_id=7))  # as many buffers as it maps, one declaration each
        client.status()  # its first other request: declaring is over
        with pytest.raises(PermissionDenied, match="before any other request"):
            client.call(declaration())
        assert client.status().committed_bytes == 8 * MiB
    with daemon.connect(lease=False) as client:  # a mark is good for one session only
        with pytest.raises(PermissionDenied):
            client.call(declaration())


def test_a_start_over_refused_for_want_of_room_spends_nothing_and_a_credential_starts_one_session_only(
        start_daemon):
    daemon = start_daemon("--budget", "64MiB", "--max-sessions-per-uid", "1")
    credential = earlier_credential(daemon)
    with daemon.connect(lease=False), pytest.raises(Conflict, match="sessions, the most allowed"):
        started_over(daemon, credential)
    with started_over(daemon, credential) as client:  # the room it waited for
        client.call(declaration())
    with pytest.raises(SessionLost):
        started_over(daemon, credential)


def test_a_declaration_does_not_pass_another_tenants_guarantee(start_daemon, tmp_path):
    config = tmp_path / "tenants.toml"
    config.write_text('[[tenants]]\nname = "a"\nguaranteed = "128MiB"\n\n[[tenants]]\nname = "b"\n')
    daemon = start_daemon("--budget", "256MiB", "--config", str(config))
    with daemon.connect(tenant="b", lease=False) as b:
        with pytest.raises(OutOfBudget, match="held for other tenants' guaranteed minimums"):
            ExtensibleTensor(200 * MiB, "cpu", client=b).resize_(200 * MiB)
    whole = {"capacity": 256 * MiB, "segment_capacities": [256 * MiB], "segment_sizes": [256 * MiB],
             "chunks": [ChunkInfo(0, 0, 256 * MiB)]}
    with started_over(daemon, tenant="b") as b:
        with pytest.raises(OutOfBudget, match="held for other tenants' guaranteed minimums"):
            b.call(declaration(**whole))  # no more than its commit could have had
        assert b.call(declaration(**{**whole, "segment_sizes": [128 * MiB],
                                      "chunks": [ChunkInfo(0, 0, 128 * MiB)]})).buffer.physical_bytes == 128 * MiB
        with daemon.connect(tenant="a", lease=False) as a:
            guaranteed = ExtensibleTensor(128 * MiB, "cpu", client=a)
            guaranteed.resize_(128 * MiB)  # what was guaranteed to a is still there for it
            guaranteed.free()


def test_a_persistent_name_is_declared_again_only_with_the_proof_its_session_held_it(start_daemon):
    """A process that held a session of the uid starts over on its own credential: it may declare what it maps,
    but another process's persistent names only with the proof that its session held them (issue #61: it took
    another engine's names first, and that engine's declarations were refused)."""
    daemon = start_daemon("--budget", "64MiB")
    credential = earlier_credential(daemon)
    own, theirs = name_proof(daemon, "mine", credential), name_proof(daemon, "theirs", credential, session_id=998)
    with started_over(daemon, credential) as client:
        for proof in ("", theirs, own, own[:-1] + ("0" if own[-1] != "0" else "1")):
            with pytest.raises(PermissionDenied, match="held it"):
                client.call(declaration(name="theirs", persistent=True, name_proof=proof))
        declared = client.call(declaration(name="mine", persistent=True, name_proof=own)).buffer
        assert declared.name == "mine" and declared.name_proof and declared.name_proof != own
        assert [b.name for b in client.buffers()] == ["mine"]
        assert client.buffers()[0].name_proof == ""  # a listing shows it to no one


def test_a_refused_declaration_drops_the_pages_it_would_have_kept_uncounted(start_daemon):
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect(lease=False)
    big = ExtensibleTensor(32 * MiB, "cpu", client=client)
    big.resize_(24 * MiB)
    mapped_before = mapped_bytes()
    daemon = restart(start_daemon, daemon, "term", "--budget", "16MiB")
    wait_until(lambda: client.resumed())
    with pytest.raises(TensorUnusable, match="its pages are gone"):
        big.resize_(28 * MiB)
    # This process maps 24 MiB less of the daemon's memory: nothing the new daemon refused stays behind, uncounted.
    assert mapped_before - mapped_bytes() == 24 * MiB
    big.free()
    client.close()


def test_a_persistent_buffer_only_its_process_holds_is_not_lost_to_a_detach(start_daemon):
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect(lease=False)
    kv = ExtensibleTensor(8 * MiB, "cpu", client=client, name="kv", persistent=True)
    kv.resize_(4 * MiB)
    kv.full_view()[: 4 * MiB] = 3
    daemon = restart(start_daemon, daemon, "kill", "--budget", "64MiB")
    wait_until(lambda: committed(daemon) == 4 * MiB)
    with pytest.raises(Conflict, match="only this process holds it, so a detach would lose it"):
        kv.detach()
    assert filled(kv.full_view()[: 4 * MiB], 3)  # still mapped, still counted, still its own
    assert committed(daemon) == 4 * MiB
    kv.resize_(6 * MiB)
    kv.free()
    assert committed(daemon) == 0
    client.close()


def test_a_stop_says_lost_only_of_what_no_process_maps_and_what_becomes_of_the_rest(start_daemon):
    """The stopping daemon's WARNING named every persistent buffer "destroyed", the one a live session maps too, which
    its session declares again to the next daemon with its data."""
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect(lease=False)
    held = ExtensibleTensor(8 * MiB, "cpu", client=client, name="held", persistent=True)
    held.resize_(4 * MiB)
    held.full_view()[: 4 * MiB] = 3
    left = ExtensibleTensor(8 * MiB, "cpu", client=client, name="left", persistent=True)
    left.resize_(2 * MiB)
    left.detach()  # an orphan: no process maps it
    assert daemon.stop() == 0
    (said,) = [line for line in daemon.log().splitlines() if " WARNING " in line]
    assert "destroyed" not in said
    assert "1 persistent buffers no process maps are lost (2.0 MiB, 0 sealed): 'left'" in said
    assert ("1 that live processes map stay mapped there (4.0 MiB), declared again to the next daemon, but persistent "
            "no more: no other process can attach them, and they go with the last process that maps them: "
            "'held'") in said
    daemon = start_daemon("--budget", "64MiB")
    wait_until(lambda: committed(daemon) == 4 * MiB)
    assert filled(held.full_view()[: 4 * MiB], 3)
    held.free()
    client.close()


@pytest.mark.parametrize("call", ["defragment", "resize_"])
@pytest.mark.system
def test_the_call_in_flight_on_a_buffer_refused_again_raises_tensor_unusable_not_not_found(start_daemon, call):
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect(lease=False)
    big = ExtensibleTensor(32 * MiB, "cpu", client=client)
    big.resize_(24 * MiB)
    with client.exclusive:  # the listener cannot start over first: the call finds its session gone
        daemon.kill()
        daemon = start_daemon("--budget", "16MiB")  # it will not count 24 MiB again
        with pytest.raises(TensorUnusable, match="refused to count it again"):
            getattr(big, call)(*([28 * MiB] if call == "resize_" else []))
    big.free()
    assert committed(daemon) == 0
    client.close()


def mapped_bytes() -> int:
    """Bytes of memfd-backed memory this process maps (the host backend's chunks)."""
    total = 0
    with open(f"/proc/{os.getpid()}/smaps") as smaps:
        mapping = ""
        for line in smaps:
            fields = line.split()
            if fields and "-" in fields[0] and ":" not in fields[0]:
                mapping = line
            elif fields and fields[0] == "Size:" and "memfd:" in mapping:
                total += int(fields[1]) * 1024
    return total


@pytest.mark.system
def test_what_was_declared_again_is_handed_over_to_a_successor_and_goes_on_there(start_daemon):
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect(lease=False)
    kv = ExtensibleTensor(16 * MiB, "cpu", num_segments=2, client=client)
    kv.resize_per_segment_(2 * MiB)
    kv.full_view()[: 2 * MiB] = 8
    daemon = restart(start_daemon, daemon, "kill", "--budget", "64MiB")
    wait_until(lambda: committed(daemon) == 4 * MiB)

    successor = start_daemon("--budget", "64MiB", "--takeover")
    assert daemon.proc.wait(10) == 0
    wait_until(lambda: "resumed" in successor.log())  # the session resumes: nothing to declare again
    with successor.connect(observer=True) as look:
        assert [(b.held_elsewhere, b.physical_bytes) for b in look.buffers()] == [(True, 4 * MiB)]
    kv.resize_per_segment_(4 * MiB)
    assert filled(kv.full_view()[: 2 * MiB], 8)
    assert committed(successor) == 8 * MiB
    kv.free()
    assert committed(successor) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_OK, reason=GPU_REASON)
def test_a_gpu_kv_cache_goes_on_after_a_cold_restart_and_its_memory_is_freed_at_the_end(
    start_daemon, run_dir
):
    args = ("--device", "0", "--budget", "8GiB")
    daemon = start_daemon(*args, backend="cuda")
    torch.cuda.init()
    client = connect("cuda:0", run_dir=run_dir, client_name="gpu-engine")
    cache = GpuKvCache(client)
    held = committed(daemon)

    daemon.kill()
    daemon = start_daemon(*args, backend="cuda")
    assert cache.intact()  # the device memory never left this process
    wait_until(lambda: committed(daemon) == held)
    cache.grows_on()
    free_before = torch.cuda.mem_get_info()[0]
    cache.free()
    assert committed(daemon) == 0
    # The declared chunks went with this process's mappings, the new ones with the daemon: none is left behind.
    wait_until(lambda: torch.cuda.mem_get_info()[0] >= free_before + 500 * MiB)
    client.close()


@pytest.mark.system
def test_a_call_that_waits_for_the_daemon_says_so_once_and_again_when_it_goes_on(start_daemon, caplog, monkeypatch):
    daemon = start_daemon("--budget", "64MiB")
    client = daemon.connect(lease=False)
    polls = []
    opened = recovery_module.HandleChannel
    monkeypatch.setattr(recovery_module, "HandleChannel", lambda *args: polls.append(args) or opened(*args))
    kv = ExtensibleTensor(8 * MiB, "cpu", client=client)
    kv.resize_(2 * MiB)
    caplog.clear()
    assert daemon.stop() == 0
    waiter = threading.Thread(target=lambda: kv.resize_(4 * MiB))  # waits, as does the listener: one says so
    waiter.start()
    wait_until(lambda: len(polls) >= 20)  # several polls of the socket that is not there
    daemon = start_daemon("--budget", "64MiB")
    waiter.join(30)
    assert not waiter.is_alive() and kv.num_bytes == 4 * MiB
    messages = [r.getMessage() for r in caplog.records if r.name == "hbmd.client"]
    assert len([m for m in messages if "waits up to 30s for it to come back (HBMD_RESUME_TIMEOUT)" in m]) == 1, messages
    assert any("started over" in m for m in messages), messages
    kv.free()
    client.close()
