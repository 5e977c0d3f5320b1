"""The example engine (``examples/engine.py``) on the host backend: a real decoder whose KV cache lives in hbmd.

Each test runs one mode of the example as a subprocess against a host
daemon, on the tiny model, and checks what the mode promises: an engine
sizes its KV cache to its requests, not to the budget, finds the daemon as
hbmctl does and says what each phase took, or says where it looked; a
worker SIGKILLed halfway and resumed on its persistent buffers produces the
tokens of an uninterrupted run; a KV cache released between requests
commits nothing while asleep and serves correctly after waking; two engines
sized one after the other both fit and show in the daemon's sessions; an
idle engine's cache is demoted to make room for another's and comes back; a
restarted worker gets the same tokens from weights attached from hbmd as
from a checkpoint file; two engines share one copy of the weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import DEMOTABLE, MiB, cuda_vmm_status

pytestmark = [pytest.mark.ipc, pytest.mark.torch]  # the examples are torch engines
GPU_OK, GPU_REASON = cuda_vmm_status()

ENGINE = Path(__file__).resolve().parents[1] / "examples" / "engine.py"
EXAMPLE_TIMEOUT_S = 120


def example_command(daemon, mode: str, *args: str, device: str = "cpu", config: str = "tiny") -> list[str]:
    # The work directory too is the test's own, not the user's ~/.cache.
    return [sys.executable, str(ENGINE), "--run-dir", str(daemon.run_dir), mode, "--device", device, "--config", config,
            "--json", "--timeout", "60", "--work-dir", str(daemon.run_dir), *args]


def run_example(daemon, mode: str, *args: str, device: str = "cpu", config: str = "tiny") -> dict:
    """Run one mode of the example against ``daemon``; its JSON result (the mode's checks must pass)."""
    proc = subprocess.run(
        example_command(daemon, mode, *args, device=device, config=config),
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{mode} exited with {proc.returncode}:\n{proc.stderr[-3000:]}\n{proc.stdout[-1000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def small_daemon(start_daemon):
    return start_daemon("--budget", "64MiB")


@pytest.mark.system
def test_an_engine_sizes_its_kv_cache_to_its_requests_and_finds_the_daemon_as_hbmctl_does(start_daemon, tmp_path):
    daemon = start_daemon("--budget", "4GiB")
    # No --run-dir: $HBMD_RUN_DIR says where the daemon is.
    command = [sys.executable, str(ENGINE), "generate", "--json", "--work-dir", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S,
                          env={**os.environ, "HBMD_RUN_DIR": str(daemon.run_dir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    kv = result["kv"]
    # 4 sequences of up to 40 + 24 tokens, 16 a block, and the null block: 17 blocks, whose pages are a granule
    # per layer and segment; not the 4 GiB the budget would hold.
    assert kv["sized_to"] == "what 4 sequences of up to 64 tokens need"
    assert kv["physical_bytes"] == result["session_committed_bytes"] == 2 * 2 * 2 * MiB
    assert kv["num_blocks"] * kv["bytes_per_block"] == kv["physical_bytes"] and kv["num_blocks"] >= 17
    for phase in ("built in", "warmed up in", "KV cache sized to", "prefilled", "decoded", "done in"):
        assert phase in proc.stderr, f"no line says {phase!r}:\n{proc.stderr}"
    assert f"under {daemon.run_dir} ($HBMD_RUN_DIR)" in proc.stderr


def test_with_no_daemon_it_says_where_it_looked_and_exits_1(run_dir):
    proc = subprocess.run([sys.executable, str(ENGINE), "--run-dir", str(run_dir), "crash-resume",
                           "--work-dir", str(run_dir)], capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT_S)
    assert proc.returncode == 1
    assert f"no hbmd is serving {run_dir}" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.system
def test_a_worker_killed_halfway_resumes_on_its_kv_cache_with_identical_tokens(small_daemon):
    result = run_example(small_daemon, "crash-resume", "--new-tokens", "17", "--kill-after", "8")
    assert result["tokens_identical"] and result["ok"]
    assert result["killed_at_step"] == 8 and result["decode_steps"] == 16
    resumed, reference = result["resumed"], result["reference"]
    assert resumed["resumed_at_step"] == 8 and reference["resumed_at_step"] is None
    assert resumed["tokens"] == reference["tokens"] and all(len(seq) == 17 for seq in resumed["tokens"])
    assert len({tuple(seq) for seq in resumed["tokens"]}) == len(resumed["tokens"])  # a real model: sequences differ
    # While the worker was dead the daemon kept its two layers' buffers, committed; the resumed run freed them.
    assert result["orphaned_buffers"] == 2 and result["orphaned_bytes"] == resumed["kv"]["physical_bytes"] > 0
    assert result["buffers_left_after"] == 0
    client = small_daemon.connect()
    assert client.status().committed_bytes == 0 and client.buffers() == []
    client.close()


@pytest.mark.system
def test_a_released_kv_cache_commits_nothing_asleep_and_serves_correctly_after_waking(small_daemon):
    result = run_example(small_daemon, "sleep-wake")
    assert result["ok"]
    assert result["committed_awake_bytes"] > 0 and result["committed_asleep_bytes"] == 0
    assert result["session_asleep_bytes"] == 0
    assert result["committed_rewoken_bytes"] == result["committed_awake_bytes"]
    assert result["base_pointers_kept"]
    assert result["tokens_identical"] and result["tokens"] == result["fresh_tokens"]


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=GPU_REASON)])]
)
@pytest.mark.system
def test_asleep_mid_request_with_the_kv_cache_kept_it_wakes_and_finishes_with_undisturbed_tokens(start_daemon, device):
    backend, config, budget = ("host", "tiny", "64MiB") if device == "cpu" else ("cuda", "gpu-small", "16GiB")
    daemon = start_daemon("--budget", budget, "--host-budget", budget, backend=backend)
    result = run_example(daemon, "sleep-keep", device=device, config=config)
    assert result["ok"] and result["tokens_identical"] and result["tokens"] == result["undisturbed_tokens"]
    kv = result["bytes_awake"]["device"]
    assert kv > 0 and result["bytes_awake"]["host"] == 0
    assert result["bytes_asleep"] == {"device": 0, "host": kv}  # the GPU's pages went back, the bytes stayed
    assert result["bytes_rewoken"] == {"device": kv, "host": 0}
    assert result["base_pointers_kept"] and 0 < result["slept_after_step"] < len(result["tokens"][0]) - 1
    assert result["decode_step_demoted_s"] > 0  # one step decoded on the cache where it lay, its tokens in the check


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=GPU_REASON)])]
)
@pytest.mark.system
def test_an_idle_engines_cache_is_demoted_to_make_room_and_comes_back_with_identical_tokens(
        start_daemon, tmp_path, device):
    backend, config, budget = ("host", "tiny", "256MiB") if device == "cpu" else ("cuda", "gpu-small", "16GiB")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(DEMOTABLE)
    daemon = start_daemon("--budget", budget, "--host-budget", budget, "--config", str(tenants), backend=backend)
    result = run_example(daemon, "make-room", device=device, config=config)
    assert result["ok"] and result["tokens_identical"] == {"a": True, "b": True}
    assert result["tokens"] == result["undisturbed_tokens"]
    kv = result["kv_bytes"]
    assert kv["a"] + kv["b"] > result["budget_bytes"]  # B's cache did not fit beside A's...
    assert 0 < result["a_during_b"]["host"] <= kv["a"]  # ...so part of A's went to the host tier meanwhile
    assert result["a_before"]["host"] == result["a_after"]["host"] == 0 and result["a_after"]["device"] >= kv["a"]
    assert result["base_pointers_kept"] and 0 < result["paused_after_step"]
    client = daemon.connect()
    status = client.status()
    assert status.committed_bytes == status.host_bytes == 0
    client.close()


@pytest.mark.system
def test_two_engines_size_from_what_is_left_and_both_show_in_the_sessions(small_daemon):
    result = run_example(small_daemon, "two-engines", "--tenants", "llama-a,llama-b", "--kv-share", "0.5")
    assert result["ok"]
    first, second = result["sessions"]
    assert (first["engine"], first["config"], first["tenant"]) == ("engine-a", "tiny", "llama-a")
    assert (second["engine"], second["config"], second["tenant"]) == ("engine-b", "small", "llama-b")
    assert second["available_at_sizing"] < first["available_at_sizing"]  # the second sees what the first left
    assert first["committed_bytes"] > 0 and second["committed_bytes"] > 0
    assert first["committed_bytes"] + second["committed_bytes"] == result["committed_bytes"] <= 64 * MiB
    for row, engine in zip(result["sessions"], result["engines"]):
        assert row["committed_bytes"] == engine["kv"]["physical_bytes"] == engine["session_committed_bytes"]
        assert row["num_blocks"] * row["bytes_per_block"] <= row["committed_bytes"]
    # --kv-share sizes A to the budget, not to its requests (8 MiB): half of what it saw left.
    assert first["committed_bytes"] >= first["available_at_sizing"] // 2 > 8 * MiB


@pytest.mark.system
def test_two_engines_stay_within_their_tenants_quotas(start_daemon, tmp_path):
    quotas = tmp_path / "tenants.toml"
    quotas.write_text(
        '[[tenants]]\nname = "llama-a"\nmax = "24MiB"\n\n[[tenants]]\nname = "llama-b"\nguaranteed = "32MiB"\n'
    )
    daemon = start_daemon("--budget", "64MiB", "--config", str(quotas))
    # Engine A would take the whole budget; its quota caps it and B's guarantee is left alone.
    result = run_example(daemon, "two-engines", "--tenants", "llama-a,llama-b", "--kv-share", "1")
    first, second = result["sessions"]
    assert 0 < first["committed_bytes"] <= 24 * MiB
    assert second["committed_bytes"] >= 32 * MiB
    tenants = {t["name"]: t for t in result["tenants"]}
    assert tenants["llama-a"]["max_bytes"] == 24 * MiB and tenants["llama-b"]["guaranteed_bytes"] == 32 * MiB


@pytest.mark.system
def test_a_restarted_worker_gets_the_same_tokens_from_weights_in_hbmd_as_from_a_checkpoint(small_daemon):
    result = run_example(small_daemon, "restart", "--new-tokens", "9")
    assert result["ok"] and result["tokens_identical"]
    for kind in ("disk", "file", "hbmd"):
        assert 0 < result[kind]["weights_s"] < result[kind]["first_token_s"]
    # The run removed what it made: the weights in hbmd and the checkpoint.
    client = small_daemon.connect()
    assert client.buffers() == [] and client.status().committed_bytes == 0
    client.close()
    assert not list(small_daemon.run_dir.glob("*.weights.pt"))


@pytest.mark.system
def test_two_engines_share_one_copy_of_the_weights(small_daemon):
    result = run_example(small_daemon, "share-weights")
    assert result["ok"] and result["tokens_identical"] and result["readers"] == 2
    assert not result["engines_charged_for_weights"]
    assert result["committed_bytes"] == result["weights_bytes"] + result["kv_bytes"] <= 64 * MiB
    assert set(result["device_used_bytes"]) == {"own", "shared"}


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not GPU_OK, reason=GPU_REASON)])]
)
@pytest.mark.parametrize("how", ["kill", "takeover", "kill cold"])
@pytest.mark.system
def test_an_engine_decoding_while_the_daemon_restarts_gets_the_tokens_of_an_undisturbed_run(
    start_daemon, run_dir, systemd, how, device
):
    state_dir = run_dir / "state"
    state_dir.mkdir()
    backend, config = ("host", "tiny") if device == "cpu" else ("cuda", "gpu-small")
    args = ("--budget", "64MiB" if device == "cpu" else "16GiB", "--state-dir", str(state_dir))
    daemon = start_daemon(*args, backend=backend, env={"NOTIFY_SOCKET": str(systemd.path)})
    undisturbed = run_example(daemon, "generate", device=device, config=config)

    engine = subprocess.Popen(
        example_command(daemon, "generate", "--announce-step", "4", "--step-delay", "0.1", device=device,
                        config=config),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert json.loads(engine.stdout.readline()) == {"decode_step": 4}
        restarted_at = time.monotonic()
        if how == "kill":
            daemon.kill()  # a crash, mid-decode: Restart=on-failure starts the next one on what the store kept
            daemon = start_daemon(*args, backend=backend, **systemd.relaunch())
        elif how == "kill cold":
            daemon.kill()  # a plain daemon started again on nothing: the engine declares what it maps
            daemon = start_daemon(*args[:2], backend=backend)
        else:
            old = daemon
            daemon = start_daemon(*args, "--takeover", backend=backend, env={"NOTIFY_SOCKET": str(systemd.path)})
            assert old.proc.wait(30) == 0
        serving_after = time.monotonic() - restarted_at
        out, err = engine.communicate(timeout=EXAMPLE_TIMEOUT_S)
    finally:
        engine.kill()
    assert engine.returncode == 0, err[-3000:]
    disturbed = json.loads(out.strip().splitlines()[-1])
    # Every decode step ran, on the KV cache it had, through the restart: the same tokens.
    assert disturbed["tokens"] == undisturbed["tokens"]
    assert "declared again" in daemon.log() if how == "kill cold" else "resumed" in daemon.log()
    since = "its launch" if how == "takeover" else "the kill"
    print(f"\n{how} on {device}: the new daemon served {serving_after:.2f}s after {since}")
