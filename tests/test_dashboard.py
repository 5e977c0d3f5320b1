"""The Grafana dashboard in deploy/ queries only what the daemon exports, and is its generator's output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hbmd.client import ExtensibleTensor, OutOfBudget
from helpers import MiB
from test_metrics import free_port, scrape

DEPLOY = Path(__file__).parent.parent / "deploy"


def queries() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


@pytest.mark.unit
def test_the_committed_dashboard_is_what_the_generator_writes():
    generated = subprocess.run([sys.executable, str(DEPLOY / "grafana-dashboard.py")],
                               capture_output=True, text=True, timeout=60)
    assert json.loads(generated.stdout) == json.loads((DEPLOY / "grafana-dashboard.json").read_text())


@pytest.mark.ipc
def test_every_query_names_a_metric_the_daemon_exports(start_daemon, run_dir):
    config = run_dir / "tenants.toml"
    config.write_text('[[tenants]]\nname = "team-a"\nmax = "16MiB"\nguaranteed = "4MiB"\n')
    port = free_port()
    daemon = start_daemon("--budget", "64MiB", "--config", str(config), "--metrics-addr", f"127.0.0.1:{port}")
    with daemon.connect(tenant="team-a") as client:
        with pytest.raises(OutOfBudget):
            ExtensibleTensor(32 * MiB, "cpu", client=client).resize_(32 * MiB)
        exported = {name for name, _ in scrape(port)}
    named = {name for expr in queries() for name in re.findall(r"\b(?:hbmd|process)_[a-z_]+\b", expr)}
    assert named and named - exported == set()
    # The only other metric family is dcgm-exporter's, for the side-by-side panel.
    assert {m for expr in queries() for m in re.findall(r"\b[A-Z][A-Z_]+_[A-Z_]+\b", expr)} == {"DCGM_FI_DEV_FB_USED"}


@pytest.mark.unit
def test_a_legend_that_names_a_gpu_names_its_node_and_the_operators_panels_are_there():
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    targets = [target for panel in dashboard["panels"] for target in panel["targets"]]
    per_gpu = [t["legendFormat"] for t in targets if "{{gpu}}" in t["legendFormat"]]
    assert per_gpu and all("{{node}}" in legend or "{{Hostname}}" in legend for legend in per_gpu)
    expressions = " ".join(t["expr"] for t in targets)
    for figure in (
        "hbmd_leased_bytes", "hbmd_orphaned_bytes", "hbmd_budget_bytes{UUID=~\"$gpu\"} - hbmd_committed_bytes"
    ):
        assert figure in expressions
