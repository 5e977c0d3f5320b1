"""What every hbmd benchmark shares: the daemon subprocess, timing, goals, metadata and the JSON result.

A benchmark script declares its cases on a :class:`Bench`; each case runs the
hbmd path and its in-process baseline side by side in the same process and
returns a dict of figures (and :func:`goal` verdicts). The result file is
rewritten after every case, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hbmd.proto.units import format_bytes
from hbmd.testing.spawn import DaemonProcess, LineProcess

BENCH_DIR = Path(__file__).resolve().parent
REPO_DIR = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"

MiB = 1 << 20
GiB = 1 << 30

DAEMON_START_TIMEOUT_S = 60.0
DAEMON_STOP_TIMEOUT_S = 20.0


# the daemon


class Daemon(DaemonProcess):
    """An ``hbmd`` subprocess serving from its own short run directory under /tmp, removed when it stops.

    ``command`` replaces ``python -m hbmd.daemon`` (the probed daemon of
    ``probe.py`` uses it).
    """

    def __init__(self, *args: str, command: list[str] | None = None) -> None:
        # Short and under /tmp: socket paths must fit in 108 bytes.
        run_dir = Path(tempfile.mkdtemp(prefix="hbmdb-", dir="/tmp"))
        super().__init__(run_dir, *args, command=command, log_path=run_dir / "hbmd.log")

    def stop(self, timeout: float = DAEMON_STOP_TIMEOUT_S) -> int:
        try:
            return super().stop(timeout)
        finally:
            shutil.rmtree(self.run_dir, ignore_errors=True)


class Worker(LineProcess):
    """A helper process (``workers.py``) that prints one line per step; killed on exit.

    The protocol: it prints ``ready`` once set up, waits for a line on stdin
    to start, and prints its result as one JSON line.
    """

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        super().__init__([str(BENCH_DIR / "workers.py"), *args], env)

    def wait_ready(self, timeout: float) -> None:
        line = self.readline(timeout)
        if line != "ready":
            raise RuntimeError(f"worker said {line!r} instead of ready: {self.stderr_tail()}")

    def go(self) -> None:
        self.send("go")

    def result(self, timeout: float) -> dict[str, Any]:
        return json.loads(self.readline(timeout))


@contextlib.contextmanager
def workers(arg_lists: list[list[str]], ready_timeout: float = 120.0) -> Iterator[list[Worker]]:
    """Start one worker per argument list, wait until all are ready; all are killed on exit."""
    started = [Worker(args) for args in arg_lists]
    try:
        for worker in started:
            worker.wait_ready(ready_timeout)
        yield started
    finally:
        for worker in started:
            worker.kill()


# timing


def now_ns() -> int:
    return time.perf_counter_ns()


def timed_ns(fn: Callable[[], Any]) -> int:
    """Nanoseconds ``fn()`` took."""
    start = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - start


def repeat_ns(fn: Callable[[], Any], n: int, warmup: int = 0) -> list[int]:
    """``n`` timings of ``fn()`` in nanoseconds, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    return [timed_ns(fn) for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linearly interpolated."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize_ns(samples: list[int]) -> dict[str, Any]:
    """p50/p99/mean/min/max of nanosecond samples, in microseconds."""
    us = [s / 1e3 for s in samples]
    return {
        "n": len(us),
        "p50_us": round(percentile(us, 50), 2),
        "p99_us": round(percentile(us, 99), 2),
        "mean_us": round(sum(us) / len(us), 2) if us else None,
        "min_us": round(min(us), 2) if us else None,
        "max_us": round(max(us), 2) if us else None,
    }


def ratio(hbmd: float | None, baseline: float | None) -> float | None:
    """hbmd ÷ baseline, rounded; None where either is missing or the baseline is zero."""
    if hbmd is None or not baseline:
        return None
    return round(hbmd / baseline, 4)


def side_by_side(hbmd_ns: list[int], baseline_ns: list[int]) -> dict[str, Any]:
    """Both summaries and the p50 ratio and difference."""
    h, b = summarize_ns(hbmd_ns), summarize_ns(baseline_ns)
    return {
        "hbmd": h,
        "in_process": b,
        "ratio_p50": ratio(h["p50_us"], b["p50_us"]),
        "added_p50_us": round(h["p50_us"] - b["p50_us"], 2),
    }


def goal(name: str, value: float | None, op: str, target: float, unit: str = "") -> dict[str, Any]:
    """A goal verdict; ``met`` is None where the value was not measured."""
    met = None if value is None else (value <= target if op == "<=" else value >= target)
    return {"goal": name, "value": value, "target": f"{op} {target}", "unit": unit, "met": met}


# process footprint


def process_footprint(pid: int) -> dict[str, Any]:
    """Resident memory, open FDs and threads of ``pid``, from /proc."""
    fields: dict[str, Any] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key.lower() + "_kib"] = int(value.split()[0])
            elif key == "Threads":
                fields["threads"] = int(value)
    fields["open_fds"] = len(os.listdir(f"/proc/{pid}/fd"))
    return fields


def cpu_seconds(pid: int) -> float:
    """The CPU time ``pid`` has used so far, user and system, every thread's (from /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def nvidia_smi(*args: str) -> str:
    """``nvidia-smi`` output, or "" where it is missing or fails."""
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def gpu_memory_by_pid() -> dict[int, int]:
    """MiB of GPU memory per process, as ``nvidia-smi --query-compute-apps`` lists them."""
    out = nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    usage: dict[int, int] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            usage[int(parts[0])] = int(parts[1]) if parts[1].isdigit() else -1
    return usage


def gpu_free_bytes(index: int = 0) -> int | None:
    """Bytes free on GPU ``index`` now, from nvidia-smi (asking makes no CUDA context); None without it."""
    out = nvidia_smi("-i", str(index), "--query-gpu=memory.free", "--format=csv,noheader,nounits").strip()
    return int(out) * MiB if out.isdigit() else None


def sized_to_card(sizes: list[int], copies: int, spare: int, index: int = 0) -> tuple[list[int], list[str]]:
    """The sizes of which ``copies`` at once, and ``spare`` bytes besides (contexts, the daemon's own), fit in what GPU
    ``index`` has free, and a line per size left out saying why: a bench sized on an H200 runs what an H100 holds
    and says what it skipped, rather than dying of out-of-memory halfway."""
    free = gpu_free_bytes(index)
    if free is None:
        return sizes, []
    kept, skipped = [], []
    for size in sizes:
        need = copies * size + spare
        if need <= free:
            kept.append(size)
        else:
            skipped.append(f"{format_bytes(size)}: needs {format_bytes(need)}, "
                           f"GPU {index} has {format_bytes(free)} free")
    for line in skipped:
        print(f"skipped {line}", flush=True)
    return kept, skipped


# metadata and results


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO_DIR), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def gpu_metadata(index: int = 0) -> dict[str, Any]:
    """Name, driver version and memory of GPU ``index`` from nvidia-smi (empty without it)."""
    out = nvidia_smi("-i", str(index), "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader,nounits")
    parts = [p.strip() for p in out.strip().split(",")]
    if len(parts) != 3:
        return {}
    return {"gpu_name": parts[0], "driver_version": parts[1], "gpu_memory_mib": int(parts[2])}


def metadata() -> dict[str, Any]:
    """Where and how this run happened, without the host name."""
    commit = _git("rev-parse", "HEAD")
    dirty = _git("status", "--porcelain") if commit else None
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": shlex.join(sys.orig_argv),
        "cwd_is_repo": Path.cwd().resolve() == REPO_DIR,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "versions": {
            "hbmd": _version("hbmd"),
            "torch": _version("torch"),
            "cuda-bindings": _version("cuda-bindings"),
            "pyzmq": _version("pyzmq"),
            "msgpack": _version("msgpack"),
        },
        "git_commit": commit,
        "git_dirty": bool(dirty) if dirty is not None else None,
    }


def today_utc() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


# the runner


Case = Callable[[Any], dict[str, Any]]


class Bench:
    """A named set of cases run in order against one context, with a JSON result.

    ``setup(args)`` is a context manager that yields the context every case
    gets (the daemon, a client, repetition counts...). A case that raises is
    recorded with its traceback and the next one runs.
    """

    def __init__(self, name: str, description: str) -> None:
        self.name = name
        self.description = description
        self.cases: dict[str, Case] = {}

    def case(self, name: str) -> Callable[[Case], Case]:
        def register(fn: Case) -> Case:
            self.cases[name] = fn
            return fn

        return register

    def parser(self, default_out: Path) -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(description=self.description)
        parser.add_argument("--out", type=Path, default=default_out, help=f"result JSON (default: {default_out})")
        parser.add_argument("--quick", action="store_true", help="few repetitions: a smoke run of every case")
        parser.add_argument("--cases", help=f"comma-separated subset of: {','.join(self.cases)}")
        return parser

    def run(
        self,
        args: argparse.Namespace,
        setup: Callable[[argparse.Namespace], contextlib.AbstractContextManager],
        describe: Callable[[Any], dict[str, Any]],
    ) -> int:
        """Run the selected cases; returns the exit status (1 if any case failed).

        ``describe(context)`` adds what only the context knows (the GPU, the
        granule) to the result's metadata.
        """
        selected = list(self.cases) if not args.cases else [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = [c for c in selected if c not in self.cases]
        if unknown:
            print(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(self.cases)}", file=sys.stderr)
            return 2
        result: dict[str, Any] = {
            "bench": self.name,
            "quick": args.quick,
            "meta": metadata(),
            "cases": {},
            "goals": [],
        }
        out: Path = args.out
        failed = False
        print(f"{self.name}: cases {', '.join(selected)} -> {out}", flush=True)
        with setup(args) as context:
            result["meta"].update(describe(context))
            write_json(out, result)
            for name in selected:
                start = time.monotonic()
                print(f"--- {name}", flush=True)
                try:
                    figures = self.cases[name](context)
                except Exception:
                    figures = {"error": traceback.format_exc()}
                    failed = True
                    print(figures["error"], file=sys.stderr, flush=True)
                figures["wall_s"] = round(time.monotonic() - start, 2)
                for verdict in figures.get("goals", []):
                    result["goals"].append({"case": name, **verdict})
                result["cases"][name] = figures
                print(json.dumps(figures, default=str)[:3000], flush=True)
                write_json(out, result)
        print_goals(result["goals"])
        print(f"wrote {out}", flush=True)
        return 1 if failed else 0


def print_goals(goals: list[dict[str, Any]]) -> None:
    if not goals:
        return
    print(f"{'case':<16} {'goal':<48} {'value':>12} {'target':>10}  verdict")
    for g in goals:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[g["met"]]
        value = "-" if g["value"] is None else f"{g['value']}{g['unit']}"
        print(f"{g['case']:<16} {g['goal']:<48} {value:>12} {g['target']:>10}  {verdict}")
