"""Prometheus metrics and a health check, served on ``--metrics-addr``.

Gauges are read from the :class:`State` at scrape time by a collector, under
the server's lock (the HTTP server runs on its own threads), which is let go
before the page is written; operation counters and latency histograms are
recorded by the server as it answers. The port serves
:data:`MAX_CONNECTIONS` connections at once, :data:`MAX_CONNECTIONS_PER_ADDRESS`
of one peer address, each for :data:`REQUEST_DEADLINE_S` in all: what a peer
that can reach it costs the daemon is bounded, and one peer cannot hold the
port from a scraper or a readiness probe at another address.

Conventions, so the series sit beside dcgm-exporter's: every series, the
process's own included, names its instance in ``hbmd_instance`` (``gpu0``,
``host``: the label ``instance`` is Prometheus's own, the target's address),
on every backend alike; a GPU instance also labels it with ``gpu`` (the
nvidia-smi index) and ``UUID``, exactly the label names dcgm-exporter uses,
so ``hbmd_committed_bytes`` joins ``DCGM_FI_DEV_FB_USED`` on ``UUID``. No
``-1`` for "unknown" (the series is left out), no ``_created`` series,
per-tenant series only for the tenants in use and those the config owes a
guaranteed minimum (what they are owed is held back from the others, in use
or not), and no per-session series unless asked for: session ids and pids
are new label values at every worker restart.

``/`` is a landing page naming the instance and linking the others, as
Prometheus's exporters have one.
"""

from __future__ import annotations

import collections
import html
import io
import itertools
import logging
import platform
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from hbmd.proto import TIER_DEVICE, TIER_HOST, TenantInfo
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .config import Config
from .state import State
from .state.tenants import unused_info

LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 1.0, 5.0)
HEALTH_LOCK_TIMEOUT_S = 2.0
"""/healthz fails when the server loop has held the state this long: it is stuck inside a request."""


def instance_labels(state: State) -> dict[str, str]:
    """The labels of every series: ``hbmd_instance``, and on a GPU ``gpu`` and ``UUID`` as dcgm-exporter names them."""
    backend = state.backend
    labels = {"hbmd_instance": backend.instance}
    if backend.device_index >= 0:
        labels |= {"gpu": str(backend.device_index), "UUID": backend.device_uuid}
    return labels


class LabelledCollector(Collector):
    """Another collector's series with ``labels`` added: the process's own, which know nothing of the instance."""

    def __init__(self, collector: Collector, labels: dict[str, str]) -> None:
        self.collector = collector
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self.collector.collect():
            family.samples = [sample._replace(labels={**self.labels, **sample.labels}) for sample in family.samples]
            yield family


class StateCollector(Collector):
    """Bytes, chunks and sessions of the instance and its tenants (and sessions, if asked), at scrape time."""

    def __init__(self, state: State, lock: threading.Lock, version: str, per_session: bool) -> None:
        self.state = state
        self.lock = lock
        self.version = version
        self.per_session = per_session
        self.instance = instance_labels(state)

    def _family(self, name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, labels=[*self.instance, *labels])

    def _add(self, family: GaugeMetricFamily, value: float, *labels: str) -> GaugeMetricFamily:
        family.add_metric([*self.instance.values(), *labels], value)
        return family

    def collect(self) -> Iterator[GaugeMetricFamily]:
        # The values are taken under the lock, and the page is written and sent after it is let go: a scraper, or
        # one that reads slowly, holds up no request. The configured tenants unused are the config's figures alone,
        # added after it too.
        with self.lock:
            families = list(self._families())
            # Each tenant in use with its committed bytes: what it holds on the device.
            tenants = self.state.tenants.by_name
            in_use = [(info, tenants[info.name].committed_bytes) for info in self.state.tenant_infos()]
            config = self.state.tenants.config
        yield from families
        yield from self._tenants(in_use, config)

    def _families(self) -> Iterator[GaugeMetricFamily]:
        state, backend = self.state, self.state.backend
        info = self._family("hbmd_build_info", "Version and backend of the daemon; always 1.",
                            ["version", "backend", "python_version"])
        yield self._add(info, 1, self.version, backend.name, platform.python_version())
        for name, doc, value in (
            ("hbmd_budget_bytes", "Most bytes the daemon commits at once.", state.tenants.budget_bytes),
            ("hbmd_committed_bytes", "Bytes backed by chunks now.", state.tenants.committed_bytes),
            ("hbmd_leased_bytes",
             "Granules and credit leased to sessions, not placed or spent yet; charged to their tenants.",
             state.tenants.leased_bytes),
            ("hbmd_reserved_bytes", "Address space reserved by buffers.", state.buffers.reserved_bytes),
            ("hbmd_device_total_bytes", "Memory of the device (or host).", backend.total_bytes),
            ("hbmd_sessions", "Connected worker sessions.", state.sessions.num_workers),
            ("hbmd_buffers", "Buffers, orphaned persistent ones included.", len(state.buffers.by_id)),
            ("hbmd_chunks", "Physical chunks.", state.buffers.num_chunks),
            ("hbmd_host_budget_bytes", "Most bytes the host tier holds (demoted buffers); 0: no host tier.",
             state.tenants.host_budget_bytes),
            ("hbmd_host_bytes", "Bytes of buffers demoted to the host tier.", state.tenants.host_bytes),
            ("hbmd_host_pool_bytes", "Host-tier memory made ahead of demotes.", backend.host_pool_bytes()),
        ):
            yield self._add(self._family(name, doc), value)
        free = backend.free_bytes()
        if free >= 0:
            family = self._family("hbmd_device_free_bytes", "Free device memory as the driver reports it.")
            yield self._add(family, free)
        orphans = state.buffers.orphans
        yield self._add(self._family(
            "hbmd_orphaned_bytes",
            "Bytes committed to persistent buffers no session holds: kept until attached again, grafted, deleted or "
            "freed at the end of their grace period.",
        ), sum(b.physical_bytes + b.pending_bytes for b in orphans))
        yield self._add(self._family("hbmd_orphaned_buffers", "Persistent buffers no session holds."), len(orphans))
        yield from self._config()
        if self.per_session:
            yield from self._sessions()

    def _config(self) -> Iterator[GaugeMetricFamily]:
        """Whether the last reload of ``--config`` took effect, and when the config in force was read (as
        Prometheus's own ``prometheus_config_last_reload_*`` series say it); nothing without ``--config``."""
        load = self.state.config_load
        if not load.path:
            return
        yield self._add(self._family(
            "hbmd_config_last_reload_successful",
            "1 when the last load of --config took effect, "
            "0 when a reload was refused and the config before serves on.",
        ), 0 if load.failed_at else 1)
        yield self._add(self._family(
            "hbmd_config_last_reload_success_timestamp_seconds",
            "Unix time the config in force was read (at start or by the last reload that took effect).",
        ), load.loaded_at)

    def _tenants(self, in_use: list[tuple[TenantInfo, int]], config: Config) -> Iterator[GaugeMetricFamily]:
        """Series per tenant in use (a session or buffer charged to it) and per configured tenant owed a guaranteed
        minimum, as status lists them; not per configured tenant: a config may name tens of thousands
        (``bench/tenants_bench.py``), and 30,000 tenants' series took 6 s a scrape on a 2-core machine."""
        labels = ["tenant"]
        committed = self._family(
            "hbmd_tenant_committed_bytes",
            "Bytes committed per tenant (on the device): the tenants sum to hbmd_committed_bytes.",
            labels,
        )
        used = self._family(
            "hbmd_tenant_used_bytes",
            "Bytes its limits count per tenant: committed, and its sessions' leases.",
            labels,
        )
        guaranteed = self._family("hbmd_tenant_guaranteed_bytes", "Guaranteed minimum per tenant.", labels)
        limit = self._family("hbmd_tenant_max_bytes", "Burst maximum per tenant that has one.", labels)
        sessions = self._family("hbmd_tenant_sessions", "Connected worker sessions per tenant.", labels)
        tiers = self._family(
            "hbmd_tenant_tier_bytes", "Bytes of each tenant's buffers by tier: on the device, or demoted to the host.",
            [*labels, "tier"],
        )
        named = {tenant.name for tenant, _ in in_use}
        unused = ((unused_info(limits), 0) for limits in config.guaranteeing if limits.name not in named)
        for tenant, device_bytes in itertools.chain(in_use, unused):
            self._add(committed, device_bytes, tenant.name)
            self._add(used, tenant.used_bytes, tenant.name)
            self._add(tiers, device_bytes, tenant.name, TIER_DEVICE)
            self._add(tiers, tenant.host_bytes, tenant.name, TIER_HOST)
            self._add(guaranteed, tenant.guaranteed_bytes, tenant.name)
            self._add(sessions, tenant.num_sessions, tenant.name)
            if tenant.max_bytes >= 0:
                self._add(limit, tenant.max_bytes, tenant.name)
        yield from (committed, used, guaranteed, limit, sessions, tiers)

    def _sessions(self) -> Iterator[GaugeMetricFamily]:
        labels = ["session", "pid", "client", "tenant"]
        committed = self._family("hbmd_session_committed_bytes", "Bytes committed per session.", labels)
        reserved = self._family("hbmd_session_reserved_bytes", "Address space reserved per session.", labels)
        chunks = self._family("hbmd_session_chunks", "Chunks held per session.", labels)
        for session in self.state.sessions.workers:
            info = self.state.sessions.info(session)
            values = (str(info.session_id), str(info.pid), info.client_name, info.tenant)
            self._add(committed, info.committed_bytes, *values)
            self._add(reserved, info.reserved_bytes, *values)
            self._add(chunks, info.num_chunks, *values)
        yield from (committed, reserved, chunks)


MAX_CONNECTIONS = 16
"""Connections the metrics port serves at once; one beyond is closed at once, so that idle peers cannot take the
daemon's descriptors (which its chunks and sessions need) or its threads."""
MAX_CONNECTIONS_PER_ADDRESS = 4
"""Connections one peer address is served at once, of :data:`MAX_CONNECTIONS`; one beyond is closed at once. A
scraper and a readiness probe each hold one at a time: 16 connections of one peer trickling requests held every slot,
and no scrape or probe was answered (issue #61, ``tests/test_metrics.py``)."""
CONNECTION_TIMEOUT_S = 5.0
"""How long one read or write of a connection may wait."""
REQUEST_DEADLINE_S = 10.0
"""How long a connection may take in all to send its request and read its answer, whatever the pace of each read
(Prometheus's default scrape timeout): a peer sending a byte every few seconds held its slot for as long as it
liked, each read well within :data:`CONNECTION_TIMEOUT_S`."""

log = logging.getLogger("hbmd.metrics")


class _BeforeDeadline(io.RawIOBase):
    """A connection's socket, each read and write of it given what is left of one deadline at most (and
    :data:`CONNECTION_TIMEOUT_S`); past it, ``TimeoutError``."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def _arm(self) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request took more than {REQUEST_DEADLINE_S:g} s")
        self._sock.settimeout(min(left, CONNECTION_TIMEOUT_S))

    def readinto(self, buffer: Any) -> int:
        self._arm()
        return self._sock.recv_into(buffer)

    def write(self, data: Any) -> int:
        # sendall's timeout bounds the whole call (Python 3.5 and later), not each send in it.
        self._arm()
        self._sock.sendall(data)
        return len(data)


class _QuietHandler(WSGIRequestHandler):
    def setup(self) -> None:
        super().setup()
        raw = _BeforeDeadline(self.connection, time.monotonic() + REQUEST_DEADLINE_S)
        self.rfile = io.BufferedReader(raw)
        self.wfile = io.BufferedWriter(raw)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would drown the daemon's log."""


class _BoundedServer(socketserver.ThreadingMixIn, WSGIServer):
    """A thread per connection, :data:`MAX_CONNECTIONS` at most and :data:`MAX_CONNECTIONS_PER_ADDRESS` of a peer
    address; the address shared with a successor (``--takeover`` binds it beside this one, which lets go once it has
    handed over: ``SO_REUSEPORT`` takes only the same user's)."""

    daemon_threads = True
    allow_reuse_port = True

    def server_activate(self) -> None:
        super().server_activate()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._addresses_lock = threading.Lock()
        self._per_address: collections.Counter[str] = collections.Counter()

    def process_request(self, request: Any, client_address: Any) -> None:
        address = client_address[0]
        with self._addresses_lock:
            if self._per_address[address] >= MAX_CONNECTIONS_PER_ADDRESS or not self.slots.acquire(blocking=False):
                self.shutdown_request(request)
                return
            self._per_address[address] += 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._let_go(address)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._let_go(client_address[0])

    def _let_go(self, address: str) -> None:
        with self._addresses_lock:
            self._per_address[address] -= 1
            if not self._per_address[address]:
                del self._per_address[address]
        self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A peer gone or too slow is its own business: one line at DEBUG (socketserver printed a traceback on
        stderr, the daemon's log, for every connection that timed out); anything else one record at ERROR."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("metrics: the connection of %s ended: %s", client_address[0], exc)
        else:
            log.exception("metrics: answering %s failed", client_address[0])


class Metrics:
    """The daemon's registry: state gauges, per-operation counters and latencies, and the process's own."""

    def __init__(self, state: State, lock: threading.Lock, version: str, *, per_session: bool = False) -> None:
        # _created series carry a timestamp per label set that no dashboard uses.
        disable_created_metrics()
        self.state = state
        self.lock = lock
        self.version = version
        self.registry = CollectorRegistry()
        self.registry.register(StateCollector(state, lock, version, per_session))
        labels = instance_labels(state)
        # Open FDs matter for a daemon that passes FDs: process_open_fds against process_max_fds.
        self.registry.register(LabelledCollector(ProcessCollector(registry=None), labels))
        self._instance = list(labels.values())
        names = list(labels)
        self.operations = Counter(
            "hbmd_operations", "Requests answered, by kind and outcome (ok or an error code).",
            [*names, "operation", "outcome"], registry=self.registry,
        )
        self.latency = Histogram(
            "hbmd_operation_seconds", "Time to answer a request, by kind.",
            [*names, "operation"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )
        self._metrics_app = make_wsgi_app(self.registry)
        self._httpd: _BoundedServer | None = None

    def record(self, operation: str, outcome: str, started: float) -> None:
        self.operations.labels(*self._instance, operation, outcome).inc()
        self.latency.labels(*self._instance, operation).observe(time.perf_counter() - started)

    def healthy(self) -> bool:
        """Whether the server loop lets go of the state: a wedged request keeps it."""
        if not self.lock.acquire(timeout=HEALTH_LOCK_TIMEOUT_S):
            return False
        self.lock.release()
        return True

    def landing_page(self) -> bytes:
        """What ``/`` shows a person who opens the port in a browser: which daemon this is, and where to look."""
        backend = self.state.backend
        device = "host memory" if backend.device_index < 0 else f"GPU {backend.device_index} ({backend.device_uuid})"
        title = html.escape(f"hbmd {backend.instance}")
        return (
            "<!DOCTYPE html>\n"
            f"<html><head><meta charset=\"utf-8\"><title>{title}</title></head><body>\n"
            f"<h1>{title}</h1>\n"
            f"<p>{html.escape(f'{backend.name} backend, {device}, hbmd {self.version}')}</p>\n"
            "<ul>\n"
            "<li><a href=\"/metrics\">/metrics</a>: Prometheus metrics</li>\n"
            "<li><a href=\"/healthz\">/healthz</a>: health check</li>\n"
            "</ul>\n"
            "</body></html>\n"
        ).encode()

    def app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        """``/metrics`` is the metrics page, ``/healthz`` answers 200 or 503, ``/`` is a landing page, any other path
        404: a typo in a scrape config must fail, not scrape the page under the wrong name."""
        path = environ.get("PATH_INFO")
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8")])
            return [self.landing_page()]
        if path == "/healthz":
            ok = self.healthy()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"server loop stuck\n"]
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: the metrics are on /metrics, the health check on /healthz\n"]

    def serve(self, host: str, port: int, *, beside_predecessor: bool = False) -> None:
        """Serve on ``host:port`` from background threads; ``OSError`` if the address cannot be bound.

        ``beside_predecessor``: the daemon taken over from still listens there
        and lets go once it has handed over. Any other daemon is refused an
        address in use, as if it were not shared.
        """
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        if not beside_predecessor:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                # As the server binds (allow_reuse_address): the connections of the last daemon's scrapes wait out
                # their TIME_WAIT on this port for a minute, and must not keep a restart from it. Without
                # SO_REUSEPORT the probe still fails on a port another socket listens on.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        server_class: type[_BoundedServer] = type("MetricsServer", (_BoundedServer,), {"address_family": family})
        self._httpd = make_server(host, port, self.app, server_class, _QuietHandler)
        threading.Thread(target=self._httpd.serve_forever, name="metrics", daemon=True).start()

    def close(self) -> None:
        """Stop serving and let the address go: a daemon that handed over reports nothing as if it still served."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
