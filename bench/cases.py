"""The measurements both benchmarks make, on whichever backend the :class:`Target` serves.

Each runs the hbmd path (:class:`hbmd.client.ExtensibleTensor` through the
daemon) and the in-process baseline (``baseline.py``) the same number of
times, interleaved with the order swapped every repetition, and returns the
two summaries with their ratio. Goals are the caller's: they differ per
device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common import (
    BENCH_DIR,
    Bench,
    Daemon,
    cpu_seconds,
    goal,
    now_ns,
    percentile,
    ratio,
    repeat_ns,
    side_by_side,
    summarize_ns,
    timed_ns,
    workers,
)
from hbmd.client import Client, ExtensibleTensor, connect
from hbmd.client.env import spin_from_env
from hbmd.proto.units import format_bytes
from probe import turns
from workers import echo_round_trips


@dataclasses.dataclass
class Target:
    """What every case gets: the daemon, a session with it, and how to build the baseline."""

    quick: bool
    daemon: Daemon
    client: Client
    device: str
    """``cuda:N`` or ``cpu``, as ExtensibleTensor takes it."""
    granule: int
    in_process: Callable[[int], Any]
    """A baseline buffer of the given capacity (``baseline.py``)."""
    sync: Callable[[], None]
    """Wait for the device: the end of every timed commit."""
    handover: Callable[[int], Any] | None = None
    """The baseline that also hands each chunk's FD to another process before its commit returns: the floor of a
    commit that outlives the process making it (``baseline.py``); None where the bench does not measure it."""
    granted: Callable[[], contextlib.AbstractContextManager[Callable[[int], Any]]] | None = None
    """A process granting chunks made ahead, alive within the ``with`` block, and the baseline buffers it grows by a
    round trip each (``baseline.granted_buffers``): the floor of a commit through a daemon; None where the bench does
    not measure it."""

    def reps(self, full: int, quick: int) -> int:
        return quick if self.quick else full

    def connect(self, name: str, daemon: Daemon | None = None, **kwargs: Any) -> Client:
        return connect(self.device, run_dir=(daemon or self.daemon).run_dir, client_name=name, **kwargs)

    def tensor(self, capacity: int, client: Client | None = None, **kwargs: Any) -> ExtensibleTensor:
        return ExtensibleTensor(capacity, self.device, client=client or self.client, **kwargs)


def pair(index: int, hbmd: Callable[[], Any], baseline: Callable[[], Any]) -> tuple[Any, Any]:
    """Run both, the order swapped on every other call so neither always runs second."""
    if index % 2:
        b = baseline()
        return hbmd(), b
    h = hbmd()
    return h, baseline()


def grow_in_steps(grow: Callable[[int], Any], size: int, step: int) -> None:
    """Commit ``size`` bytes ``step`` at a time: one chunk per step."""
    for end in range(step, size + 1, step):
        grow(end)


# commit


def fresh_commit_hbmd(t: Target, size: int) -> tuple[int, int]:
    """(commit, buffer creation + commit) in ns: ``resize_per_segment_(size, zero_new=True)`` of a new buffer,
    synchronized."""
    t0 = now_ns()
    tensor = t.tensor(size)
    t1 = now_ns()
    tensor.resize_per_segment_(size, zero_new=True)
    t.sync()
    t2 = now_ns()
    tensor.free()
    return t2 - t1, t2 - t0


def fresh_commit_in_process(t: Target, size: int, make: Callable[[int], Any] | None = None) -> tuple[int, int]:
    """(commit, reservation + commit) in ns: the same work in this process, synchronized (in a buffer of ``make``, by
    default ``t.in_process``)."""
    t0 = now_ns()
    buffer = (make or t.in_process)(size)
    t1 = now_ns()
    buffer.commit(size)
    t.sync()
    t2 = now_ns()
    buffer.free()
    return t2 - t1, t2 - t0


def fresh_commits(t: Target, reps: dict[int, tuple[int, int]], handover_up_to: int = 0) -> list[dict[str, Any]]:
    """Per size (``{bytes: (full reps, quick reps)}``): a new buffer grown to it in one commit.

    With ``t.handover``, sizes up to ``handover_up_to`` bytes measure the
    floor too (the in-process commit that hands its chunk to another
    process), each repetition's three in a rotated order.
    """
    sides: dict[str, Callable[[int], tuple[int, int]]] = {
        "hbmd": lambda size: fresh_commit_hbmd(t, size),
        "in_process": lambda size: fresh_commit_in_process(t, size),
    }
    if t.handover is not None:
        handover = t.handover
        sides["handover_floor"] = lambda size: fresh_commit_in_process(t, size, handover)
    sizes = []
    for size, counts in reps.items():
        n = t.reps(*counts)
        names = [name for name in sides if name != "handover_floor" or size <= handover_up_to]
        for name in names:
            # Untimed: a session's first commit of a new size goes through the daemon, which then grants credit for it.
            sides[name](size)
        runs: list[dict[str, tuple[int, int]]] = []
        for i in range(n):
            order = names[i % len(names):] + names[: i % len(names)]
            runs.append({name: sides[name](size) for name in order})
        entry = {
            "bytes": size,
            "label": format_bytes(size),
            "reps": n,
            "commit": side_by_side([r["hbmd"][0] for r in runs], [r["in_process"][0] for r in runs]),
            "with_buffer_creation": side_by_side([r["hbmd"][1] for r in runs], [r["in_process"][1] for r in runs]),
            # Each repetition in the order its sides ran: a large free can slow the allocation after it.
            "runs_ms": [{name: round(r[name][0] / 1e6, 3) for name in r} for r in runs],
        }
        line = (f"  {entry['label']:>9}: hbmd {entry['commit']['hbmd']['p50_us']} µs, in-process "
                f"{entry['commit']['in_process']['p50_us']} µs, ratio {entry['commit']['ratio_p50']}")
        if "handover_floor" in names:
            floor = summarize_ns([r["handover_floor"][0] for r in runs])
            entry["handover_floor"] = {
                "commit": floor,
                "ratio_p50_to_in_process": ratio(floor["p50_us"], entry["commit"]["in_process"]["p50_us"]),
                "hbmd_ratio_p50_to_floor": ratio(entry["commit"]["hbmd"]["p50_us"], floor["p50_us"]),
            }
            line += (f"; handover floor {floor['p50_us']} µs, "
                     f"ratio {entry['handover_floor']['ratio_p50_to_in_process']}"
                     f", hbmd ÷ floor {entry['handover_floor']['hbmd_ratio_p50_to_floor']}")
        print(line, flush=True)
        sizes.append(entry)
    return sizes


def step_commits(
    t: Target, n: int, client: Client | None = None, floor: Callable[[int], Any] | None = None
) -> dict[str, Any]:
    """``n`` successive one-granule commits to one buffer: one new chunk each.

    ``round_trips`` counts the commits that went to the daemon; the others
    placed leased granules (the daemon refills the lease while the baseline's
    commit runs, as it would while an engine computes). ``floor``: a third
    side, a buffer of the given capacity grown the same way (``round_trip_floor``);
    each step's sides run in a rotated order (with two, hbmd first every other step).
    """
    step = t.granule
    tensor = t.tensor(n * step, client=client)
    buffers = {"in_process": t.in_process(n * step)}
    if floor is not None:
        buffers["round_trip_floor"] = floor(n * step)
    sides: dict[str, Callable[[int], Any]] = {"hbmd": lambda size: tensor.resize_per_segment_(size, zero_new=True)}
    sides.update((name, buffer.commit) for name, buffer in buffers.items())
    names = list(sides)
    samples: dict[str, list[int]] = {name: [] for name in names}
    sent = tensor.client.requests_sent
    try:
        for i in range(n):
            size = (i + 1) * step
            for name in names[i % len(names):] + names[: i % len(names)]:
                samples[name].append(timed_ns(lambda: (sides[name](size), t.sync())))
        chunks = {"hbmd": tensor.num_chunks}
        round_trips = tensor.client.requests_sent - sent
    finally:
        tensor.free()
        for buffer in buffers.values():
            buffer.free()
    figures = {"commits": n, "step_bytes": step, "chunks": chunks, "round_trips": round_trips,
               **side_by_side(samples["hbmd"], samples["in_process"])}
    if floor is not None:
        summary = summarize_ns(samples["round_trip_floor"])
        figures["round_trip_floor"] = {
            **summary,
            "added_p50_us": round(summary["p50_us"] - figures["in_process"]["p50_us"], 2),
            "hbmd_added_over_floor_p50_us": round(figures["hbmd"]["p50_us"] - summary["p50_us"], 2),
        }
    return figures


def step_commits_without_lease(t: Target, n: int) -> dict[str, Any]:
    """:func:`step_commits` for a session without leases: every commit a round trip (what an empty lease costs), beside
    the round trip's floor where the bench measures it (``t.granted``)."""
    client = t.connect("no-lease", lease=False)
    try:
        with t.granted() if t.granted is not None else contextlib.nullcontext() as floor:
            return step_commits(t, n, client, floor)
    finally:
        client.close()


# release and recommit


def release_recommit_hbmd(t: Target, size: int) -> tuple[int, int]:
    """(release_physical, grow back with zeroing) in ns, on a buffer committed in one call."""
    tensor = t.tensor(size)
    tensor.resize_per_segment_(size, zero_new=True)
    t.sync()
    t0 = now_ns()
    tensor.release_physical()
    t1 = now_ns()
    tensor.resize_per_segment_(size, zero_new=True)
    t.sync()
    t2 = now_ns()
    tensor.free()
    return t1 - t0, t2 - t1


def release_recommit_in_process(t: Target, size: int) -> tuple[int, int]:
    buffer = t.in_process(size)
    buffer.commit(size)
    t0 = now_ns()
    buffer.release()
    t1 = now_ns()
    buffer.commit(size)
    t.sync()
    t2 = now_ns()
    buffer.free()
    return t1 - t0, t2 - t1


def release_recommit(t: Target, size: int, n: int) -> dict[str, Any]:
    runs = [pair(i, lambda: release_recommit_hbmd(t, size), lambda: release_recommit_in_process(t, size))
            for i in range(n)]
    return {
        "bytes": size,
        "label": format_bytes(size),
        "reps": n,
        "release": side_by_side([h[0] for h, _ in runs], [b[0] for _, b in runs]),
        "recommit": side_by_side([h[1] for h, _ in runs], [b[1] for _, b in runs]),
        "release_plus_recommit": side_by_side([sum(h) for h, _ in runs], [sum(b) for _, b in runs]),
    }


# control plane


def status_round_trips(t: Target, n: int) -> dict[str, Any]:
    """``client.status()`` against a bare ZeroMQ echo of the same request: what the daemon's work adds. The echo's
    caller sleeps for the reply; a second echo's polls for it first, as hbmd's client does (``HBMD_SPIN_US``): what
    is left against that one is the daemon's and the client's own work."""
    status = summarize_ns(repeat_ns(t.client.status, n, warmup=50))
    floor = echo_round_trips(n)
    spinning = echo_round_trips(n, spin=spin_from_env())
    return {
        "status": status,
        "zmq_echo_floor": floor,
        "status_over_floor_p50": ratio(status["p50_us"], floor["p50_us"]),
        "zmq_echo_floor_polling": spinning,
        "status_over_polling_floor_p50": ratio(status["p50_us"], spinning["p50_us"]),
    }


def status_as_they_grow(
    t: Target, n: int, what: str, counts: tuple[int, ...], add: Callable[[], Any], held: int = 0
) -> dict[str, Any]:
    """``client.status()`` p50, and the daemon's CPU per status (every thread's, ZeroMQ's too), at each of ``counts``
    of ``what``, ``held`` of them there from the start and ``add()`` making one more: what each adds to a request,
    which should be nothing. Goal: the last p50 within 1.25 of the first (our threshold)."""
    points = []
    for count in counts:
        while held < count:
            add()
            held += 1
        before = cpu_seconds(t.daemon.pid)
        status = summarize_ns(repeat_ns(t.client.status, n, warmup=20))
        cpu_us = round((cpu_seconds(t.daemon.pid) - before) / (n + 20) * 1e6, 1)
        print(f"  {count:>5} {what}: status p50 {status['p50_us']} µs, the daemon's CPU {cpu_us} µs a status",
              flush=True)
        points.append({what: count, "status": status, "daemon_cpu_us_per_status": cpu_us})
    first, last = points[0], points[-1]
    growth = ratio(last["status"]["p50_us"], first["status"]["p50_us"])
    return {
        "points": points,
        "status_p50_growth": growth,
        "daemon_cpu_growth": ratio(last["daemon_cpu_us_per_status"], first["daemon_cpu_us_per_status"]),
        "goals": [goal(f"status p50 with {last[what]} ÷ with {first[what]} {what}", growth, "<=", 1.25)],
    }


def status_by_buffers(t: Target) -> dict[str, Any]:
    """Status while a second session holds 1, 100 and 1,000 buffers (one granule of capacity, none committed)."""
    holder = t.connect("status-by-buffers")
    try:
        return status_as_they_grow(t, t.reps(1000, 200), "buffers", (1, 100, 1000),
                                   lambda: holder.create_buffer(t.granule))
    finally:
        holder.close()


def status_by_sessions(t: Target) -> dict[str, Any]:
    """Status while 1, 32 and 100 sessions are connected, all but the caller idle (sessions of this process; up to 100:
    the daemon's default cap is 128 a uid)."""
    idle: list[Client] = []
    try:
        return status_as_they_grow(t, t.reps(2000, 300), "sessions", (1, 32, 100),
                                   lambda: idle.append(t.connect(f"idle-{len(idle)}")), held=1)
    finally:
        for client in idle:
            client.close()


def add_status_cases(bench: Bench) -> None:
    """The cases both benches run alike: status as buffers and sessions accumulate."""
    bench.case("status_by_buffers")(status_by_buffers)
    bench.case("status_by_sessions")(status_by_sessions)


def commit_worker_args(daemon: Daemon, device: str) -> list[str]:
    """``workers.py commit`` on ``daemon``'s ``device`` (an ordinal, or ``cpu``), buffers of 1 GiB."""
    return ["commit", "--run-dir", str(daemon.run_dir), "--device", device, "--capacity", str(1 << 30)]


def run_workers(pool: list[Any], mode: str, seconds: float) -> dict[str, Any]:
    """Have the ``workers.py commit`` workers of ``pool`` commit (``hbmd``, ``in_process`` or a handover mode) for
    ``seconds``, all at once: commits/s of all together, the median of their p50s and the worst of their p99s."""
    for worker in pool:
        worker.send(f"{mode} {seconds}")
    answers = [worker.result(seconds + 120) for worker in pool]
    return {
        "commits_per_s": round(sum(a["commits"] / a["elapsed_s"] for a in answers), 1),
        "commit_p50_us": round(percentile([a["p50_us"] for a in answers], 50), 2),
        "commit_p99_us_worst": max(a["p99_us"] for a in answers),
    }


def concurrent_commits(t: Target, device: str, clients: tuple[int, ...], seconds: float,
                       handover: bool = False) -> list[dict[str, Any]]:
    """For each count of ``clients``: that many worker processes (``workers.py commit --device DEVICE``) committing
    2 MiB steps as fast as they can for ``seconds``, through hbmd and in-process in turn, and with ``handover``
    in-process exporting each chunk to another process too (the floor of a commit that outlives its worker), and
    to one that imports it (the floor where one process makes a chunk and another checks or maps it, as every
    commit through hbmd has: the daemon makes a leased granule and the client imports it, or the client makes one on
    credit and the daemon imports it to check it); the order rotates from one count to the next
    (:func:`run_workers`)."""
    args = commit_worker_args(t.daemon, device)
    modes = ["hbmd", "in_process"] + (["handover", "handover_imported"] if handover else [])
    points = []
    with workers([args] * max(clients), ready_timeout=240) as pool:
        for k, count in enumerate(clients):
            point: dict[str, Any] = {"clients": count, "seconds": seconds}
            for mode in modes[k % len(modes):] + modes[:k % len(modes)]:
                point[mode] = run_workers(pool[:count], mode, seconds)
            point["ratio_commits_per_s"] = ratio(point["hbmd"]["commits_per_s"], point["in_process"]["commits_per_s"])
            if handover:
                point["handover_over_in_process"] = ratio(point["handover"]["commits_per_s"],
                                                          point["in_process"]["commits_per_s"])
                point["hbmd_over_handover"] = ratio(point["hbmd"]["commits_per_s"], point["handover"]["commits_per_s"])
                point["handover_imported_over_in_process"] = ratio(point["handover_imported"]["commits_per_s"],
                                                                   point["in_process"]["commits_per_s"])
                point["hbmd_over_handover_imported"] = ratio(point["hbmd"]["commits_per_s"],
                                                             point["handover_imported"]["commits_per_s"])
            print(f"  {count:>2} clients: {point}", flush=True)
            points.append(point)
    return points


@contextlib.contextmanager
def probed_daemon(*daemon_args: str) -> Iterator[tuple[Daemon, list[tuple[str, int, int]]]]:
    """A daemon with its steps probed (``python probe.py``), and the list its events (``probe.Event``) are put in
    once it has stopped, as the block ends."""
    with tempfile.NamedTemporaryFile(prefix="hbmdb-events-", suffix=".json", dir="/tmp", delete=False) as f:
        events_path = Path(f.name)
    command = [sys.executable, str(BENCH_DIR / "probe.py"), "--events", str(events_path)]
    events: list[tuple[str, int, int]] = []
    try:
        with Daemon(*daemon_args, command=command) as probed:
            yield probed, events
        events.extend(tuple(e) for e in json.loads(events_path.read_text()))
    finally:
        events_path.unlink(missing_ok=True)


def turns_under_load(daemon_args: list[str], device: str, clients: int, seconds: float) -> dict[str, Any]:
    """The turns of a probed daemon (started with ``daemon_args``) while ``clients`` workers commit 2 MiB steps
    through it as fast as they can for ``seconds``: how long they took and what filled the longest
    (:func:`probe.turns`); a request waits for the turn it arrives in to end."""
    with probed_daemon(*daemon_args) as (probed, events):
        with workers([commit_worker_args(probed, device)] * clients, ready_timeout=240) as pool:
            begin = time.monotonic_ns()
            figures = run_workers(pool, "hbmd", seconds)
            end = time.monotonic_ns()
    return {"clients": clients, "seconds": seconds, **figures, **turns(events, begin, end)}
