"""An orphan's grace period: a persistent buffer nobody attaches or grafts within it is freed, said at WARNING.

Grace periods here are a second or two: the state machine's tests
(``test_orphans.py``) run the same rules on a clock of their own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time

import pytest
from hbmd.client import ExtensibleTensor, VersionMismatch
from hbmd.proto.errors import InvalidRequest
from helpers import MiB, filled, hbmctl, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch]


def left(client, name: str = "kv", keep_s: float = 1.0) -> ExtensibleTensor:
    """A persistent buffer with 8 MiB written and a grace period of ``keep_s``, detached: an orphan now."""
    kv = ExtensibleTensor(32 * MiB, "cpu", num_segments=2, client=client, name=name, persistent=True,
                          keep_orphan_s=keep_s)
    kv.resize_per_segment_(4 * MiB)
    kv.full_view()[: 4 * MiB] = 3
    kv.detach()
    return kv


def listed(daemon) -> list[dict]:
    return json.loads(hbmctl("--run-dir", str(daemon.run_dir), "buffers", "--json").stdout)["buffers"]


@pytest.mark.system
def test_an_orphan_nobody_takes_is_freed_at_its_deadline_and_said_so(daemon):
    client = daemon.connect(client_name="engine-a")
    left(client, keep_s=2.5)
    (shown,) = listed(daemon)
    assert (shown["session_id"], shown["last_holder"], shown["last_holder_pid"]) == (None, "engine-a", os.getpid())
    assert shown["keep_orphan_s"] == 2.5 and shown["expires_at"] == pytest.approx(shown["orphaned_at"] + 2.5)
    table = hbmctl("--run-dir", str(daemon.run_dir), "buffers").stdout.splitlines()
    assert table[0].split()[4:6] == ["LAST-HOLDER", "EXPIRES"]
    assert f"engine-a (pid {os.getpid()})" in table[1] and re.search(r" in [0-2]s ", table[1])
    assert client.status().committed_bytes == 8 * MiB

    wait_until(lambda: client.buffers() == [], timeout=5)
    assert client.status().committed_bytes == 0
    assert time.time() >= shown["expires_at"]
    assert (f"WARNING hbmd.state: orphan 'kv' of uid {os.getuid()} freed (8.0 MiB): an orphan since "
            in daemon.log())
    assert (f"last held by engine-a (pid {os.getpid()}), nobody attached or grafted it within its 2.5s grace period"
            in daemon.log())


@pytest.mark.system
def test_an_attach_before_the_deadline_keeps_the_orphan_and_a_detach_starts_it_over(daemon):
    client = daemon.connect(client_name="engine-a")
    left(client, keep_s=1.0)
    kv = ExtensibleTensor.attach("kv", "cpu", client=daemon.connect(client_name="engine-b"))
    (held,) = listed(daemon)
    assert (held["expires_at"], held["orphaned_at"]) == (None, None)
    time.sleep(1.5)  # past the 1 s grace period it had as an orphan: the thing under test is that nothing frees it
    assert filled(kv.full_view()[: 4 * MiB], 3) and "orphan 'kv' of uid" not in daemon.log()
    kv.detach()
    (again,) = listed(daemon)
    assert again["last_holder"] == "engine-b" and again["expires_at"] > time.time()
    wait_until(lambda: client.buffers() == [], timeout=5)


def test_an_anonymous_buffer_or_a_negative_grace_period_is_refused(client):
    with pytest.raises(InvalidRequest, match="keep_orphan_s is for a persistent buffer"):
        ExtensibleTensor(8 * MiB, "cpu", client=client, keep_orphan_s=5)
    with pytest.raises(InvalidRequest, match=r"keep_orphan_s -1.0 is out of range"):
        ExtensibleTensor(8 * MiB, "cpu", client=client, name="kv", persistent=True, keep_orphan_s=-1)
    assert client.buffers() == []


def test_a_daemon_older_than_1_11_is_asked_for_neither_a_graft_nor_a_grace_period(client):
    own = ExtensibleTensor(8 * MiB, "cpu", client=client, name="own", persistent=True)
    client.welcome = dataclasses.replace(client.welcome, version=[1, 10])
    with pytest.raises(VersionMismatch, match=r"grafts need an hbmd daemon of protocol 1\.11 or later"):
        own.graft("kv")
    with pytest.raises(VersionMismatch, match=r"grace periods need an hbmd daemon of protocol 1\.11"):
        ExtensibleTensor(8 * MiB, "cpu", client=client, name="kv", persistent=True, keep_orphan_s=5)


@pytest.mark.system
def test_a_restart_keeps_the_deadline(start_daemon, run_dir, systemd):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    args = ("--budget", "128MiB", "--state-dir", str(state_dir))
    first = start_daemon(*args, env={"NOTIFY_SOCKET": str(systemd.path)})
    client = first.connect(client_name="engine-a")
    left(client, keep_s=3.0)
    (before,) = listed(first)
    client.close()
    assert first.stop() == 0

    second = start_daemon(*args, **systemd.relaunch())
    (after,) = listed(second)
    assert (after["expires_at"], after["orphaned_at"], after["last_holder"], after["last_holder_pid"]) == (
        before["expires_at"], before["orphaned_at"], "engine-a", before["last_holder_pid"])
    with second.connect() as look:
        wait_until(lambda: look.buffers() == [], timeout=6)
        assert time.time() >= before["expires_at"]
        assert look.status().committed_bytes == 0
    assert "orphan 'kv' of uid" in second.log() and "within its 3s grace period" in second.log()
    wait_until(lambda: systemd.names() == set())  # its chunks unparked: nothing keeps their memory
