"""Kubernetes manifests come from deploy/daemonset.py, one per node shape, and agree with the unit's identity."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

DEPLOY = Path(__file__).parent.parent / "deploy"


def generate(gpus: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEPLOY / "daemonset.py"), "--gpus", str(gpus)],
                          capture_output=True, text=True, timeout=60)


def test_the_committed_daemonset_is_the_generators_for_eight_gpus():
    assert generate(8).stdout == (DEPLOY / "hbmd-daemonset.yaml").read_text()


def test_one_container_metrics_port_and_scrape_endpoint_per_gpu():
    text = generate(3).stdout
    assert re.findall(r"- name: (gpu\d+)", text) == ["gpu0", "gpu1", "gpu2"]
    assert re.findall(r"containerPort: (\d+)", text) == ["9470", "9471", "9472"]
    assert re.findall(r"- port: (metrics-gpu\d+)", text) == ["metrics-gpu0", "metrics-gpu1", "metrics-gpu2"]
    assert 'nvidia.com/gpu.count: "3"' in text and "priorityClassName: system-node-critical" in text
    assert "path: /healthz" in text and "hbmctl" not in text.split("# A worker pod")[0]
    assert generate(0).returncode == 2


def test_the_manifests_parse_as_kubernetes_objects():
    yaml = pytest.importorskip("yaml")
    kinds = [doc["kind"] for doc in yaml.safe_load_all(generate(2).stdout)]
    assert kinds == ["Namespace", "DaemonSet", "PodMonitor"]


def test_sysusers_pins_the_ids_the_daemonset_and_image_use():
    sysusers = (DEPLOY / "hbmd.sysusers.conf").read_text()
    assert re.search(r"^g hbmd 990$", sysusers, re.M) and re.search(r"^u hbmd 990:990 ", sysusers, re.M)
    assert "runAsUser: 990" in generate(1).stdout
    dockerfile = (DEPLOY.parent / "Dockerfile").read_text()
    assert "990" in dockerfile
