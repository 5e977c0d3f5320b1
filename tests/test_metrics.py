"""Prometheus metrics scraped over HTTP match what clients committed."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from hbmd.client import ExtensibleTensor, OutOfBudget
from hbmd.daemon.metrics import CONNECTION_TIMEOUT_S, MAX_CONNECTIONS, REQUEST_DEADLINE_S
from helpers import MiB, hbmctl, wait_until
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.ipc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def page(port: int, path: str = "/metrics") -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read().decode()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = page(port)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name, hbmd_instance="host", **labels):
    """The value of series ``name`` of the instance named ``hbmd_instance`` with ``labels``."""
    wanted = tuple(sorted({"hbmd_instance": hbmd_instance, **labels}.items()))
    return samples[(name, wanted)]


@pytest.mark.torch
def test_metrics_match_what_clients_committed(start_daemon):
    port = free_port()
    daemon = start_daemon("--budget", "256MiB", "--metrics-addr", f"127.0.0.1:{port}", "--metrics-sessions")
    assert f"metrics http://127.0.0.1:{port}/metrics" in daemon.log().splitlines()[0]
    # Without leases: every commit is then one request and one chunk per run (leased bytes: test_leases.py).
    a = daemon.connect(client_name="engine-a", tenant="team-a", lease=False)
    b = daemon.connect(client_name="engine-b", lease=False)
    ta = ExtensibleTensor(64 * MiB, "cpu", num_segments=2, client=a)
    ta.resize_per_segment_(5 * MiB)  # 6 MiB per segment: 12 MiB, two chunks
    tb = ExtensibleTensor(128 * MiB, "cpu", client=b)
    for size in (2, 4, 8):
        tb.resize_(size * MiB)
    with pytest.raises(OutOfBudget):
        ExtensibleTensor(512 * MiB, "cpu", client=b).resize_(512 * MiB)

    samples = scrape(port)
    assert value(samples, "hbmd_committed_bytes") == 20 * MiB
    assert value(samples, "hbmd_budget_bytes") == 256 * MiB
    assert value(samples, "hbmd_reserved_bytes") == (64 + 128 + 512) * MiB
    assert value(samples, "hbmd_sessions") == 2 and value(samples, "hbmd_chunks") == 5
    session_a = dict(session=str(a.session_id), pid=str(os.getpid()), client="engine-a", tenant="team-a")
    assert value(samples, "hbmd_session_committed_bytes", **session_a) == 12 * MiB
    assert value(samples, "hbmd_tenant_committed_bytes", tenant="team-a") == 12 * MiB
    assert value(samples, "hbmd_operations_total", operation="buffer.commit", outcome="ok") == 4
    assert value(samples, "hbmd_operations_total", operation="buffer.commit", outcome="out_of_budget") == 1
    assert value(samples, "hbmd_operation_seconds_count", operation="buffer.commit") == 5

    tb.free()
    b.close()
    wait_until(lambda: value(scrape(port), "hbmd_committed_bytes") == 12 * MiB)
    a.close()


def test_a_daemon_starts_again_on_its_metrics_port_right_after_a_scrape(start_daemon):
    """Each scrape leaves its connection in TIME_WAIT on the daemon's side for a minute: a restart (systemd's 100 ms
    RestartSec, a container's) must bind the port all the same."""
    port = free_port()
    first = start_daemon("--budget", "64MiB", "--metrics-addr", f"127.0.0.1:{port}")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as scraper:
        scraper.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := scraper.recv(65536):  # to the daemon's hang-up: it closes first, and keeps the TIME_WAIT
            answer += chunk
    assert b"hbmd_budget_bytes" in answer
    assert first.stop() == 0
    again = start_daemon("--budget", "64MiB", "--metrics-addr", f"127.0.0.1:{port}")
    assert "hbmd_budget_bytes" in page(port) and again.alive()


def test_a_busy_metrics_port_is_a_clear_startup_error(run_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "hbmd.daemon", "--backend", "host", "--run-dir", str(run_dir),
             "--device-lock-dir", str(run_dir), "--metrics-addr", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60,
        )
    assert out.returncode == 1 and "--metrics-addr" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.torch
def test_defaults_follow_prometheus_conventions(start_daemon):
    port = free_port()
    daemon = start_daemon("--budget", "256MiB", "--metrics-addr", f"127.0.0.1:{port}")
    worker = daemon.connect(client_name="engine", lease=False)
    ExtensibleTensor(16 * MiB, "cpu", client=worker).resize_(4 * MiB)
    samples = scrape(port)
    names = {name for name, _ in samples}
    # Per-session series are opt-in: each worker restart would start new ones.
    assert not any(name.startswith("hbmd_session_") for name in names)
    assert value(samples, "hbmd_tenant_committed_bytes", tenant=f"uid:{os.getuid()}") == 4 * MiB
    # No label of our own named instance (Prometheus's target label), no -1 sentinels, no _created.
    assert all("instance" not in dict(labels) for _, labels in samples)
    assert all(v >= 0 for v in samples.values()) and not any(name.endswith("_created") for name in names)
    assert "hbmd_tenant_max_bytes" not in names  # no tenant has a maximum
    build = [labels for name, labels in samples if name == "hbmd_build_info"]
    assert len(build) == 1 and ("backend", "host") in build[0] and ("hbmd_instance", "host") in build[0]
    assert "process_open_fds" in names
    assert page(port, "/healthz") == "ok\n"
    worker.close()


def test_every_series_names_its_instance_on_the_host_backend_too(start_daemon):
    port = free_port()
    daemon = start_daemon("--budget", "64MiB", "--metrics-addr", f"127.0.0.1:{port}", "--metrics-sessions",
                          "--instance-name", "host2")
    with daemon.connect(client_name="engine", tenant="team-a") as worker:
        worker.status()  # an operation counted, so that its counter and histogram have series
        samples = scrape(port)
    assert {name for name, _ in samples} >= {"hbmd_committed_bytes", "hbmd_tenant_committed_bytes",
                                             "hbmd_session_committed_bytes", "hbmd_operations_total",
                                             "hbmd_operation_seconds_bucket", "process_open_fds", "hbmd_build_info"}
    unnamed = [name for name, labels in samples if dict(labels).get("hbmd_instance") != "host2"]
    assert unnamed == []
    # The host has no GPU to name: no gpu or UUID label, rather than an empty one.
    assert all("gpu" not in dict(labels) and "UUID" not in dict(labels) for _, labels in samples)


@pytest.mark.unit
def test_a_gpu_instance_labels_its_series_as_dcgm_exporter_does_beside_its_name():
    from types import SimpleNamespace

    from hbmd.daemon.metrics import instance_labels

    gpu = SimpleNamespace(backend=SimpleNamespace(instance="gpu3", device_index=3, device_uuid="GPU-1234"))
    host = SimpleNamespace(backend=SimpleNamespace(instance="host", device_index=-1, device_uuid=""))
    assert instance_labels(gpu) == {"hbmd_instance": "gpu3", "gpu": "3", "UUID": "GPU-1234"}
    assert instance_labels(host) == {"hbmd_instance": "host"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) is not on PATH")
@pytest.mark.torch
def test_the_page_passes_promtool(start_daemon, run_dir):
    port = free_port()
    config = run_dir / "tenants.toml"
    config.write_text('[[tenants]]\nname = "team-a"\nmax = "64MiB"\nguaranteed = "8MiB"\n')
    daemon = start_daemon("--budget", "256MiB", "--metrics-addr", f"127.0.0.1:{port}", "--config", str(config))
    worker = daemon.connect(client_name="engine", tenant="team-a")
    ExtensibleTensor(16 * MiB, "cpu", client=worker).resize_(4 * MiB)
    lint = subprocess.run(["promtool", "check", "metrics"], input=page(port),
                          capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    worker.close()


@pytest.mark.parametrize(
    "address, complaint",
    [("9464", "not HOST:PORT"), ("localhost", "not HOST:PORT"), (":9464", "not HOST:PORT"),
     ("localhost:http", "port must be"), ("127.0.0.1:70000", "port must be"), ("::1:9464", "brackets")],
)
@pytest.mark.system
def test_metrics_addr_must_be_host_and_port(run_dir, address, complaint):
    out = subprocess.run(
        [sys.executable, "-m", "hbmd.daemon", "--backend", "host", "--run-dir", str(run_dir),
         "--metrics-addr", address],
        capture_output=True, text=True, timeout=60,
    )
    assert out.returncode == 2 and complaint in out.stderr and "Traceback" not in out.stderr


def test_metrics_listen_on_a_host_name(start_daemon):
    port = free_port()
    daemon = start_daemon("--metrics-addr", f"localhost:{port}")
    assert f"http://localhost:{port}/metrics" in daemon.log()
    assert "hbmd_budget_bytes" in page(port)


@pytest.mark.torch
def test_leased_bytes_are_a_metric_of_their_own_and_count_in_the_tenants(start_daemon):
    port = free_port()
    daemon = start_daemon("--budget", "256MiB", "--metrics-addr", f"127.0.0.1:{port}")
    worker = daemon.connect(client_name="engine", tenant="team-a")
    ExtensibleTensor(16 * MiB, "cpu", client=worker).resize_(2 * MiB)
    wait_until(lambda: worker.leased_granules >= 2)
    samples = scrape(port)
    leased = value(samples, "hbmd_leased_bytes")
    assert leased == worker.status().leased_bytes >= 4 * MiB
    assert value(samples, "hbmd_committed_bytes") == 2 * MiB
    assert value(samples, "hbmd_tenant_used_bytes", tenant="team-a") == 2 * MiB + leased
    # The tenants' committed bytes sum to the daemon's: a lease is not committed.
    assert value(samples, "hbmd_tenant_committed_bytes", tenant="team-a") == 2 * MiB
    worker.close()
    wait_until(lambda: value(scrape(port), "hbmd_leased_bytes") == 0)


def test_the_root_is_a_landing_page_naming_the_instance_and_linking_the_metrics(start_daemon):
    port = free_port()
    start_daemon("--budget", "64MiB", "--metrics-addr", f"127.0.0.1:{port}", "--instance-name", "host2")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/html")
        landing = response.read().decode()
    assert "<title>hbmd host2</title>" in landing
    assert '<a href="/metrics">' in landing and '<a href="/healthz">' in landing and "host backend" in landing


def test_a_path_other_than_metrics_healthz_and_the_root_is_not_found(start_daemon):
    port = free_port()
    start_daemon("--budget", "64MiB", "--metrics-addr", f"127.0.0.1:{port}")
    assert "hbmd_committed_bytes" in page(port, "/metrics") and page(port, "/healthz") == "ok\n"
    for path in ("/index.html", "/foo", "/metrics/", "/healthz/x"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            page(port, path)
        assert refused.value.code == 404, path


@pytest.mark.torch
def test_orphaned_persistent_buffers_are_counted_until_attached_again(start_daemon):
    port = free_port()
    daemon = start_daemon("--budget", "256MiB", "--metrics-addr", f"127.0.0.1:{port}")
    samples = scrape(port)
    assert value(samples, "hbmd_orphaned_bytes") == 0 and value(samples, "hbmd_orphaned_buffers") == 0
    with daemon.connect(lease=False) as engine:
        ExtensibleTensor(16 * MiB, "cpu", client=engine, name="kv", persistent=True).resize_(6 * MiB)
        ExtensibleTensor(16 * MiB, "cpu", client=engine).resize_(2 * MiB)  # anonymous: freed with its session
        assert value(scrape(port), "hbmd_orphaned_bytes") == 0
    wait_until(lambda: value(scrape(port), "hbmd_orphaned_bytes") == 6 * MiB)
    assert value(scrape(port), "hbmd_orphaned_buffers") == 1
    with daemon.connect() as engine:
        ExtensibleTensor.attach("kv", "cpu", client=engine)
        samples = scrape(port)
        assert value(samples, "hbmd_orphaned_bytes") == 0 and value(samples, "hbmd_committed_bytes") == 6 * MiB


def test_a_tenant_whose_guarantee_holds_memory_back_has_its_series_and_status_row_before_its_first_use(
    start_daemon, run_dir
):
    """An alert on such a tenant had no series, and status no row, until a session was charged to it; a tenant with
    no guarantee still shows once in use: a config may name tens of thousands (``bench/tenants_bench.py``)."""
    config = run_dir / "tenants.toml"
    config.write_text('[[tenants]]\nname = "idle"\nmax = "64MiB"\nguaranteed = "32MiB"\n\n'
                      '[[tenants]]\nuid = 4242\nguaranteed = "16MiB"\n\n[[tenants]]\nname = "capped"\nmax = "8MiB"\n')
    port = free_port()
    daemon = start_daemon("--budget", "256MiB", "--config", str(config), "--metrics-addr", f"127.0.0.1:{port}")
    samples = scrape(port)
    for name, value_of_it in [("hbmd_tenant_guaranteed_bytes", 32 * MiB), ("hbmd_tenant_max_bytes", 64 * MiB),
                              ("hbmd_tenant_used_bytes", 0), ("hbmd_tenant_committed_bytes", 0),
                              ("hbmd_tenant_sessions", 0)]:
        assert value(samples, name, tenant="idle") == value_of_it, name
    assert value(samples, "hbmd_tenant_tier_bytes", tenant="idle", tier="device") == 0
    assert value(samples, "hbmd_tenant_guaranteed_bytes", tenant="uid:4242") == 16 * MiB
    assert ("hbmd_tenant_max_bytes", (("hbmd_instance", "host"), ("tenant", "uid:4242"))) not in samples  # none
    assert not any(dict(labels).get("tenant") == "capped" for _, labels in samples)
    out = hbmctl("--run-dir", str(daemon.run_dir), "--json", "status")
    [status] = json.loads(out.stdout)["instances"]
    listed = {t["name"]: (t["used_bytes"], t["guaranteed_bytes"], t["max_bytes"]) for t in status["tenants"]}
    assert listed["idle"] == (0, 32 * MiB, 64 * MiB) and listed["uid:4242"] == (0, 16 * MiB, None)
    assert "capped" not in listed
    rows = hbmctl("--run-dir", str(daemon.run_dir), "status").stdout.splitlines()
    assert any(row.split()[:2] == ["idle", "0"] for row in rows), rows
    with daemon.connect(tenant="capped") as worker:  # once in use, as before
        assert value(scrape(port), "hbmd_tenant_max_bytes", tenant="capped") == 8 * MiB
        assert "capped" in {t.name for t in worker.status().tenants}


@pytest.mark.system
def test_config_reloads_show_in_metrics_and_in_hbmctl_status(start_daemon, run_dir):
    port = free_port()
    config = run_dir / "tenants.toml"
    config.write_text('[[tenants]]\nname = "team-a"\nmax = "64MiB"\n')
    daemon = start_daemon("--budget", "256MiB", "--metrics-addr", f"127.0.0.1:{port}", "--config", str(config))
    first = scrape(port)
    assert value(first, "hbmd_config_last_reload_successful") == 1
    loaded = value(first, "hbmd_config_last_reload_success_timestamp_seconds")
    assert abs(loaded - time.time()) < 60

    config.write_text('[[tenants]]\nname = "team-a"\nmax = "1TiB"\nguaranteed = "1TiB"\n')  # over the budget
    os.kill(daemon.pid, signal.SIGHUP)
    wait_until(lambda: value(scrape(port), "hbmd_config_last_reload_successful") == 0)
    assert value(scrape(port), "hbmd_config_last_reload_success_timestamp_seconds") == loaded
    status = hbmctl("--run-dir", str(run_dir), "status").stdout
    [line] = [line for line in status.splitlines() if line.strip().startswith("config:")]
    assert str(config) in line and "was refused, the config loaded before serves on" in line
    assert "over the budget" in line
    [record] = json.loads(hbmctl("--run-dir", str(run_dir), "--json", "status").stdout)["instances"]
    assert record["config_loaded_at"] == loaded and record["config_reload_failed_at"] >= loaded
    assert "over the budget" in record["config_reload_error"]

    config.write_text('[[tenants]]\nname = "team-a"\nmax = "32MiB"\n')
    os.kill(daemon.pid, signal.SIGHUP)
    wait_until(lambda: value(scrape(port), "hbmd_config_last_reload_successful") == 1)
    assert value(scrape(port), "hbmd_config_last_reload_success_timestamp_seconds") >= loaded
    [line] = [line for line in hbmctl("--run-dir", str(run_dir), "status").stdout.splitlines() if "config:" in line]
    assert "refused" not in line


@pytest.mark.system
def test_without_a_config_there_is_no_reload_to_report(start_daemon, run_dir):
    port = free_port()
    start_daemon("--budget", "64MiB", "--metrics-addr", f"127.0.0.1:{port}")
    assert not any(name.startswith("hbmd_config_") for name, _ in scrape(port))
    assert "config:" not in hbmctl("--run-dir", str(run_dir), "status").stdout


@pytest.mark.system
def test_a_takeover_keeps_the_metrics_address_and_the_lingering_predecessor_reports_nothing(start_daemon):
    port = free_port()
    args = ("--budget", "64MiB", "--metrics-addr", f"127.0.0.1:{port}")
    first = start_daemon(*args, "--linger", "--log-format", "json")
    started_first = value(scrape(port), "process_start_time_seconds")
    second = start_daemon(*args, "--takeover")  # the same command line, as an upgrade without systemd runs it
    assert "took over from pid" in second.log()
    wait_until(lambda: "lingering until stopped" in first.log())
    assert page(port, "/healthz") == "ok\n"
    # Every answer on the port now comes from the successor: the lingering one reports nothing.
    assert all(value(scrape(port), "process_start_time_seconds") > started_first for _ in range(20))
    assert first.stop() == 0
    lines = first.log().splitlines()
    assert all(line.startswith("{") for line in lines), [line for line in lines if not line.startswith("{")][:5]


@pytest.mark.system
def test_idle_connections_to_the_metrics_port_take_neither_the_daemons_descriptors_nor_its_requests(start_daemon):
    port = free_port()
    daemon = start_daemon("--budget", "64MiB", "--metrics-addr", f"127.0.0.1:{port}")
    page(port)
    descriptors = daemon.open_fds()
    idle = []
    try:
        for _ in range(300):  # as a peer that can reach the port and sends nothing
            idle.append(socket.create_connection(("127.0.0.1", port)))
        with daemon.connect() as client:  # the control plane serves on, a newcomer included
            assert client.status().num_sessions == 1
        assert daemon.open_fds() <= descriptors + MAX_CONNECTIONS + 4
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: "hbmd_committed_bytes" in page(port), timeout=2 * CONNECTION_TIMEOUT_S + 5)
    assert daemon.alive()


def trickle(address: str, port: int, stop: threading.Event, closed: dict[int, float]) -> list[socket.socket]:
    """:data:`MAX_CONNECTIONS` connections from ``address`` to the port, each sending one byte of a request every
    second until ``stop``, never finishing it; when the daemon closes one, ``closed`` gets its index and the time."""
    socks = []
    for _ in range(MAX_CONNECTIONS):
        sock = socket.socket()
        sock.bind((address, 0))
        sock.connect(("127.0.0.1", port))
        socks.append(sock)

    def run() -> None:
        while not stop.wait(1.0):
            for i, sock in enumerate(socks):
                if i in closed:
                    continue
                try:
                    sock.send(b"G")
                    if sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b"":
                        closed[i] = time.monotonic()
                except BlockingIOError:
                    pass
                except OSError:
                    closed[i] = time.monotonic()

    threading.Thread(target=run, daemon=True).start()
    return socks


@pytest.mark.system
def test_connections_trickling_a_request_hold_neither_every_slot_nor_one_for_long(start_daemon):
    """16 connections from one address, each sending a byte a second and never a whole request, held every slot of
    the port for as long as they trickled: no scrape, no readiness probe answered (issue #61). An address has 4
    slots at most, and a connection has :data:`REQUEST_DEADLINE_S` to send its request and read its answer."""
    port = free_port()
    daemon = start_daemon("--budget", "64MiB", "--metrics-addr", f"127.0.0.1:{port}")
    page(port)
    stop = threading.Event()
    closed: dict[int, float] = {}
    began = time.monotonic()
    socks = trickle("127.0.0.2", port, stop, closed)
    try:
        time.sleep(2)  # the connections trickle on meanwhile, holding what they hold: the thing under test
        answered = 0
        for _ in range(30):
            for path in ("/metrics", "/healthz"):
                with contextlib.suppress(OSError, http.client.HTTPException):
                    answered += bool(page(port, path))
        assert answered == 60
        wait_until(lambda: len(closed) == MAX_CONNECTIONS, timeout=REQUEST_DEADLINE_S + 5)
        held = sorted(closed.values())[-1] - began
        assert held <= REQUEST_DEADLINE_S + 3, f"a trickling connection held a slot {held:.0f} s"
    finally:
        stop.set()
        for sock in socks:
            sock.close()
    assert daemon.alive() and "Traceback" not in daemon.log()
