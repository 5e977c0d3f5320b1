"""Writes deploy/grafana-dashboard.json: hbmd per GPU and per tenant, beside DCGM's framebuffer figures.

Run ``python deploy/grafana-dashboard.py > deploy/grafana-dashboard.json``
after changing a panel; tests/test_dashboard.py checks the two agree and
that every query names a metric the daemon exports.
"""

from __future__ import annotations

import json

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# dcgm-exporter and hbmd label a GPU alike (gpu, UUID); Hostname is dcgm's node label.
GPU = 'UUID=~"$gpu"'


def panel(
    title: str, targets: list[tuple[str, str]], x: int, y: int, unit: str = "bytes", w: int = 12,
    kind: str = "timeseries",
) -> dict:
    return {
        "type": kind,
        "title": title,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


# Legends name the node as well as the GPU, or GPU 0 of every node would share one name: "node" is the label the
# PodMonitor of daemonset.py sets (a static scrape config sets it by hand, see deploy/README.md).
ON = "{{node}} gpu {{gpu}}"

PANELS = [
    panel("Committed and reserved against the budget, per GPU", [
        (f"hbmd_budget_bytes{{{GPU}}}", f"budget {ON}"),
        (f"hbmd_committed_bytes{{{GPU}}}", f"committed {ON}"),
        (f"hbmd_reserved_bytes{{{GPU}}}", f"reserved (address space) {ON}"),
    ], 0, 0),
    panel("hbmd committed vs. all framebuffer use (DCGM), per GPU", [
        (f"hbmd_committed_bytes{{{GPU}}}", f"hbmd {ON}"),
        # DCGM reports MiB; joined on UUID, which both exporters carry.
        (f"DCGM_FI_DEV_FB_USED{{{GPU}}} * 1048576", "framebuffer used {{Hostname}} gpu {{gpu}}"),
        (f"hbmd_device_free_bytes{{{GPU}}}", f"device free {ON}"),
    ], 12, 0),
    panel("Budget left, leased and orphaned, per GPU", [
        # What commits may still take: the budget less what is committed and what is leased ahead of need.
        (f"hbmd_budget_bytes{{{GPU}}} - hbmd_committed_bytes{{{GPU}}} - hbmd_leased_bytes{{{GPU}}}",
         f"budget left {ON}"),
        (f"hbmd_leased_bytes{{{GPU}}}", f"leased {ON}"),
        # Persistent buffers no worker holds: committed until attached again or deleted (hbmctl delete).
        (f"hbmd_orphaned_bytes{{{GPU}}}", f"orphaned {ON}"),
    ], 0, 8),
    panel("Committed per tenant", [
        (f"sum by (tenant) (hbmd_tenant_committed_bytes{{{GPU}}})", "{{tenant}}"),
    ], 12, 8),
    panel("Tenant limits", [
        (f"sum by (tenant) (hbmd_tenant_guaranteed_bytes{{{GPU}}})", "guaranteed {{tenant}}"),
        (f"sum by (tenant) (hbmd_tenant_max_bytes{{{GPU}}})", "max {{tenant}}"),
    ], 0, 16),
    panel("Refusals (out of budget or quota) and reclaim requests", [
        (f'sum by (node, gpu) (rate(hbmd_operations_total{{{GPU}, outcome="out_of_budget"}}[$__rate_interval]))',
         f"refused {ON}"),
        (f'sum by (node, gpu) (rate(hbmd_operations_total{{{GPU}, operation="admin.reclaim"}}[$__rate_interval]))',
         f"reclaims {ON}"),
    ], 12, 16, unit="ops"),
    panel("Operation latency (p50, p99)", [
        (f"histogram_quantile(0.5, sum by (le, operation) "
         f"(rate(hbmd_operation_seconds_bucket{{{GPU}}}[$__rate_interval])))",
         "p50 {{operation}}"),
        (f"histogram_quantile(0.99, sum by (le, operation) "
         f"(rate(hbmd_operation_seconds_bucket{{{GPU}}}[$__rate_interval])))",
         "p99 {{operation}}"),
    ], 0, 24, unit="s"),
    panel("Sessions, buffers, chunks", [
        (f"sum by (node, gpu) (hbmd_sessions{{{GPU}}})", f"sessions {ON}"),
        (f"sum by (node, gpu) (hbmd_buffers{{{GPU}}})", f"buffers {ON}"),
        (f"sum by (node, gpu) (hbmd_chunks{{{GPU}}})", f"chunks {ON}"),
    ], 12, 24, unit="short"),
    panel("Daemon file descriptors", [
        ('process_open_fds{job=~"$job"}', "open {{node}} {{instance}}"),
        ('process_max_fds{job=~"$job"}', "limit {{node}} {{instance}}"),
    ], 0, 32, unit="short"),
    panel("Config reloads (1: the last took effect)", [
        (f"hbmd_config_last_reload_successful{{{GPU}}}", f"{ON}"),
    ], 12, 32, unit="short"),
]

DASHBOARD = {
    "title": "hbmd",
    "uid": "hbmd-overview",
    "description": "hbmd memory daemons: budget, committed, leased and orphaned bytes per GPU and tenant, refusals, "
                   "latency, config reloads; beside DCGM.",
    "tags": ["hbmd", "gpu", "dcgm"],
    "schemaVersion": 39,
    "time": {"from": "now-6h", "to": "now"},
    "refresh": "30s",
    "templating": {
        "list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus"},
            {"name": "job", "type": "query", "datasource": DATASOURCE, "query": "label_values(hbmd_build_info, job)",
             "includeAll": True, "multi": True, "current": {"text": "All", "value": "$__all"}},
            {"name": "gpu", "label": "GPU UUID", "type": "query", "datasource": DATASOURCE,
             "query": 'label_values(hbmd_committed_bytes{job=~"$job"}, UUID)',
             "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}},
        ]
    },
    "panels": PANELS,
}

if __name__ == "__main__":
    print(json.dumps(DASHBOARD, indent=2))
