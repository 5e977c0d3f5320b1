"""A session the daemon ended does not start over into memory it no longer owns, and a graft hands over no page a
live process may still write (issue #61).

The daemon restarts keeping its state (the systemd stand-in's FD store and
the journal); an engine stopped past ``--resume-timeout`` has its session
ended: its anonymous buffer freed, its kept buffer an orphan. Before, the
engine, once running again, started its session over on its credential
and declared both: 16 MiB of zeros in a tensor reported usable, and the
kept buffer under the name a successor's graft had freed, so that two live
sessions wrote the same pages.
"""

from __future__ import annotations

import os
import signal

import pytest
from hbmd.client import ExtensibleTensor
from hbmd.proto.errors import Conflict
from helpers import MiB, filled, wait_until

pytestmark = [pytest.mark.ipc, pytest.mark.torch, pytest.mark.system]

ENGINE = """
from hbmd.client import ExtensibleTensor, TensorUnusable, connect

client = connect("cpu", lease=False)
kv = ExtensibleTensor(16 << 20, "cpu", client=client)
kv.resize_(16 << 20)
kv.full_view()[:] = 5
keep = ExtensibleTensor(8 << 20, "cpu", client=client, name="keep", persistent=True)
keep.resize_(8 << 20)
keep.full_view()[:] = 6
print("ready", flush=True)
input()  # its session ended meanwhile
client.status()
for tensor in (kv, keep):
    try:
        tensor.full_view()
        print("usable", flush=True)
    except TensorUnusable:
        print("unusable", flush=True)
print(len(client.buffers(client.session_id)), flush=True)  # its new session declared none
input()
"""


def ended_while_stopped(restartable, spawn_worker):
    """An engine whose session its daemon ended, after a restart that kept the state, while the engine was stopped;
    the engine (stopped still) and the daemon."""
    engine = spawn_worker(restartable.daemon, ENGINE)
    assert engine.readline() == "ready"
    os.kill(engine.proc.pid, signal.SIGSTOP)
    daemon = restartable.restart("kill", "--resume-timeout", "1")
    wait_until(lambda: "was not resumed after the restart: ended" in daemon.log())
    with daemon.connect(observer=True) as look:
        assert [(b.name, b.session_id, b.physical_bytes) for b in look.buffers()] == [("keep", 0, 8 * MiB)]
    return engine, daemon


def test_a_session_its_daemon_ended_does_not_start_over(restartable, spawn_worker):
    engine, daemon = ended_while_stopped(restartable, spawn_worker)
    os.kill(engine.proc.pid, signal.SIGCONT)
    engine.send("")
    # Its pages are dropped: the anonymous buffer's were freed, the kept one's are the orphan's, not its own.
    assert [engine.readline(), engine.readline(), engine.readline()] == ["unusable", "unusable", "0"]
    with daemon.connect(observer=True) as look:
        assert [(b.name, b.session_id, b.held_elsewhere) for b in look.buffers()] == [("keep", 0, False)]
        assert look.status().committed_bytes == 8 * MiB


def test_a_graft_waits_for_the_process_that_may_still_write_the_orphan(restartable, spawn_worker):
    """The orphan's last holder, stopped, still maps it: a successor's graft is refused (retryably) until that
    process is gone, then takes the orphan, data and all."""
    engine, daemon = ended_while_stopped(restartable, spawn_worker)
    with daemon.connect() as successor:
        kv = ExtensibleTensor(8 * MiB, "cpu", client=successor)
        with pytest.raises(Conflict, match=f"pid {engine.proc.pid}"):
            kv.graft("keep")
        engine.kill()
        kv.graft("keep")
        assert kv.num_bytes == 8 * MiB and filled(kv.full_view(), 6)


FORKER = """
import ctypes, os, signal
from hbmd.client import ExtensibleTensor, connect

client = connect("cpu", lease=False)
keep = ExtensibleTensor(8 << 20, "cpu", client=client, name="keep", persistent=True)
keep.resize_(8 << 20)
keep.full_view()[:] = 6
child = os.fork()
if child == 0:
    ctypes.memset(keep.base_ptr, 9, 4096)  # a helper writing on after its engine is gone
    os._exit(0)
_, status = os.waitpid(child, 0)
print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, keep.full_view()[:4096].eq(6).all().item(),
      flush=True)
"""


def test_a_child_the_engine_forks_does_not_inherit_its_mappings(daemon, spawn_worker):
    """The daemon watches the process of a session, not its children: a forked helper that wrote on into a kept
    buffer after its engine exited wrote into pages a successor had grafted. The mappings are not inherited: the
    child's write faults, and the engine's bytes are as it wrote them."""
    assert spawn_worker(daemon, FORKER).readline() == "True True"
