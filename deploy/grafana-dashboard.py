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


def panel(title: str, targets: list[tuple[str, str]], x: int, y: int, unit: str = "bytes", w: int = 12, kind: str = "timeseries") -> dict:
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


PANELS = [
    panel("Committed and reserved against the budget, per GPU", [
        (f"hbmd_budget_bytes{{{GPU}}}", "budget gpu {{gpu}}"),
        (f"hbmd_committed_bytes{{{GPU}}}", "committed gpu {{gpu}}"),
        (f"hbmd_reserved_bytes{{{GPU}}}", "reserved (address space) gpu {{gpu}}"),
    ], 0, 0),
    panel("hbmd committed vs. all framebuffer use (DCGM), per GPU", [
        (f"hbmd_committed_bytes{{{GPU}}}", "hbmd gpu {{gpu}}"),
        # DCGM reports MiB; joined on UUID, which both exporters carry.
        (f"DCGM_FI_DEV_FB_USED{{{GPU}}} * 1048576", "framebuffer used gpu {{gpu}}"),
        (f"hbmd_device_free_bytes{{{GPU}}}", "device free gpu {{gpu}}"),
    ], 12, 0),
    panel("Committed per tenant", [
        (f"sum by (tenant) (hbmd_tenant_committed_bytes{{{GPU}}})", "{{tenant}}"),
    ], 0, 8),
    panel("Tenant limits", [
        (f"sum by (tenant) (hbmd_tenant_guaranteed_bytes{{{GPU}}})", "guaranteed {{tenant}}"),
        (f"sum by (tenant) (hbmd_tenant_max_bytes{{{GPU}}})", "max {{tenant}}"),
    ], 12, 8),
    panel("Refusals (out of budget or quota) and reclaim requests", [
        (f'sum by (gpu) (rate(hbmd_operations_total{{{GPU}, outcome="out_of_budget"}}[$__rate_interval]))', "refused gpu {{gpu}}"),
        (f'sum by (gpu) (rate(hbmd_operations_total{{{GPU}, operation="admin.reclaim"}}[$__rate_interval]))', "reclaims gpu {{gpu}}"),
    ], 0, 16, unit="ops"),
    panel("Operation latency (p50, p99)", [
        (f"histogram_quantile(0.5, sum by (le, operation) (rate(hbmd_operation_seconds_bucket{{{GPU}}}[$__rate_interval])))",
         "p50 {{operation}}"),
        (f"histogram_quantile(0.99, sum by (le, operation) (rate(hbmd_operation_seconds_bucket{{{GPU}}}[$__rate_interval])))",
         "p99 {{operation}}"),
    ], 12, 16, unit="s"),
    panel("Sessions, buffers, chunks", [
        (f"sum by (gpu) (hbmd_sessions{{{GPU}}})", "sessions gpu {{gpu}}"),
        (f"sum by (gpu) (hbmd_buffers{{{GPU}}})", "buffers gpu {{gpu}}"),
        (f"sum by (gpu) (hbmd_chunks{{{GPU}}})", "chunks gpu {{gpu}}"),
    ], 0, 24, unit="short"),
    panel("Daemon file descriptors", [
        ('process_open_fds{job=~"$job"}', "open {{instance}}"),
        ('process_max_fds{job=~"$job"}', "limit {{instance}}"),
    ], 12, 24, unit="short"),
]

DASHBOARD = {
    "title": "hbmd",
    "uid": "hbmd-overview",
    "description": "hbmd memory daemons: budget, committed bytes per GPU and tenant, refusals, latency; beside DCGM.",
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
