"""The daemon restarted under load, dozens of times: no engine notices, no byte is lost, nothing leaks.

Four workers grow their KV buffers onto leased granules and through the
daemon, release (sleep) and regrow them, defragment them keeping the data,
and check every committed byte after each step, while the daemon is SIGKILLed
(a crash, ``Restart=on-failure``), SIGTERMed (an upgrade), taken over by a
successor (``--takeover``), SIGHUPed (a reload) and stopped then started
again (``systemctl stop``, which drops the FD store but leaves the journal:
the workers start over and declare what they map, counted again), round
after round, under the systemd stand-in that keeps its chunks. Every
daemon checks its invariants after each batch (``--check-invariants``). Then the same restarted cold: a
plain daemon SIGKILLed and SIGTERMed and started again on nothing, each
worker declaring again what it maps. After each restart a peer sends hellos
the daemon refuses, each naming a tenant of its own: none may be left. At the end the workers report what
they hold, how many calls failed (none may), how many bytes were wrong (none
may) and the slowest calls: the pause a restart costs an engine.
``HBMD_RESTART_ROUNDS`` sets the number of rounds.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import textwrap
import time

import pytest
from hbmd.client import InvalidRequest
from hbmd.client.transport import HandleChannel
from hbmd.proto import PROTOCOL_VERSION, Hello
from hbmd.proto.instance import InstancePaths
from helpers import wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]

ROUNDS = int(os.environ.get("HBMD_RESTART_ROUNDS", "16"))
WORKERS = 4
HOSTILE_HELLOS = 20

WORKER = textwrap.dedent(
    """
    import json, random, select, sys, time
    import torch
    from hbmd.client import ExtensibleTensor, connect

    SEGMENT = 16 << 20
    BLOCK = 2 << 20
    seed = int(sys.argv[1])
    rng = random.Random(seed)
    client = connect("cpu", client_name=f"load-{seed}")
    kv = ExtensibleTensor(2 * SEGMENT, "cpu", num_segments=2, client=client)

    def value(segment, block):
        return (block + 7 * segment + seed) % 251 + 1

    def fill(segment, start, end):
        view = kv.segment_view(segment)
        for block in range(start // BLOCK, end // BLOCK):
            view[block * BLOCK : (block + 1) * BLOCK] = value(segment, block)

    def wrong_bytes():
        wrong = 0
        for segment in range(2):
            view = kv.segment_view(segment)
            for block in range(kv.segment_sizes[segment] // BLOCK):
                wrong += int((view[block * BLOCK : (block + 1) * BLOCK] != value(segment, block)).sum())
        return wrong

    ops = errors = wrong = 0
    pauses, failures = [], []
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:
        size = kv.segment_sizes[0]
        choice = rng.random()
        started = time.monotonic()
        try:
            if choice < 0.7 and size < SEGMENT:
                kv.resize_per_segment_(size + BLOCK)
                for segment in range(2):
                    fill(segment, size, size + BLOCK)
            elif choice < 0.85:
                kv.defragment(preserve=True)
            else:
                kv.release_physical()
                kv.resize_per_segment_(BLOCK)
                for segment in range(2):
                    fill(segment, 0, BLOCK)
        except Exception as exc:
            errors += 1
            failures.append(f"{type(exc).__name__}: {exc}")
        pauses.append(time.monotonic() - started)
        wrong += wrong_bytes()
        ops += 1
        time.sleep(rng.random() * 0.01)
    print(json.dumps({"ops": ops, "errors": errors, "failures": failures[:5], "wrong": wrong, "pauses": pauses,
                      "holds": kv.physical_bytes, "session": client.session_id}), flush=True)
    """
)


def held(daemon, kind: str) -> int:
    """How many of the daemon's descriptors are of ``kind`` (``socket:``, ``/memfd:``)."""
    links = []
    for fd in os.listdir(f"/proc/{daemon.pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{daemon.pid}/fd/{fd}"))
        except FileNotFoundError:
            pass  # closed while we looked
    return sum(link.startswith(kind) for link in links)


def hellos_refused(daemon, round_: int) -> int:
    """Hellos the daemon must refuse (a client name with an escape), each naming a tenant nobody else names."""
    paths = InstancePaths.of(daemon.run_dir, daemon.instance)
    for n in range(HOSTILE_HELLOS):
        channel = HandleChannel(paths, 5)
        with pytest.raises(InvalidRequest):
            hello = Hello(list(PROTOCOL_VERSION), os.getpid(), client_name="\x1b[2J", tenant=f"squat-{round_}-{n}")
            channel.handshake(hello)
        channel.close()
    return HOSTILE_HELLOS


@pytest.mark.parametrize("fd_store", [True, False], ids=["kept", "cold"])
@pytest.mark.system
def test_restarts_under_load_lose_nothing_and_no_engine_notices(start_daemon, spawn_worker, run_dir, systemd, fd_store):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    args = ("--budget", "512MiB", "--state-dir", str(state_dir)) if fd_store else ("--budget", "512MiB")
    kept = {"env": {"NOTIFY_SOCKET": str(systemd.path)}} if fd_store else {}
    daemon = start_daemon(*args, **kept)
    baseline_sockets = held(daemon, "socket:")
    workers = [spawn_worker(daemon, f"import sys; sys.argv[1:] = ['{seed}']\n{WORKER}") for seed in range(WORKERS)]
    for worker in workers:
        assert worker.readline().strip() == "ready"
    rng = random.Random(5)
    kinds = ("kill", "term", "takeover", "hup", "stop") if fd_store else ("kill", "term")
    ways = dict.fromkeys(kinds, 0)
    refused = 0
    for round_ in range(ROUNDS):
        time.sleep(0.2 + rng.random() * 0.3)
        how = kinds[round_ % len(kinds)]
        ways[how] += 1
        if how == "hup":
            os.kill(daemon.pid, signal.SIGHUP)
            continue
        if how == "takeover":
            old = daemon
            daemon = start_daemon(*args, "--takeover", **kept)
            assert old.proc.wait(10) == 0
        else:
            if how == "kill":
                daemon.kill()
            else:
                assert daemon.stop() == 0
            if how == "stop":
                systemd.drop_store()  # systemctl stop, then start: the journal is back, the chunks are not
            daemon = start_daemon(*args, **(systemd.relaunch() if fd_store else {}))
        refused += hellos_refused(daemon, round_)
        with daemon.connect(observer=True) as look:
            # Every worker is back within the window, by its listener or its next call: resumed, or started over.
            wait_until(lambda: len(look.sessions()) == WORKERS and not any(s.resuming for s in look.sessions()),
                       timeout=10)

    for worker in workers:
        worker.send("stop")
    reports = [json.loads(worker.readline()) for worker in workers]
    with daemon.connect(observer=True) as look:
        assert look.status().committed_bytes == sum(r["holds"] for r in reports)
        assert not [t.name for t in look.status().tenants if t.name.startswith("squat-")]  # refusals left nothing
        assert sorted(s.session_id for s in look.sessions()) == sorted(r["session"] for r in reports)
    for worker in workers:
        assert worker.wait() == 0
    with daemon.connect(observer=True) as look:
        wait_until(lambda: look.status().committed_bytes == 0 and look.sessions() == [])
    # No chunk and no session's socket left behind: the last daemon holds what the first held when it started.
    wait_until(lambda: held(daemon, "/memfd:") == 0 and held(daemon, "socket:") == baseline_sockets)
    wait_until(lambda: systemd.names() == set())  # and nothing parked

    pauses = sorted(p for r in reports for p in r["pauses"])
    ops = sum(r["ops"] for r in reports)
    print(
        f"\nrestarts={ROUNDS} ({', '.join(f'{k} {v}' for k, v in ways.items())}), hellos refused={refused}, "
        f"operations={ops}, "
        f"errors={sum(r['errors'] for r in reports)}, bytes wrong={sum(r['wrong'] for r in reports)}, "
        f"calls p50={statistics.median(pauses) * 1e3:.1f} ms p99={pauses[int(len(pauses) * 0.99)] * 1e3:.1f} ms "
        f"max={pauses[-1] * 1e3:.0f} ms (the slowest: a restart's pause)"
    )
    assert sum(r["errors"] for r in reports) == 0, [r["failures"] for r in reports]
    assert sum(r["wrong"] for r in reports) == 0
    assert ops > ROUNDS * WORKERS
