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
