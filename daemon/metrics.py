"""Prometheus metrics, served by the official client library on ``--metrics-addr``.

Gauges are read from the :class:`State` at scrape time by a collector, under
the server's lock (the HTTP server runs on its own thread); operation
counters and latency histograms are recorded by the server as it answers.
"""

from __future__ import annotations

import threading
import time
from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .state import State

LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0, 5.0)


class StateCollector(Collector):
    """Bytes, chunks and sessions per instance, tenant and session, as they are at scrape time."""

    def __init__(self, state: State, lock: threading.Lock) -> None:
        self.state = state
        self.lock = lock

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self.lock:
            state, backend = self.state, self.state.backend
            instance = [backend.instance]

            def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
                family = GaugeMetricFamily(name, doc, labels=["instance"])
                family.add_metric(instance, value)
                return family

            yield gauge("hbmd_budget_bytes", "Most bytes the daemon commits at once.", state.budget_bytes)
            yield gauge("hbmd_committed_bytes", "Bytes backed by chunks now.", state.committed_bytes)
            yield gauge("hbmd_reserved_bytes", "Address space reserved by buffers.", state.reserved_bytes)
            yield gauge("hbmd_device_total_bytes", "Memory of the device (or host).", backend.total_bytes)
            yield gauge("hbmd_device_free_bytes", "Free device memory as the driver reports it (-1 unknown).",
                        backend.free_bytes())
            yield gauge("hbmd_sessions", "Connected worker sessions.", len(state.workers))
            yield gauge("hbmd_buffers", "Buffers, orphaned persistent ones included.", len(state.buffers))
            yield gauge("hbmd_chunks", "Physical chunks.", state.num_chunks)

            labels = ["instance", "tenant"]
            used = GaugeMetricFamily("hbmd_tenant_committed_bytes", "Bytes committed per tenant.", labels=labels)
            guaranteed = GaugeMetricFamily("hbmd_tenant_guaranteed_bytes", "Guaranteed minimum per tenant.", labels=labels)
            limit = GaugeMetricFamily("hbmd_tenant_max_bytes", "Burst maximum per tenant (-1 none).", labels=labels)
            for tenant in state.tenant_infos():
                used.add_metric(instance + [tenant.name], tenant.used_bytes)
                guaranteed.add_metric(instance + [tenant.name], tenant.guaranteed_bytes)
                limit.add_metric(instance + [tenant.name], tenant.max_bytes)
            yield from (used, guaranteed, limit)

            labels = ["instance", "session", "pid", "client", "tenant"]
            committed = GaugeMetricFamily("hbmd_session_committed_bytes", "Bytes committed per session.", labels=labels)
            reserved = GaugeMetricFamily("hbmd_session_reserved_bytes", "Address space reserved per session.", labels=labels)
            chunks = GaugeMetricFamily("hbmd_session_chunks", "Chunks held per session.", labels=labels)
            for session in state.workers:
                info = state.session_info(session)
                values = instance + [str(info.session_id), str(info.pid), info.client_name, info.tenant]
                committed.add_metric(values, info.committed_bytes)
                reserved.add_metric(values, info.reserved_bytes)
                chunks.add_metric(values, info.num_chunks)
            yield from (committed, reserved, chunks)


class Metrics:
    """The daemon's registry: state gauges plus per-operation counters and latencies."""

    def __init__(self, state: State, lock: threading.Lock) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(StateCollector(state, lock))
        self._instance = state.backend.instance
        self.operations = Counter(
            "hbmd_operations", "Requests answered, by kind and outcome (ok or an error code).",
            ["instance", "operation", "outcome"], registry=self.registry,
        )
        self.latency = Histogram(
            "hbmd_operation_seconds", "Time to answer a request, by kind.",
            ["instance", "operation"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )

    def record(self, operation: str, outcome: str, started: float) -> None:
        self.operations.labels(self._instance, operation, outcome).inc()
        self.latency.labels(self._instance, operation).observe(time.perf_counter() - started)

    def serve(self, address: str) -> None:
        """Serve ``/metrics`` on ``HOST:PORT`` from a background thread."""
        host, _, port = address.rpartition(":")
        start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0", registry=self.registry)
