"""A vLLM engine core ends when its front end ends (``integrations/vllm_front_end.py``), and its hbmd session with it:
what a restarted engine or a warm standby waits for. No vLLM needed: the front end here starts its engine core as
vLLM's does, a multiprocessing child named ``EngineCore``."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from hbmd.testing.spawn import LineProcess, ended
from helpers import wait_until

pytestmark = pytest.mark.ipc

FRONT_END = """
import multiprocessing
import os
import sys
import time

from hbmd.integrations.vllm_front_end import end_with_front_end


def engine_core():
    watching = end_with_front_end() is not None
    from hbmd.client import connect

    client = connect("cpu", client_name="engine-core")
    client.create_buffer(4 << 20, 1, name="kept", persistent=True)
    print(os.getpid(), client.session_id, watching, flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    method, name = sys.argv[1:]
    multiprocessing.set_start_method(method)
    child = multiprocessing.Process(target=engine_core, name=name)
    child.start()
    child.join()
"""


def start_front_end(daemon, tmp_path: Path, method: str, name: str) -> tuple[LineProcess, int, int, bool]:
    script = tmp_path / "front_end.py"
    script.write_text(FRONT_END)
    front_end = LineProcess([str(script), method, name], env={"HBMD_RUN_DIR": str(daemon.run_dir)})
    pid, session, watching = front_end.readline().split()
    return front_end, int(pid), int(session), watching == "True"


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_an_engine_core_whose_front_end_is_killed_ends_and_its_session_with_it(daemon, client, tmp_path, method):
    front_end, core, session, watching = start_front_end(daemon, tmp_path, method, "EngineCore_DP1")
    assert watching
    assert any(s.session_id == session for s in client.sessions())
    os.kill(front_end.proc.pid, signal.SIGKILL)
    front_end.proc.wait(10)
    wait_until(lambda: ended(core), timeout=10)
    wait_until(lambda: all(s.session_id != session for s in client.sessions()), timeout=10)
    (kept,) = client.buffers()
    assert kept.name == "kept" and kept.session_id == 0  # an orphan, for the engine that follows
    assert f"front end (pid {front_end.proc.pid}) has ended, and this engine core (pid {core})" in \
        front_end.stderr_tail()


def test_no_other_child_of_a_killed_process_is_ended(daemon, client, tmp_path):
    front_end, child, session, watching = start_front_end(daemon, tmp_path, "fork", "Worker_TP0")
    try:
        assert not watching
        os.kill(front_end.proc.pid, signal.SIGKILL)
        front_end.proc.wait(10)
        assert not ended(child)
        assert any(s.session_id == session for s in client.sessions())
    finally:
        os.kill(child, signal.SIGKILL)


def test_an_engine_core_whose_front_end_ended_before_it_looked_ends_at_once(tmp_path):
    script = tmp_path / "orphan.py"
    script.write_text("""
import multiprocessing, os, sys, time
from hbmd.integrations.vllm_front_end import end_with_front_end

def engine_core():
    while os.getppid() == multiprocessing.parent_process().pid:
        time.sleep(0.01)  # until the front end has ended
    end_with_front_end()
    print("not ended", flush=True)

if __name__ == "__main__":
    multiprocessing.set_start_method("fork")
    core = multiprocessing.Process(target=engine_core, name="EngineCore")
    core.start()
    print(core.pid, flush=True)
    os._exit(0)
""")
    front_end = LineProcess([str(script)])
    core = int(front_end.readline())
    wait_until(lambda: ended(core), timeout=10)  # the front end is not reaped before: a zombie has ended too
    front_end.proc.wait(10)
    assert front_end.rest(10) == []
    assert "has ended, and this engine core" in front_end.stderr_tail()


VLLM_FRONT_END = """
import multiprocessing, os
from hbmd.integrations import vllm as plugin

plugin.register()
from vllm.config import DeviceConfig, VllmConfig
from vllm.v1.engine.core import EngineCoreProc

if __name__ == "__main__":
    multiprocessing.set_start_method("fork")  # vLLM's default: the engine core loads no plugin of its own
    # vLLM's engine core, which waits for its front end's handshake (minutes) before it starts its engine.
    core = multiprocessing.Process(target=EngineCoreProc.run_engine_core, name="EngineCore", kwargs={
        "vllm_config": VllmConfig(device_config=DeviceConfig("cpu")), "local_client": True,
        "handshake_address": "ipc://" + os.path.join(os.environ["HANDSHAKE_DIR"], "handshake"),
        "executor_class": None, "log_stats": False})
    core.start()
    print(core.pid, flush=True)
    core.join()
"""


@pytest.mark.vllm
@pytest.mark.torch
def test_vllms_own_forked_engine_core_ends_with_its_front_end(tmp_path):
    pytest.importorskip("vllm.v1.engine.core", reason="vLLM is not installed")
    script = tmp_path / "front_end.py"
    script.write_text(VLLM_FRONT_END)
    front_end = LineProcess([str(script)], env={"HBMD_VLLM": "1", "HANDSHAKE_DIR": str(tmp_path)})
    core = int(front_end.readline(timeout=300))
    try:
        os.kill(front_end.proc.pid, signal.SIGKILL)  # before or after its engine core began to watch it: either way
        front_end.proc.wait(10)
        wait_until(lambda: ended(core), timeout=10)
    finally:
        if not ended(core):
            os.kill(core, signal.SIGKILL)

