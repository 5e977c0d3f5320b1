"""Kubernetes manifests come from deploy/daemonset.py, one per node shape, and agree with the unit's identity."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hbmd.daemon.options import build_parser

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
    assert kinds == ["Namespace", "DaemonSet", "NetworkPolicy", "PodMonitor"]


def test_only_the_monitoring_namespace_reaches_the_metrics_and_each_series_names_its_node():
    yaml = pytest.importorskip("yaml")
    _, daemonset, policy, monitor = yaml.safe_load_all(generate(3).stdout)
    pod = daemonset["spec"]["template"]
    ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c["ports"]]
    [rule] = policy["spec"]["ingress"]
    [allowed] = rule["ports"]
    assert (allowed["port"], allowed["endPort"]) == (min(ports), max(ports)) == (9470, 9472)
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert policy["spec"]["podSelector"] == daemonset["spec"]["selector"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint["relabelings"]


def test_every_daemon_leaves_room_beside_its_budget():
    yaml = pytest.importorskip("yaml")
    daemonset = list(yaml.safe_load_all(generate(2).stdout))[1]
    for container in daemonset["spec"]["template"]["spec"]["containers"]:
        args = container["args"]
        assert args[args.index("--budget") + 1] == "90%"
        assert build_parser().parse_args(args).budget == "90%"  # and hbmd takes every argument given


def test_sysusers_pins_the_ids_the_daemonset_and_image_use():
    sysusers = (DEPLOY / "hbmd.sysusers.conf").read_text()
    assert re.search(r"^g hbmd 990$", sysusers, re.M) and re.search(r"^u hbmd 990:990 ", sysusers, re.M)
    assert "runAsUser: 990" in generate(1).stdout
    dockerfile = (DEPLOY.parent / "Dockerfile").read_text()
    assert "990" in dockerfile


def test_image_and_namespace_are_chosen_on_the_command_line():
    yaml = pytest.importorskip("yaml")
    image = "ghcr.io/acme/hbmd@sha256:0123abcd"
    out = subprocess.run([sys.executable, "-m", "hbmd.deploy.daemonset", "--gpus", "2", "--image", image,
                          "--namespace", "gpu-infra"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    namespace, daemonset, policy, monitor = yaml.safe_load_all(out.stdout)
    assert namespace["metadata"]["name"] == "gpu-infra"
    assert {doc["metadata"]["namespace"] for doc in (daemonset, policy, monitor)} == {"gpu-infra"}
    pod = daemonset["spec"]["template"]["spec"]
    assert [c["image"] for c in pod["initContainers"] + pod["containers"]] == [image] * 3
    assert "hbmd-system" not in out.stdout and "registry.example.com/hbmd" not in out.stdout.split("# A worker pod")[0]
    # The header says how to write the same again.
    assert f"deploy/daemonset.py --gpus 2 --image {image} --namespace gpu-infra:" in out.stdout.splitlines()[0]
    assert "deploy/daemonset.py --gpus 2:" in generate(2).stdout.splitlines()[0]


@pytest.mark.parametrize("option, value", [("--namespace", "Not_A_Name"), ("--namespace", "-x"),
                                           ("--namespace", "a" * 64), ("--image", "two words"),
                                           ("--image", "x\ny: z"), ("--image", "")])
def test_an_image_or_namespace_yaml_would_misread_is_a_usage_error(option, value):
    out = subprocess.run([sys.executable, str(DEPLOY / "daemonset.py"), "--gpus", "1", option, value],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and f"argument {option}" in out.stderr and out.stdout == ""


def test_the_header_tells_the_update_strategy_the_daemonset_has():
    yaml = pytest.importorskip("yaml")
    text = generate(2).stdout
    header = text.split("apiVersion:")[0]
    daemonset = list(yaml.safe_load_all(text))[1]
    assert daemonset["spec"]["updateStrategy"] == {"type": "RollingUpdate",
                                                   "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    containers = daemonset["spec"]["template"]["spec"]["containers"]
    assert all({"--takeover", "--linger"} <= set(c["args"]) for c in containers)
    # Upgrades take every session over; only a container restart loses them, and the header says just that.
    assert "Upgrades keep every session" in header and "(--takeover)" in header
    assert "A container restart is not an upgrade" in header
    assert "drain the node's workers" not in header and "across daemon upgrades" not in header
