"""What surviving a restart costs: commits with every chunk journaled and parked, and the pause a restart costs a
client.

Two figures, each measured in one run against its baseline:

- **commits**: 2 MiB steps through the daemon (no lease) and onto leased
  granules, on a daemon that journals every change and parks every chunk
  with a service manager (the systemd stand-in of ``tests/fake_systemd.py``,
  which keeps the FDs as systemd does, in a process of its own) against the
  same daemon without, the two interleaved round by round;
- **pause**: a client holding N chunks (10, 1,000, 10,000) and calling the
  daemon in a loop while the daemon is killed and restarted on what the store
  kept (a crash under systemd), and while a successor takes over
  (``--takeover``), and while a daemon with no FD store is killed and started
  again (the client declares again what its tensor maps): the longest wait
  between two of its calls' answers (how long its engine would stand), how
  many calls failed (none may), and how long the new daemon took from its
  launch to serving; and, of that pause, the client's own reconnect: how many
  connects to the handle socket the kernel refused (nothing listening there),
  how long it polled them, and how long it then waited for its welcome.

``python bench/restart_bench.py --backend cuda`` on a GPU node; the host
backend needs 2 MiB of RAM per chunk (10,000 chunks: 20 GiB), so
``--chunks`` picks the counts there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS_DIR, metadata, today_utc, write_json
from hbmd.client import connect
from hbmd.testing.restarts import CallsInALoop, Reconnects
from hbmd.testing.spawn import DaemonProcess, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fake_systemd import FakeSystemd  # the stand-in lives with the tests that check it

MiB = 1 << 20
GRANULE = 2 * MiB


STORE_PROCESS = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from fake_systemd import FakeSystemd
store = FakeSystemd(Path(sys.argv[1]))
print("ready", flush=True)
sys.stdin.read()
store.close()
"""


class StoreProcess:
    """The systemd stand-in in a process of its own, as systemd is: in the measuring process its thread would wake
    for every chunk parked and take the interpreter from the client being timed. It cannot restart the daemon."""

    def __init__(self, path: Path) -> None:
        self.path = path
        tests = Path(__file__).resolve().parent.parent / "tests"
        self.proc = subprocess.Popen([sys.executable, "-c", STORE_PROCESS, str(path), str(tests)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)


class Instance:
    """A daemon on a run directory of its own, kept (``kept``: journaled and parked with a stand-in) or not.

    ``restartable``: the stand-in keeps the FDs in this process, so that it can start the next daemon on them.
    """

    def __init__(self, backend: str, kept: bool, restartable: bool = False, args: tuple[str, ...] = ()) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix="hbmdr-", dir="/tmp"))
        self.backend = backend
        self.kept = kept
        store = FakeSystemd if restartable else StoreProcess
        self.systemd = store(self.run_dir / "notify.sock") if kept else None
        self.args = ["--backend", backend, "--budget", "90%"]
        if kept:
            (self.run_dir / "state").mkdir()
            self.args += ["--state-dir", str(self.run_dir / "state")]
        self.args += args
        self.daemon = self._start()

    def _start(self, *more: str, **launch) -> DaemonProcess:
        if self.systemd is not None and not launch:
            launch = {"env": {"NOTIFY_SOCKET": str(self.systemd.path)}}
        return DaemonProcess(self.run_dir, *self.args, *more, log_path=self.run_dir / f"hbmd-{time.monotonic_ns()}.log",
                             **launch).start(timeout=120)

    def connect(self, **kwargs):
        return connect(run_dir=self.run_dir, instance=self.daemon.instance, **kwargs)

    def crash(self) -> DaemonProcess:
        """SIGKILL, then a new daemon on what the store kept, as ``Restart=on-failure`` does (with no store, on
        nothing)."""
        self.daemon.kill()
        self.daemon = self._start(**self.systemd.relaunch()) if self.systemd is not None else self._start()
        return self.daemon

    def upgrade(self) -> DaemonProcess:
        """SIGTERM, then a new daemon on what the store kept, as a restart of the unit does."""
        assert self.daemon.stop() == 0
        self.daemon = self._start(**self.systemd.relaunch()) if self.systemd is not None else self._start()
        return self.daemon

    def take_over(self) -> DaemonProcess:
        old = self.daemon
        self.daemon = self._start("--takeover")
        old.proc.wait(60)
        return self.daemon

    def close(self) -> None:
        self.daemon.kill()
        if self.systemd is not None:
            self.systemd.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def commit_steps(instance: Instance, lease: bool, steps: int) -> list[float]:
    """Seconds of each 2 MiB step of one buffer grown ``steps`` times."""
    from hbmd.client import ExtensibleTensor

    device = "cpu" if instance.backend == "host" else "cuda:0"
    with instance.connect(lease=lease) as client:
        kv = ExtensibleTensor(steps * GRANULE, device, client=client)
        times = []
        for step in range(1, steps + 1):
            started = time.perf_counter()
            kv.resize_(step * GRANULE)
            times.append(time.perf_counter() - started)
        kv.free()
    return times


def commits(backend: str, rounds: int, steps: int) -> dict:
    plain, kept = Instance(backend, False), Instance(backend, True)
    try:
        result = {}
        for lease in (False, True):
            samples = {"plain": [], "kept": []}
            for _ in range(rounds):  # interleaved: the machine's noise falls on both alike
                for name, instance in (("plain", plain), ("kept", kept)):
                    samples[name] += commit_steps(instance, lease, steps)
            p50 = {name: statistics.median(values) * 1e6 for name, values in samples.items()}
            result["leased" if lease else "through the daemon"] = {
                "p50_us_without_journal": round(p50["plain"], 1),
                "p50_us_journaled_and_parked": round(p50["kept"], 1),
                "ratio": round(p50["kept"] / p50["plain"], 3),
                "steps": len(samples["kept"]),
            }
        return result
    finally:
        plain.close()
        kept.close()


HOWS = ("crash", "takeover", "cold")


def pause(backend: str, chunks: int, how: str) -> dict:
    """A client holding ``chunks`` chunks; the daemon crashes (or is taken over, or crashes with no FD store): the
    client's pause."""
    from hbmd.client import ExtensibleTensor

    fds_before = len(os.listdir("/proc/self/fd"))  # this process keeps the stand-in's store and the client
    instance = Instance(backend, how != "cold", restartable=True)
    try:
        client = instance.connect(lease=False)
        # Segments of two granules, each grown by one: a run, and so a chunk, per segment. Mapped, so that after a
        # cold restart there is something to declare again.
        kv = ExtensibleTensor(chunks * 2 * GRANULE, "cpu" if backend == "host" else "cuda:0", num_segments=chunks,
                              client=client)
        kv.resize_per_segment_(GRANULE)
        with Reconnects(client.paths) as reconnects:
            calls = CallsInALoop(client)
            started = time.monotonic()
            daemon = instance.take_over() if how == "takeover" else instance.crash()
            serving = time.monotonic() - started
            time.sleep(0.5)
            gaps = calls.stop()
        restored = [line for line in daemon.log().splitlines()
                    if "restored:" in line or "took over from" in line or "declared again" in line]
        try:
            wait_until(lambda: client.status().num_chunks == chunks, timeout=30)
        except TimeoutError:
            complaints = [line for line in daemon.log().splitlines() if "WARNING" in line or "ERROR" in line]
            restored.append(f"{client.status().num_chunks} of {chunks} chunks back after 30 s; the daemon's log: "
                            + " | ".join(complaints))
            kv = None  # the daemon does not know it: nothing to free there
        if kv is not None:
            kv.free()
        client.close()
        return {"chunks": chunks, "how": how, "benchmark_fds_before": fds_before,
                "new_daemon_serving_s": round(serving, 3),
                "client_pause_s": round(max(gaps), 3), "calls": len(gaps), "failed_calls": len(calls.failures),
                **reconnects.figures(),
                "log": restored[-1] if restored else ""}
    finally:
        instance.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("host", "cuda"), default="host")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds of commit steps (default: 5; 0: pauses only)")
    parser.add_argument("--steps", type=int, default=200, help="2 MiB steps per round (default: 200)")
    parser.add_argument("--chunks", type=int, nargs="+", default=[10, 1000, 10000])
    parser.add_argument("--how", nargs="+", choices=HOWS, default=list(HOWS), help="which restarts to pause for")
    parser.add_argument("--out", type=Path,
                        default=None, help="result file (default: bench/results/<backend>-<date>-restart.json)")
    args = parser.parse_args()
    # The stand-in runs in this process and keeps every parked FD; its launcher moves them, twice as many at once.
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1 << 20, 1 << 20))
    except (ValueError, OSError):  # not root: as far as the hard limit goes
        resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
    out = args.out or RESULTS_DIR / f"{'h200' if args.backend == 'cuda' else 'host'}-{today_utc()}-restart.json"
    result = {"metadata": metadata(), "commits": commits(args.backend, args.rounds, args.steps) if args.rounds else {},
              "pauses": []}
    print(json.dumps(result["commits"], indent=1), flush=True)
    write_json(out, result)
    for chunks in args.chunks:
        for how in args.how:
            result["pauses"].append(pause(args.backend, chunks, how))
            print(json.dumps(result["pauses"][-1]), flush=True)
            write_json(out, result)  # a run cut short keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
