"""Writes the Kubernetes manifests for GPU nodes with a given number of GPUs.

``python deploy/daemonset.py --gpus 4 > hbmd-4gpu.yaml`` gives a DaemonSet
with one hbmd container per GPU, selecting nodes whose ``nvidia.com/gpu.count``
label (from GPU feature discovery) is 4, a NetworkPolicy that lets only the
monitoring namespace reach the metrics ports, and a PodMonitor scraping each
container's metrics port, all in namespace ``hbmd-system`` (``--namespace``)
and from image ``--image``. Keep one output per node shape in the fleet.
``deploy/hbmd-daemonset.yaml`` is this script's output for 8 GPUs and the
defaults.
"""

from __future__ import annotations

import argparse
import re

IMAGE = "registry.example.com/hbmd:0.3.0"
"""The image unless ``--image`` names another: the Dockerfile at the top of the repository, built and pushed."""
NAMESPACE = "hbmd-system"
"""Where the daemons run unless ``--namespace`` names another."""
UID = GID = 990
"""deploy/hbmd.sysusers.conf pins the same ids, so sockets mean the same group on every node."""
METRICS_PORT_BASE = 9470
"""GPU N serves metrics on 9470+N (not 9400, which is dcgm-exporter's)."""
BUDGET = "90%"
"""Of each GPU's memory: the rest is for what hbmd does not hold (CUDA contexts, activations, NCCL; README,
"Run it in production")."""
MONITORING_NAMESPACE = "monitoring"
"""Where Prometheus runs: the one namespace the NetworkPolicy lets reach the metrics."""

HEADER = f"""\
# hbmd on Kubernetes for nodes with {{gpus}} GPUs, written by deploy/daemonset.py {{arguments}}:
# one pod per node, one container per GPU, so each GPU's daemon has its own
# restarts, logs (kubectl logs -c gpu0) and readiness, like the hbmd@N units.
#
# GPU access, neither privileged nor by resource request: a request
# (nvidia.com/gpu: 1) would take the GPU from the schedulable pool. The pod
# runs under the NVIDIA container runtime with NVIDIA_VISIBLE_DEVICES=all,
# so GPUs keep their host nvidia-smi indices and --device N means GPU N.
# This needs the toolkit's accept-nvidia-visible-devices-envvar-when-unprivileged
# (true by default; some distributions, Bottlerocket for one, turn it off).
#
# Identity: uid {UID}, gid {GID} (the image's hbmd user, and the sysusers entry on
# hosts); instance directories are 0750 and sockets 0660, group {GID}. A worker
# pod reaches them with runAsGroup: {GID} or supplementalGroups: [{GID}].
#
# Upgrades keep every session: a new version of this DaemonSet starts its
# pod beside the old one on each node, and each new daemon takes every
# session, buffer and chunk over from the old (--takeover) through the
# node's /run/hbmd; workers resume by themselves (see the updateStrategy).
# A container restart is not an upgrade: the daemon's memory lives as long
# as its process, and Kubernetes has no equivalent of systemd's FD store to
# park it in, so a daemon that crashed or was killed comes back empty, and
# its workers see their session end and rebuild their KV cache (engines
# re-run prefill). Where that must not happen either, run hbmd as the
# systemd units on the node instead.
#
# The image is the Dockerfile at the top of the repository; libcuda comes
# from the NVIDIA runtime, not the image.
"""

NAMESPACE_OBJECT = """\
apiVersion: v1
kind: Namespace
metadata:
  name: {namespace}
  labels:
    # hostPath volumes are refused by the baseline and restricted Pod Security levels.
    pod-security.kubernetes.io/enforce: privileged
"""

DAEMONSET = f"""\
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: hbmd-{{gpus}}gpu
  namespace: {{namespace}}
  labels:
    app.kubernetes.io/name: hbmd
spec:
  selector:
    matchLabels:
      app.kubernetes.io/name: hbmd
      hbmd.io/gpus: "{{gpus}}"
  # A new version starts beside the old one on each node and takes every
  # session, buffer and chunk over from it (--takeover) over the shared
  # /run/hbmd; the old one lingers, holding nothing, until its pod is deleted
  # (exiting would have its container restarted, to take over back).
  updateStrategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  template:
    metadata:
      labels:
        app.kubernetes.io/name: hbmd
        hbmd.io/gpus: "{{gpus}}"
    spec:
      # Workers depend on it like on the device plugin: evict it last.
      priorityClassName: system-node-critical
      runtimeClassName: nvidia
      nodeSelector:
        nvidia.com/gpu.count: "{{gpus}}"   # from GPU feature discovery
      tolerations:
        - key: nvidia.com/gpu
          operator: Exists
          effect: NoSchedule
      automountServiceAccountToken: false
      # SIGTERM ends every session of a daemon still serving and releases its memory (one that handed
      # over holds nothing); matches TimeoutStopSec of the unit.
      terminationGracePeriodSeconds: 30
      securityContext:
        runAsUser: {UID}
        runAsGroup: {GID}
        runAsNonRoot: true
        seccompProfile:
          type: RuntimeDefault
      initContainers:
        # The kubelet creates the hostPath directory owned by root; the daemons create their instance directories in it.
        - name: run-dir
          image: {{image}}
          command: ["chown", "{UID}:{GID}", "/run/hbmd"]
          securityContext:
            runAsUser: 0
            runAsNonRoot: false
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: ["ALL"]
              add: ["CHOWN"]
          volumeMounts:
            - name: run-hbmd
              mountPath: /run/hbmd
      containers:
{{containers}}      volumes:
        - name: run-hbmd
          hostPath:
            path: /run/hbmd
            type: DirectoryOrCreate
"""

CONTAINER = f"""\
        - name: gpu{{index}}
          image: {{image}}
          command: ["hbmd"]
          args: ["--backend", "cuda", "--device", "{{index}}", "--run-dir", "/run/hbmd", "--takeover", "--linger",
                 "--budget", "{BUDGET}", "--metrics-addr", "0.0.0.0:{{port}}"]
          env:
            - name: NVIDIA_VISIBLE_DEVICES
              value: all
            - name: NVIDIA_DRIVER_CAPABILITIES
              value: compute,utility
          ports:
            - name: metrics-gpu{{index}}
              containerPort: {{port}}
              protocol: TCP
          # Readiness only: a liveness probe that killed a slow but working daemon
          # would end every session on its GPU; one that exits is restarted anyway.
          readinessProbe:
            httpGet:
              path: /healthz
              port: metrics-gpu{{index}}
            periodSeconds: 10
            timeoutSeconds: 5
          # The GPU memory is not the container's: the daemon holds no CUDA
          # context. No CPU limit: throttling would stall every commit on the GPU.
          resources:
            requests:
              cpu: 100m
              memory: 128Mi
            limits:
              memory: 1Gi
          securityContext:
            allowPrivilegeEscalation: false
            readOnlyRootFilesystem: true
            capabilities:
              drop: ["ALL"]
          volumeMounts:
            - name: run-hbmd
              mountPath: /run/hbmd
"""

NETWORKPOLICY = f"""\
# The metrics show every session's and tenant's figures to whoever reaches them,
# with no access check (SECURITY.md), and the daemons listen on the pod's
# address: only Prometheus's namespace ({MONITORING_NAMESPACE}; change it to yours) may
# connect, and only to the metrics ports. Workers reach hbmd through the
# hostPath sockets, never the network. Kubelet probes come from the node,
# which network plugins let through.
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: hbmd-{{gpus}}gpu-metrics
  namespace: {{namespace}}
spec:
  podSelector:
    matchLabels:
      app.kubernetes.io/name: hbmd
      hbmd.io/gpus: "{{gpus}}"
  policyTypes: ["Ingress"]
  ingress:
    - from:
        - namespaceSelector:
            matchLabels:
              kubernetes.io/metadata.name: {MONITORING_NAMESPACE}
      ports:
        - protocol: TCP
          port: {METRICS_PORT_BASE}
          endPort: {{last_port}}
"""

PODMONITOR = """\
# For the Prometheus Operator; without it, scrape the metrics-gpuN ports by your own means.
# Each series gets the node's name as label "node" (the Grafana dashboard's legends show it).
apiVersion: monitoring.coreos.com/v1
kind: PodMonitor
metadata:
  name: hbmd-{gpus}gpu
  namespace: {namespace}
spec:
  selector:
    matchLabels:
      app.kubernetes.io/name: hbmd
      hbmd.io/gpus: "{gpus}"
  podMetricsEndpoints:
{endpoints}"""

ENDPOINT = """\
    - port: metrics-gpu{index}
      path: /metrics
      relabelings:
        - sourceLabels: [__meta_kubernetes_pod_node_name]
          targetLabel: node
"""

WORKER = f"""\
# A worker pod that uses the node's hbmd (trimmed to what concerns hbmd). Its
# namespace must allow hostPath volumes, which only the "privileged" Pod
# Security level does (baseline and restricted refuse them): label it
# pod-security.kubernetes.io/enforce=privileged, or keep such workers in a
# namespace of their own that is.
#
# apiVersion: v1
# kind: Pod
# metadata:
#   name: llm-worker
# spec:
#   securityContext:
#     runAsUser: 1000
#     runAsGroup: 1000
#     supplementalGroups: [{GID}]     # the hbmd group: 0750 instance dirs, 0660 sockets
#   containers:
#     - name: engine
#       image: registry.example.com/llm-engine:latest
#       env:
#         - name: HBMD_RUN_DIR       # where the client looks for instances
#           value: /run/hbmd
#       resources:
#         limits:
#           nvidia.com/gpu: 1       # from the device plugin as usual; the client
#                                   # finds this GPU's hbmd by UUID, whatever its index here
#       volumeMounts:
#         - name: hbmd
#           mountPath: /run/hbmd
#   volumes:
#     - name: hbmd
#       hostPath:
#         path: /run/hbmd
#         type: Directory           # fail visibly on a node without hbmd
"""


def manifests(gpus: int, image: str = IMAGE, namespace: str = NAMESPACE) -> str:
    """The manifests for nodes with ``gpus`` GPUs, their daemons from ``image``, in ``namespace``."""
    arguments = " ".join([f"--gpus {gpus}"] + [f"--{option} {value}" for option, value, default in (
        ("image", image, IMAGE), ("namespace", namespace, NAMESPACE)) if value != default])
    containers = "".join(CONTAINER.format(index=i, port=METRICS_PORT_BASE + i, image=image) for i in range(gpus))
    endpoints = "".join(ENDPOINT.format(index=i) for i in range(gpus))
    return "---\n".join([
        HEADER.format(gpus=gpus, arguments=arguments) + NAMESPACE_OBJECT.format(namespace=namespace),
        DAEMONSET.format(gpus=gpus, containers=containers, image=image, namespace=namespace),
        NETWORKPOLICY.format(gpus=gpus, last_port=METRICS_PORT_BASE + gpus - 1, namespace=namespace),
        PODMONITOR.format(gpus=gpus, endpoints=endpoints, namespace=namespace),
    ]) + "\n" + WORKER


IMAGE_REFERENCE = re.compile(r"[a-z0-9][a-z0-9._/:@-]*", re.IGNORECASE)
"""What an image reference is made of (registry, path, tag, digest): nothing YAML would read as more than a name."""
NAMESPACE_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
"""A Kubernetes namespace: a DNS label (RFC 1123) of at most 63 characters."""


def image_reference(text: str) -> str:
    """argparse's type for ``--image``."""
    if not IMAGE_REFERENCE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an image reference (registry/name:tag or name@sha256:...)")
    return text


def namespace_name(text: str) -> str:
    """argparse's type for ``--namespace``."""
    if not NAMESPACE_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a namespace name: at most 63 lower-case letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description="Print hbmd's Kubernetes manifests for nodes with N GPUs.")
    parser.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs per node (1 to 64)")
    parser.add_argument("--image", type=image_reference, default=IMAGE, metavar="REF",
                        help="the hbmd image, built from the repository's Dockerfile (default: %(default)s)")
    parser.add_argument("--namespace", type=namespace_name, default=NAMESPACE, metavar="NAME",
                        help="the namespace the manifests create and use; its Pod Security level is set to "
                             "privileged, for the hostPath volume (default: %(default)s)")
    args = parser.parse_args()
    if not 1 <= args.gpus <= 64:
        parser.error("--gpus must be from 1 to 64")
    print(manifests(args.gpus, args.image, args.namespace), end="")


if __name__ == "__main__":
    main()
