"""The vLLM plugin's switches, which need no vLLM: the opt-in's spellings and the tenant its buffers are charged to."""

from __future__ import annotations

import os

import pytest
from hbmd.integrations import vllm as plugin
from helpers import MiB


@pytest.mark.unit
@pytest.mark.parametrize(
    "value, on",
    [("1", True), ("true", True), ("YES", True), ("on", True), ("", False), ("0", False), ("false", False),
     ("No", False), ("off", False)],
)
def test_hbmd_vllm_takes_the_usual_spellings_of_on_and_off(monkeypatch, value, on):
    monkeypatch.setenv("HBMD_VLLM", value)
    assert plugin.enabled() is on


@pytest.mark.unit
@pytest.mark.parametrize("value", ["2", "enable", "hbmd"])
def test_a_spelling_it_does_not_know_stops_vllm_instead_of_being_ignored(monkeypatch, value):
    monkeypatch.setenv("HBMD_VLLM", value)
    with pytest.raises(ValueError, match=f"HBMD_VLLM='{value}'"):
        plugin.register()


@pytest.mark.torch
@pytest.mark.ipc
def test_hbmd_tenant_charges_the_plugins_buffers_and_an_explicit_tenant_wins(start_daemon, run_dir, monkeypatch):
    config = run_dir / "tenants.toml"
    config.write_text('[[tenants]]\nname = "serving"\nmax = "64MiB"\n')
    daemon = start_daemon("--budget", "256MiB", "--config", str(config))
    monkeypatch.setenv("HBMD_RUN_DIR", str(run_dir))
    monkeypatch.setenv("HBMD_TENANT", "serving")
    kv = plugin.VllmExtensibleTensor(8 * MiB, "cpu")  # connects as vLLM's workers do: no client given
    try:
        kv.resize_(4 * MiB)
        with daemon.connect(tenant="") as operator:
            tenants = {s.session_id: s.tenant for s in operator.sessions()}
            assert tenants[kv.client.session_id] == "serving"
            assert tenants[operator.session_id] == f"uid:{os.getuid()}"
            used = {t.name: t.used_bytes for t in operator.status().tenants}
            assert used["serving"] >= 4 * MiB  # its lease is charged to it too
    finally:
        kv.free()
        kv.client.close()


@pytest.mark.unit
@pytest.mark.parametrize("value, keeps", [("", False), ("drop", False), ("keep", True), (" KEEP ", True)])
def test_hbmd_vllm_sleep_says_whether_sleep_keeps_the_kv_cache(monkeypatch, value, keeps):
    monkeypatch.setenv("HBMD_VLLM_SLEEP", value)
    assert plugin.sleep_keeps() is keeps


@pytest.mark.unit
def test_a_sleep_mode_it_does_not_know_is_refused(monkeypatch):
    monkeypatch.setenv("HBMD_VLLM_SLEEP", "offload")
    with pytest.raises(ValueError, match="HBMD_VLLM_SLEEP='offload'"):
        plugin.sleep_keeps()


@pytest.mark.unit
@pytest.mark.parametrize("name, value", [("HBMD_VLLM_SLEEP", "keepit"), ("HBMD_VLLM_WAKE_WAIT_S", "soon"),
                                         ("HBMD_VLLM_WAKE_WAIT_S", "-1"), ("HBMD_VLLM_REQUIRED", "always")])
def test_a_setting_it_does_not_know_stops_the_engine_at_start_not_at_its_first_sleep(monkeypatch, name, value):
    monkeypatch.setenv("HBMD_VLLM", "1")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}'"):
        plugin.register()  # before vLLM is imported: no vLLM needed to be refused


@pytest.mark.torch
@pytest.mark.ipc
def test_with_sleep_keep_the_tensors_own_release_still_discards(start_daemon, run_dir, monkeypatch):
    daemon = start_daemon("--budget", "64MiB", "--host-budget", "64MiB")
    monkeypatch.setenv("HBMD_RUN_DIR", str(run_dir))
    monkeypatch.setenv("HBMD_VLLM_SLEEP", "keep")
    kv = plugin.VllmExtensibleTensor(8 * MiB, "cpu")
    try:
        kv.resize_(4 * MiB)
        kv.full_view()[: 4 * MiB].fill_(9)
        observer = daemon.connect(observer=True)
        kv.release_physical()  # what vLLM's ExtensibleKVCache.commit calls before a remap: throw the pages away
        assert kv.tier == "device" and observer.status().committed_bytes == 0 and observer.status().host_bytes == 0
        kv.recommit()
        assert int(kv.full_view()[: 4 * MiB].max()) == 0
    finally:
        kv.free()
