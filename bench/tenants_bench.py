"""What configured tenants cost a daemon: status, a commit, a metrics scrape, a SIGHUP reload and SIGTERM, by count.

    python3 bench/tenants_bench.py [--tenants 0,1000,10000,30000] [--out bench/results/tenants-DATE.json]

For each count N it writes a ``--config`` of N ``[[tenants]]`` entries (every
tenth by uid, the others by name; each with a maximum, every third of the
named ones with a small guaranteed minimum, every seventh demotable), starts
a host-backend daemon on it (``--metrics-addr`` on a free port) and times, on
that daemon:

- ``start_s``: launch to serving (the config read);
- ``status``: ``client.status()`` of an admin session, p50 and max ms;
- ``commit``: a 2 MiB commit through the daemon (a session without a lease,
  charged to a tenant with a guaranteed minimum: admission holds back every
  other tenant's), p50 and max ms;
- ``scrape_ms``: one GET of ``/metrics``;
- ``reload_s``: SIGHUP with the config rewritten (every maximum changed) to
  the daemon's log saying it reloaded;
- ``status_during_reload_ms``: the longest ``status()`` of a session asking
  in a loop while a second reload runs (the reload takes the state's lock
  once the file is parsed: a caller with a 2 s timeout meets this);
- ``stop_s``: SIGTERM to the process's exit, the SIGTERM sent halfway
  through a third reload (as long as the first), where the old daemon's
  stop waited for the reload to let go of the state.

N = 0 is the baseline every other row is read against: the same daemon and
calls with no config. The host backend needs no GPU; tenants cost the same
work on either backend.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, Daemon, MiB, metadata, percentile, today_utc, write_json
from hbmd.client import ExtensibleTensor, connect

STATUS_CALLS = 30
COMMITS = 64
CALL_TIMEOUT_S = 600.0
"""Generous on purpose: the figure is how long a call takes, not whether it beats the client's default timeout."""
BUDGET = "4GiB"
GUARANTEE = "16KiB"
"""Every third named tenant's guaranteed minimum: 30,000 tenants promise about 140 MiB of the budget between them."""


def tenant_config(count: int, max_size: str) -> str:
    """``count`` ``[[tenants]]`` entries; the bench's own session declares ``bench``, one of them when count > 0."""
    entries = []
    for i in range(count):
        if i % 10 == 9:
            entries.append(f'[[tenants]]\nuid = {100000 + i}\nmax = "{max_size}"\n')
            continue
        name = "bench" if i == 0 else f"team-{i:05d}"
        extra = f'guaranteed = "{GUARANTEE}"\n' if i % 3 == 0 else 'demote = 1\n' if i % 7 == 0 else ""
        entries.append(f'[[tenants]]\nname = "{name}"\nmax = "{max_size}"\n{extra}')
    return "\n".join(entries)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ms(samples_ns: list[int]) -> dict[str, float]:
    values = [s / 1e6 for s in samples_ns]
    return {"p50_ms": round(percentile(values, 50), 3), "max_ms": round(max(values), 3)}


def measure(count: int, config: Path) -> dict[str, Any]:
    """Every figure of one tenant count, on a daemon of its own (its config written to ``config``)."""
    config.write_text(tenant_config(count, "1GiB"))
    port = free_port()
    args = ["--backend", "host", "--budget", BUDGET, "--metrics-addr", f"127.0.0.1:{port}"]
    if count:
        args += ["--config", str(config)]
    daemon = Daemon(*args)
    started = time.perf_counter()
    daemon.start(timeout=CALL_TIMEOUT_S)
    figures: dict[str, Any] = {"tenants": count, "start_s": round(time.perf_counter() - started, 3)}
    try:
        with connect(run_dir=daemon.run_dir, instance=daemon.instance, timeout=CALL_TIMEOUT_S, tenant="bench",
                     lease=False) as client:
            samples = []
            for _ in range(STATUS_CALLS):
                t0 = time.perf_counter_ns()
                status = client.status()
                samples.append(time.perf_counter_ns() - t0)
            figures["status"] = {**ms(samples), "tenants_listed": len(status.tenants),
                                 "tenants_left_out": status.tenants_left_out}
            kv = ExtensibleTensor((COMMITS + 1) * 2 * MiB, "cpu", client=client)
            kv.resize_(2 * MiB)  # the session's first commit maps the buffer's pages in: not what is measured
            samples = []
            for step in range(2, COMMITS + 2):
                t0 = time.perf_counter_ns()
                kv.resize_(step * 2 * MiB)
                samples.append(time.perf_counter_ns() - t0)
            figures["commit"] = ms(samples)
            kv.free()
            t0 = time.perf_counter()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=CALL_TIMEOUT_S) as page:
                body = page.read()
            figures["scrape_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            figures["scrape_kib"] = len(body) >> 10
        if count:
            figures["reload_s"] = reload(daemon, config, count, "2GiB", 1)
            figures["status_during_reload_ms"] = status_during_reload(daemon, config, count)
            # Halfway through a reload as long as the first: hbmd 0.2.0 held the state for most of one.
            config.write_text(tenant_config(count, "1GiB"))
            os.kill(daemon.pid, signal.SIGHUP)
            time.sleep(figures["reload_s"] / 2)
        t0 = time.perf_counter()
        figures["exit_status"] = daemon.stop(timeout=CALL_TIMEOUT_S)
        figures["stop_s"] = round(time.perf_counter() - t0, 3)
    finally:
        daemon.kill()  # where a call above failed; stop() then removes the run directory
        daemon.stop()
    return figures


def reload(daemon: Daemon, config: Path, count: int, max_size: str, nth: int) -> float:
    """Seconds from SIGHUP, the config rewritten with every maximum ``max_size``, to the log's ``nth`` reload."""
    config.write_text(tenant_config(count, max_size))
    t0 = time.perf_counter()
    os.kill(daemon.pid, signal.SIGHUP)
    deadline = t0 + CALL_TIMEOUT_S
    while daemon.log().count("SIGHUP: reloaded") < nth and time.perf_counter() < deadline:
        time.sleep(0.005)
    return round(time.perf_counter() - t0, 3)


def status_during_reload(daemon: Daemon, config: Path, count: int) -> float:
    """The longest ``status()`` (ms) of a session asking in a loop while a reload runs, from SIGHUP to the log's
    second reload: what a caller with a short timeout meets."""
    config.write_text(tenant_config(count, "3GiB"))
    longest = 0.0
    with connect(run_dir=daemon.run_dir, instance=daemon.instance, timeout=CALL_TIMEOUT_S) as client:
        os.kill(daemon.pid, signal.SIGHUP)
        deadline = time.perf_counter() + CALL_TIMEOUT_S
        while daemon.log().count("SIGHUP: reloaded") < 2 and time.perf_counter() < deadline:
            t0 = time.perf_counter()
            client.status()
            longest = max(longest, time.perf_counter() - t0)
    return round(longest * 1e3, 3)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'tenants':>8} {'start s':>8} {'status p50 ms':>14} {'max ms':>8} {'listed':>7} {'commit p50 ms':>14} "
          f"{'max ms':>8} {'scrape ms':>10} {'reload s':>9} {'status in reload ms':>20} {'SIGTERM s':>10}")
    for row in rows:
        print(f"{row['tenants']:>8} {row['start_s']:>8.3f} {row['status']['p50_ms']:>14.3f} "
              f"{row['status']['max_ms']:>8.3f} {row['status']['tenants_listed']:>7} {row['commit']['p50_ms']:>14.3f} "
              f"{row['commit']['max_ms']:>8.3f} {row['scrape_ms']:>10.3f} {row.get('reload_s', 0.0):>9.3f} "
              f"{row.get('status_during_reload_ms', 0.0):>20.3f} {row['stop_s']:>10.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", default="0,1000,10000,30000", help="comma-separated counts (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / f"tenants-{today_utc()}.json")
    args = parser.parse_args()
    counts = [int(c) for c in args.tenants.split(",")]
    result: dict[str, Any] = {"bench": "tenants", "meta": metadata(), "rows": []}
    with tempfile.TemporaryDirectory(prefix="hbmd-tenants-") as scratch:
        for count in counts:
            print(f"--- {count} tenants", flush=True)
            result["rows"].append(measure(count, Path(scratch) / "tenants.toml"))
            write_json(args.out, result)
    print_table(result["rows"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
