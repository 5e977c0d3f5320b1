"""A warm standby (``HBMD_VLLM_STANDBY``) beside an active engine, on vLLM 0.34's extensible KV cache and the host
backend: each engine a real process of its own, the active one killed as a crash kills it.

Needs vLLM 0.34 installed (integrations/README.md); skipped elsewhere.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is not installed")
from hbmd.integrations import kv_index, vllm_keep, vllm_prefix, vllm_standby
from hbmd.testing.spawn import LineProcess
from helpers import filled, wait_until
from test_vllm_keep import KV_WORKER, PREDECESSOR, four_layers_of, keeping_cache, kept, model_folder, scheduler  # noqa: F401
from vllm.config import DeviceConfig, VllmConfig

pytestmark = [pytest.mark.vllm, pytest.mark.ipc, pytest.mark.torch]

STANDBY = KV_WORKER + """
import json
from hbmd.integrations import vllm_keep
from test_vllm_standby import take_over

kv.commit(50)
print(kv.buffer.name, flush=True)
take_over(kv, config)
held = all(bool((kv.buffer.segment_view(s)[b * kv.segment_strides[s] : (b + 1) * kv.segment_strides[s]]
                 == b % 250 + 1).all()) for s in range(len(kv.segment_strides)) for b in range(1, 300))
print(json.dumps({"took_over": kv.buffer.name, "adopted_from": vllm_keep._rank.adopted_from, "held": held}),
      flush=True)
sys.stdin.readline()
"""
"""A standby's worker: its KV cache made and warmed up, then vLLM's measure (which waits for the takeover) and the
final sizing (which grafts); it prints its buffer's name, then what it took over and whether the blocks hold the
active engine's bytes."""


def take_over(kv, kv_cache_config) -> None:
    """What a standby's worker does at vLLM's measure after warm-up (waits there for its takeover; vLLM measured 300
    blocks free) and at the final sizing (:func:`graft`)."""
    graft(kv, kv_cache_config, vllm_standby.waiting(vllm_keep.counting_kept_blocks(lambda cache: 300))(kv))


def graft(kv, kv_cache_config, blocks: int) -> None:
    """vLLM's final sizing of ``kv`` to ``blocks``, through the plugin's: the active engine's pages grafted first."""
    runner = types.SimpleNamespace(extensible_kv_cache=kv, vllm_config=VllmConfig(device_config=DeviceConfig("cpu")),
                                   get_model=lambda: types.SimpleNamespace())
    vllm_keep.grafting(lambda runner, config, blocks: runner.extensible_kv_cache.commit(blocks, shrink=True))(
        runner, kv_cache_config, blocks)


def engine_env(daemon, kept, standby: bool) -> dict[str, str]:
    env = {"HBMD_RUN_DIR": str(daemon.run_dir), "PYTHONPATH": str(Path(__file__).parent), vllm_keep.KEEP: "1",
           vllm_keep.ENGINE: "e", vllm_keep.INDEX_DIR: str(kept)}
    return {**env, vllm_keep.STANDBY: "1" if standby else "0"}


def start_active(daemon, kept) -> tuple[LineProcess, str]:
    """An active engine's worker whose KV cache holds 300 blocks of known bytes, its index describing that cache as
    its scheduler's would: the process and its buffer's name."""
    active = LineProcess(["-c", PREDECESSOR], env=engine_env(daemon, kept, standby=False))
    name = active.readline(timeout=120)
    describe(kept, name)
    return active, name


def describe(kept, buffer: str) -> None:
    """The index as the active engine's scheduler begins it: describing ``buffer``."""
    kv_index.IndexWriter(kept / "e.index", {"key": {}, "ranks": [{"buffer": buffer, "gpu": "host"}]}).close()


def note_names(kept) -> str | None:
    note = vllm_keep.read_note(kept / "e.rank0.json")
    return note["buffer"] if note else None


def line_is_free(kept) -> bool:
    try:
        fd = os.open(kept / "e.standby", os.O_RDWR)
    except FileNotFoundError:
        return True  # no standby has stood in the line yet
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def bytes_of(observer, name: str) -> list[tuple[bool, int]]:
    return [(b.session_id > 0, b.physical_bytes) for b in observer.buffers(name=name)]


@pytest.fixture
def standby(kept, monkeypatch):
    monkeypatch.setenv(vllm_keep.STANDBY, "1")
    monkeypatch.setattr(vllm_keep, "_rank", None)
    return kept


@pytest.mark.parametrize("end", ["SIGKILL", "clean stop"])
def test_a_standby_holds_nothing_while_its_active_engine_lives_hung_or_not_and_takes_over_its_cache_at_its_end(
        standby, daemon, keeping_cache, monkeypatch, end):
    monkeypatch.setenv("HBMD_RUN_DIR", str(daemon.run_dir))
    active, donor = start_active(daemon, standby)
    observer = daemon.connect(observer=True)
    kv, config = four_layers_of(keeping_cache)
    base = kv.allocate(kv.size).data_ptr()
    kv.commit(50)  # the standby's warm-up
    assert vllm_keep._rank.standing_by and note_names(standby) == donor  # the note stays the active engine's
    measure = vllm_standby.waiting(vllm_keep.counting_kept_blocks(lambda cache: 300))
    result: dict[str, float] = {}
    waiter = threading.Thread(target=lambda: result.update(blocks=measure(kv), at=time.monotonic()))
    waiter.start()
    wait_until(lambda: bytes_of(observer, kv.buffer.name) == [(True, 0)])
    os.kill(active.proc.pid, signal.SIGSTOP)  # alive but hung: its pages are still its own
    waiter.join(1.5)  # the wait under test: the standby must not move while its active engine's process lives
    assert waiter.is_alive() and bytes_of(observer, donor)[0][0] and not line_is_free(standby)
    killed = time.monotonic()
    if end == "SIGKILL":
        active.kill()
    else:
        os.kill(active.proc.pid, signal.SIGCONT)
        active.send("stop")
        assert active.wait() == 0
    waiter.join(30)
    assert not waiter.is_alive() and result["blocks"] >= 300
    print(f"the standby measured {result['at'] - killed:.3f} s after the active engine's {end}")

    graft(kv, config, int(result["blocks"]))
    assert kv.buffer.base_ptr == base and kv.num_committed_blocks == result["blocks"]
    for segment in range(len(kv.segment_strides)):
        stride, view = kv.segment_strides[segment], kv.buffer.segment_view(segment)
        assert all(filled(view[b * stride : (b + 1) * stride], b % 250 + 1) for b in range(1, 300)), segment
    note = json.loads((standby / "e.rank0.json").read_text())
    assert (note["buffer"], note["adopted_from"], note["adopted_blocks"]) == (kv.buffer.name, donor, 300)
    assert observer.buffers(name=donor) == [] and line_is_free(standby)  # the next standby stands by for this one
    kv.free()


def test_of_two_standbys_exactly_one_takes_over_and_the_other_stands_by_for_it(kept, daemon):
    active, donor = start_active(daemon, kept)
    observer = daemon.connect(observer=True)
    standbys = [LineProcess(["-c", STANDBY], env=engine_env(daemon, kept, standby=True)) for _ in range(2)]
    try:
        names = [s.readline(timeout=120) for s in standbys]
        wait_until(lambda: all(bytes_of(observer, name) == [(True, 0)] for name in names))
        active.kill()
        wait_until(lambda: note_names(kept) in names, timeout=30)
        first = names.index(note_names(kept))
        winner, other = standbys[first], standbys[1 - first]
        report = json.loads(winner.readline(timeout=30))
        assert report == {"took_over": names[first], "adopted_from": donor, "held": True}
        describe(kept, names[first])  # as the new active engine's scheduler begins its index
        time.sleep(1.0)  # the wait under test: the other standby does not move while the new active engine lives
        assert other.proc.poll() is None and bytes_of(observer, names[1 - first]) == [(True, 0)]
        assert note_names(kept) == names[first]

        winner.kill()
        report = json.loads(other.readline(timeout=30))
        assert report == {"took_over": names[1 - first], "adopted_from": names[first], "held": True}
    finally:
        for process in standbys:
            process.kill()


def test_a_standby_that_finds_no_engine_running_serves_at_once_adopting_what_the_last_one_left(kept, daemon):
    active, donor = start_active(daemon, kept)
    active.kill()
    standby = LineProcess(["-c", STANDBY], env=engine_env(daemon, kept, standby=True))
    try:
        name = standby.readline(timeout=120)
        assert json.loads(standby.readline(timeout=60)) == {"took_over": name, "adopted_from": donor, "held": True}
    finally:
        standby.kill()


def test_a_standby_that_dies_costs_the_active_engine_nothing(kept, daemon):
    active, donor = start_active(daemon, kept)
    observer = daemon.connect(observer=True)
    held = bytes_of(observer, donor)
    standby = LineProcess(["-c", STANDBY], env=engine_env(daemon, kept, standby=True))
    name = standby.readline(timeout=120)
    wait_until(lambda: bytes_of(observer, name) == [(True, 0)] and not line_is_free(kept))
    standby.kill()
    wait_until(lambda: bytes_of(observer, name) == [(False, 0)])  # an orphan of no bytes
    assert bytes_of(observer, donor) == held and note_names(kept) == donor and line_is_free(kept)
    active.kill()


def test_a_standby_of_another_configuration_refuses_naming_what_differs(standby, model_folder):
    config = scheduler(model_folder).vllm_config
    scope = vllm_keep.Scope("e", 0)
    vllm_keep.index_dir()
    key = vllm_prefix.shared_fields(config)
    describe_key = {"key": key, "ranks": [{"buffer": "vllm-e-rank0.000000000001", "gpu": "host"}]}
    kv_index.IndexWriter(standby / "e.index", describe_key).close()
    vllm_standby.refuse_unlike(config, scope)  # the same configuration: it may stand by
    field = next(name for name in key if name.startswith("config.model"))
    kv_index.IndexWriter(standby / "e.index", {**describe_key, "key": {**key, field: "another"}}).close()
    with pytest.raises(vllm_standby.StandbyRefused, match=field.replace(".", r"\.")):
        vllm_standby.refuse_unlike(config, scope)
    config.parallel_config.tensor_parallel_size = 2
    config.parallel_config.world_size = 2
    rank = vllm_keep.KeptRank(scope, 0, "vllm-e-rank0.000000000002", "host", None, standing_by=True)
    kv = types.SimpleNamespace(buffer=types.SimpleNamespace(client=None))
    with pytest.raises(vllm_standby.StandbyRefused, match="one GPU"):
        vllm_standby.stand_by(None, kv, rank, config)


def test_a_standby_setting_needs_the_kept_cache(monkeypatch):
    monkeypatch.setenv(vllm_keep.STANDBY, "1")
    monkeypatch.delenv(vllm_keep.KEEP, raising=False)
    with pytest.raises(ValueError, match="HBMD_VLLM_STANDBY needs HBMD_VLLM_KEEP_KV=1"):
        vllm_keep.check_settings()


FRONT_END = """
import threading, time, zmq
from hbmd.integrations import vllm as plugin

plugin.register()
from vllm.v1.engine import core_client

context = zmq.Context()
waiting = context.socket(zmq.PAIR)
waiting.bind("inproc://ready")
ready = context.socket(zmq.PAIR)
ready.connect("inproc://ready")
threading.Timer(0.5, ready.send, (b"ready",)).start()
began = time.monotonic()
# What vLLM's front end does while its engine core starts (vllm/v1/engine/core_client.py).
answered = waiting.poll(timeout=core_client.VLLM_ENGINE_READY_TIMEOUT_S * 1000)
print(core_client.VLLM_ENGINE_READY_TIMEOUT_S, answered, time.monotonic() - began >= 0.5, flush=True)
"""
"""A front end with hbmd's plugin: how long it waits for its engine core, and whether that wait works with pyzmq."""


@pytest.mark.parametrize("set_by_operator", [None, "30"])
def test_a_standbys_front_end_waits_for_its_engine_core_without_limit_unless_told(kept, set_by_operator):
    """A standby's engine core is ready only at its takeover. A long wait in seconds overflows the C int of
    milliseconds pyzmq hands libzmq (the front end then failed at its start): the wait has no limit instead."""
    env = {"HBMD_VLLM": "1", vllm_keep.KEEP: "1", vllm_keep.STANDBY: "1", vllm_keep.ENGINE: "e",
           vllm_keep.INDEX_DIR: str(kept)}
    environment = {key: value for key, value in os.environ.items() if key != vllm_standby.READY_TIMEOUT}
    if set_by_operator is not None:
        environment[vllm_standby.READY_TIMEOUT] = set_by_operator
    front_end = subprocess.run([sys.executable, "-c", FRONT_END], env={**environment, **env}, capture_output=True,
                               text=True, timeout=300)
    assert front_end.returncode == 0, front_end.stderr[-3000:]
    wait, answered, waited = front_end.stdout.split()
    assert (wait, answered, waited) == (set_by_operator or str(vllm_standby.NO_LIMIT_S), "1", "True")
