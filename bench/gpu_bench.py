"""hbmd on a GPU against the in-process baseline, side by side in one run.

    python3 bench/gpu_bench.py [--quick] [--cases commit,bandwidth] [--out bench/results/h200-DATE.json]

Starts its own daemon (``python -m hbmd.daemon --backend cuda --device 0``
in a short /tmp run directory), runs every case with the hbmd path and its
in-process baseline interleaved (the order swapped on every repetition),
and writes the figures, the ratios hbmd ÷ baseline and the goal verdicts to
JSON. bench/README.md says what each case measures.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from baseline import CudaInProcessBuffer, fd_sink, granted_buffers
from cases import (
    Target,
    add_status_cases,
    concurrent_commits,
    fresh_commits,
    grow_in_steps,
    pair,
    probed_daemon,
    release_recommit,
    status_round_trips,
    step_commits,
    step_commits_without_lease,
    turns_under_load,
)
from common import (
    RESULTS_DIR,
    Bench,
    Daemon,
    GiB,
    MiB,
    goal,
    gpu_memory_by_pid,
    gpu_metadata,
    now_ns,
    percentile,
    process_footprint,
    ratio,
    repeat_ns,
    side_by_side,
    sized_to_card,
    summarize_ns,
    timed_ns,
    today_utc,
    workers,
)
from hbmd import driver
from hbmd.client import Client, ExtensibleTensor, connect
from hbmd.client.dlpack import KDL_CUDA, uint8_view
from hbmd.daemon.options import DEFAULT_WARM_CHUNKS
from hbmd.proto.units import format_bytes
from probe import breakdown, client_probe
from workers import has_pattern, write_pattern

DEVICE = 0
"""nvidia-smi index of the GPU the daemon serves, and this process's CUDA ordinal for it."""

bench = Bench("gpu", "hbmd on a GPU against the in-process baseline, side by side")

CARD_SPARE = 2 * GiB
"""What a size needs on the card besides itself: this process's context and the daemon's warm chunks."""


def on_this_card(reps: dict[int, tuple[int, int]]) -> tuple[dict[int, tuple[int, int]], list[str]]:
    """The sizes of ``reps`` one buffer of which fits on the GPU (the sides run one after the other), and why the
    others were left out."""
    kept, skipped = sized_to_card(list(reps), copies=1, spare=CARD_SPARE, index=DEVICE)
    return {size: reps[size] for size in kept}, skipped


# commit


COMMIT_REPS = {2 * MiB: (30, 3), 64 * MiB: (21, 3), 1 * GiB: (12, 3), 8 * GiB: (6, 3), 64 * GiB: (4, 2)}
"""Repetitions per size, a multiple of the sides in the rotation (three up to :data:`HANDOVER_UP_TO`, then two), so
that each side runs first, second (and third) as often: an allocation that follows a free of the same size can take a
tenth of the time (64 GiB on the H200: ~20 ms after one, 200-330 ms otherwise, whichever process makes it)."""


COMMIT_GOALS = {2 * MiB: 1.5, 64 * MiB: 2.0, 1 * GiB: 1.3}
"""The most a single commit of a size may cost, hbmd ÷ in-process p50; 1.05 from 8 GiB on."""
HANDOVER_UP_TO = 16 * GiB
"""The largest commit credit serves (``hbmd --credit``'s default): the sizes whose floor is a handover."""


@bench.case("commit")
def commit_case(t: Target) -> dict[str, Any]:
    reps, skipped = on_this_card(COMMIT_REPS)
    sizes = fresh_commits(t, reps, HANDOVER_UP_TO)
    goals = [
        goal(f"a single {s['label']} commit, hbmd/in-process p50", s["commit"]["ratio_p50"], "<=",
             COMMIT_GOALS.get(s["bytes"], 1.05))
        for s in sizes
    ]
    return {"sizes": sizes, "skipped": skipped, "goals": goals}


@bench.case("commit_2mib_steps")
def commit_steps_case(t: Target) -> dict[str, Any]:
    figures = step_commits(t, t.reps(1000, 200))
    figures["goals"] = [
        goal("1,000 successive 2 MiB commits, lease warm, hbmd/in-process p50", figures["ratio_p50"], "<=", 1.0)
    ]
    return figures


@bench.case("commit_2mib_steps_no_lease")
def commit_steps_no_lease_case(t: Target) -> dict[str, Any]:
    figures = step_commits_without_lease(t, t.reps(1000, 200))
    figures["goals"] = [
        goal("a 2 MiB commit with the lease empty adds (p50)", figures["added_p50_us"], "<=", 300, " µs")
    ]
    return figures


RECOMMIT_BYTES = 64 * GiB


@bench.case("recommit")
def recommit_case(t: Target) -> dict[str, Any]:
    fits, skipped = on_this_card({RECOMMIT_BYTES: (11, 2)})
    if skipped:
        return {"skipped": skipped}
    figures = release_recommit(t, RECOMMIT_BYTES, t.reps(*fits[RECOMMIT_BYTES]))
    figures["goals"] = [goal(f"release + recommit {figures['label']}, hbmd/in-process p50",
                             figures["release_plus_recommit"]["ratio_p50"], "<=", 1.10)]
    return figures


# bandwidth


BANDWIDTH_BYTES = 8 * GiB


def copy_seconds(view: Any, half: int) -> float:
    """One device-to-device copy of the first half of ``view`` onto its second half, timed with CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    view[half : 2 * half].copy_(view[:half])
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@bench.case("bandwidth")
def bandwidth_case(t: Target) -> dict[str, Any]:
    import torch

    size, half, step = BANDWIDTH_BYTES, BANDWIDTH_BYTES // 2, t.granule
    reps = t.reps(10, 3)
    views: dict[str, Any] = {}
    tensors: list[ExtensibleTensor] = []
    in_process = t.in_process(size)
    figures: dict[str, Any] = {"bytes_copied": half, "reps": reps}
    try:
        views["torch_empty"] = torch.empty(size, dtype=torch.uint8, device=f"cuda:{DEVICE}")

        one = t.tensor(size)
        tensors.append(one)
        one.resize_per_segment_(size, zero_new=True)
        views["hbmd_one_chunk"] = one.full_view()

        steps = t.tensor(size)
        tensors.append(steps)
        grow_in_steps(lambda n: steps.resize_(n, zero_new=True), size, step)
        views["hbmd_2mib_steps"] = steps.full_view()

        grow_in_steps(in_process.commit, size, step)
        views["in_process_2mib_steps"] = uint8_view(in_process.base, size, KDL_CUDA, DEVICE)
        figures["chunks"] = {"hbmd_one_chunk": one.num_chunks, "hbmd_2mib_steps": steps.num_chunks,
                             "in_process_2mib_steps": in_process.num_chunks}

        if hasattr(ExtensibleTensor, "defragment"):
            defragmented = t.tensor(size)
            tensors.append(defragmented)
            grow_in_steps(lambda n: defragmented.resize_(n, zero_new=True), size, step)
            write_pattern(defragmented.full_view(), size)
            chunks_before = defragmented.num_chunks
            figures["defragment_ms"] = timed_ns(lambda: (defragmented.defragment(preserve=True), t.sync())) / 1e6
            figures["defragment_chunks"] = [chunks_before, defragmented.num_chunks]
            figures["defragment_data_intact"] = has_pattern(defragmented.full_view(), size)
            views["hbmd_2mib_steps_defragmented"] = defragmented.full_view()
        else:
            figures["hbmd_2mib_steps_defragmented"] = "not available: ExtensibleTensor.defragment is missing"

        for view in views.values():
            copy_seconds(view, half)
            copy_seconds(view, half)
        samples: dict[str, list[float]] = {name: [] for name in views}
        names = list(views)
        for rep in range(reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                samples[name].append(copy_seconds(views[name], half))
        # Bytes read plus bytes written per second, as copy bandwidth is usually quoted.
        tbps = {name: round(2 * half / percentile(s, 50) / 1e12, 3) for name, s in samples.items()}
        figures["copy_tb_per_s_p50"] = tbps
        figures["ratio_to_torch_empty"] = {name: ratio(v, tbps["torch_empty"]) for name, v in tbps.items()}
    finally:
        views.clear()
        for tensor in tensors:
            tensor.free()
        in_process.free()
        # Hand torch.empty's block back, or nvidia-smi counts it against this process for the rest of the run.
        torch.cuda.empty_cache()
    ratios = figures["ratio_to_torch_empty"]
    figures["goals"] = [goal("copy bandwidth, hbmd one-chunk/torch.empty", ratios["hbmd_one_chunk"], ">=", 0.99)]
    if "hbmd_2mib_steps_defragmented" in ratios:
        figures["goals"].append(
            goal("copy bandwidth, hbmd defragmented/torch.empty", ratios["hbmd_2mib_steps_defragmented"], ">=", 0.99)
        )
    return figures


# re-attach


REATTACH_BYTES = 64 * GiB
REATTACH_NAME = "bench-kv"


def wait_for_sessions(client: Client, count: int, timeout: float = 10.0) -> None:
    """Until the daemon has seen every other session end (the buffer is orphaned again)."""
    deadline = time.monotonic() + timeout
    while len(client.sessions()) > count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon still lists {len(client.sessions())} sessions after {timeout:.0f}s")
        time.sleep(0.01)


@bench.case("reattach")
def reattach_case(t: Target) -> dict[str, Any]:
    if not hasattr(ExtensibleTensor, "attach"):
        return {"status": "not available: ExtensibleTensor.attach is missing"}
    size = REATTACH_BYTES
    skipped = on_this_card({size: (1, 1)})[1]
    if skipped:
        return {"skipped": skipped}
    owner = t.connect("bench-kv-owner")
    tensor = t.tensor(size, client=owner, name=REATTACH_NAME, persistent=True)
    figures: dict[str, Any] = {"bytes": size}
    try:
        figures["commit_ms"] = timed_ns(lambda: (tensor.resize_per_segment_(size, zero_new=True), t.sync())) / 1e6
        if hasattr(ExtensibleTensor, "defragment"):
            tensor.defragment(preserve=True)
        write_pattern(tensor.full_view(), size)
        figures["chunks"] = tensor.num_chunks
    finally:
        # Closing the session orphans the persistent buffer; then this process lets go of its mapping.
        owner.close()
        tensor.free()
    sessions = len(t.client.sessions())
    processes, cycles = t.reps(3, 1), t.reps(3, 2)
    results = []
    try:
        for _ in range(processes):
            args = ["attach", "--run-dir", str(t.daemon.run_dir), "--name", REATTACH_NAME, "--cycles", str(cycles)]
            with workers([args]) as (worker,):
                worker.go()
                results.append(worker.result(120))
                worker.proc.wait(30)
            wait_for_sessions(t.client, sessions)
    finally:
        wait_for_sessions(t.client, sessions)
        t.client.delete(REATTACH_NAME)
    cold = [r["cycles"][0] for r in results]
    warm = [c for r in results for c in r["cycles"][1:]]

    def medians(rows: list[dict[str, Any]]) -> dict[str, Any]:
        if not rows:
            return {}
        keys = ("connect_ms", "attach_ms", "total_ms")
        return {key: round(percentile([r[key] for r in rows], 50), 3) for key in keys}

    figures.update({
        "new_process": {"n": len(cold), **medians(cold)},
        "same_process_again": {"n": len(warm), **medians(warm)},
        "data_intact": all(c["data_intact"] for r in results for c in r["cycles"]),
        "attached_chunks": sorted({c["num_chunks"] for r in results for c in r["cycles"]}),
        "runs": results,
    })
    figures["goals"] = [goal(f"re-attach {format_bytes(size)} in a new process (connect+import+map, p50)",
                             figures["new_process"].get("total_ms"), "<=", 50, " ms")]
    return figures


# control plane


CONCURRENT_CLIENTS = (1, 4, 16)


@bench.case("control")
def control_case(t: Target) -> dict[str, Any]:
    figures = status_round_trips(t, t.reps(2000, 300))
    concurrency = concurrent_commits(t, str(DEVICE), CONCURRENT_CLIENTS, 1.0 if t.quick else 3.0, handover=True)
    figures["concurrent_2mib_commits"] = concurrency
    figures["goals"] = [
        goal("status() round trip p50 / ZeroMQ echo p50", figures["status_over_floor_p50"], "<=", 1.3),
        goal(f"2 MiB commits/s with {concurrency[-1]['clients']} clients, hbmd/in-process",
             concurrency[-1]["ratio_commits_per_s"], ">=", 0.9),
    ]
    return figures


add_status_cases(bench)


@bench.case("turns")
def turns_case(t: Target) -> dict[str, Any]:
    """The daemon's turns with 16 clients committing at once, and what fills the longest (a probed daemon)."""
    return turns_under_load(["--backend", "cuda", "--device", str(DEVICE)], str(DEVICE), CONCURRENT_CLIENTS[-1],
                            1.0 if t.quick else 3.0)


# footprint and scale


FOOTPRINT_CHUNKS = 10_000


def daemon_gpu_mib(pid: int) -> dict[str, Any]:
    usage = gpu_memory_by_pid()
    return {"listed": pid in usage, "mib": usage.get(pid, 0)}


@bench.case("footprint")
def footprint_case(t: Target) -> dict[str, Any]:
    step = t.granule
    with Daemon("--backend", "cuda", "--device", str(DEVICE)) as fresh:
        figures: dict[str, Any] = {
            "daemon_idle": process_footprint(fresh.pid),
            "daemon_gpu_memory_idle_mib": daemon_gpu_mib(fresh.pid),
        }
        client = t.connect("bench-footprint", fresh)
        try:
            figures["daemon_one_session"] = process_footprint(fresh.pid)
            tensor = t.tensor(FOOTPRINT_CHUNKS * 2 * step, client=client, num_segments=FOOTPRINT_CHUNKS)
            figures["commit_10k_chunks_ms"] = timed_ns(
                lambda: (tensor.resize_per_segment_(step, zero_new=True), t.sync())
            ) / 1e6
            figures["chunks"] = tensor.num_chunks
            figures["committed_bytes"] = tensor.physical_bytes
            figures["daemon_10k_chunks"] = process_footprint(fresh.pid)
            figures["bench_process_10k_chunks"] = process_footprint(os.getpid())
            figures["gpu_memory_mib"] = {
                "daemon": daemon_gpu_mib(fresh.pid),
                "bench_process": gpu_memory_by_pid().get(os.getpid(), 0),
            }
            tensor.free()
            figures["daemon_after_free"] = process_footprint(fresh.pid)
        finally:
            client.close()
    added_fds = figures["daemon_10k_chunks"]["open_fds"] - figures["daemon_one_session"]["open_fds"]
    added_rss = figures["daemon_10k_chunks"]["vmrss_kib"] - figures["daemon_one_session"]["vmrss_kib"]
    figures["daemon_fds_added_by_10k_chunks"] = added_fds
    figures["daemon_rss_bytes_per_chunk"] = round(added_rss * 1024 / FOOTPRINT_CHUNKS, 1)
    figures["goals"] = [
        goal("daemon GPU memory (nvidia-smi)", figures["gpu_memory_mib"]["daemon"]["mib"], "<=", 0, " MiB"),
        goal("daemon FDs added by a 10,000-chunk buffer", added_fds, "<=", 0),
    ]
    return figures


SCALE_POINTS = (10, 100, 1000, 10_000)


@bench.case("scale")
def scale_case(t: Target) -> dict[str, Any]:
    step, k = t.granule, t.reps(50, 20)
    capacity = (SCALE_POINTS[-1] + k * len(SCALE_POINTS) + 1) * step
    tensor, buffer = t.tensor(capacity), t.in_process(capacity)
    points = []
    size = 0
    try:
        for target in SCALE_POINTS:
            while tensor.num_chunks < target:
                size += step
                tensor.resize_(size)
                buffer.commit(size, zero=False)
            hbmd, base = [], []
            for i in range(k):
                size += step
                h, b = pair(
                    i,
                    lambda: timed_ns(lambda: (tensor.resize_(size, zero_new=True), t.sync())),
                    lambda: timed_ns(lambda: (buffer.commit(size), t.sync())),
                )
                hbmd.append(h)
                base.append(b)
            status = summarize_ns(repeat_ns(t.client.status, 4 * k, warmup=5))
            point = {
                "chunks": target,
                "commit_2mib": side_by_side(hbmd, base),
                "status": status,
                "daemon": process_footprint(t.daemon.pid),
            }
            print(f"  {target:>6} chunks: commit hbmd {point['commit_2mib']['hbmd']['p50_us']} µs, in-process "
                  f"{point['commit_2mib']['in_process']['p50_us']} µs, status {status['p50_us']} µs", flush=True)
            points.append(point)
    finally:
        tensor.free()
        buffer.free()
    first, last = points[0], points[-1]
    commit_growth = ratio(last["commit_2mib"]["hbmd"]["p50_us"], first["commit_2mib"]["hbmd"]["p50_us"])
    in_process_growth = ratio(last["commit_2mib"]["in_process"]["p50_us"], first["commit_2mib"]["in_process"]["p50_us"])
    status_growth = ratio(last["status"]["p50_us"], first["status"]["p50_us"])
    return {
        "points": points,
        "commit_p50_growth": commit_growth,
        "in_process_commit_p50_growth": in_process_growth,
        "status_p50_growth": status_growth,
        "goals": [
            goal(f"2 MiB commit p50 at {last['chunks']} ÷ at {first['chunks']} chunks, against in-process's own",
                 commit_growth, "<=", in_process_growth or 1.0),
            goal(f"status p50 at {last['chunks']} ÷ at {first['chunks']} chunks", status_growth, "<=", 1.25),
        ],
    }


# where the time goes


BREAKDOWN_SIZES = {2 * MiB: (20, 4), 64 * MiB: (10, 2), 1 * GiB: (5, 1), 8 * GiB: (3, 1), 64 * GiB: (2, 1)}
NESTED_STEPS = ("client.send_request", "client.decode_reply", "client.file_datagram", "client.import_leased")
"""Client steps inside others (or on the listener thread): left out of the client's own time, or it would count
twice."""


def window(windows: list[tuple[int, int]], fn: Callable[[], Any]) -> None:
    """Run ``fn`` and record its span on the clock the probes use."""
    start = time.monotonic_ns()
    fn()
    windows.append((start, time.monotonic_ns()))


def summarize_windows(events: list[tuple[str, int, int]], windows: list[tuple[int, int]]) -> dict[str, Any]:
    steps = breakdown(events, windows)
    total = percentile([(end - start) / 1e3 for start, end in windows], 50)
    own = sum(us for label, us in steps.items() if label.startswith(("client.", "drv.")) and label not in NESTED_STEPS)
    derived = {}
    if "client.control_call" in steps and "daemon.dispatch" in steps:
        # ZeroMQ both ways, both codecs and poll wake-ups: the request minus the daemon's handling of it.
        derived["control_transport_us"] = round(steps["client.control_call"] - steps["daemon.dispatch"], 2)
    if "client.control_call" in steps and "daemon.drain_control" in steps:
        # What neither process's Python accounts for: ZeroMQ's I/O threads and the wake-ups on either side.
        derived["wakeups_and_zmq_us"] = round(
            steps["client.control_call"] - steps["daemon.drain_control"]
            - sum(steps.get(label, 0.0) for label in ("client.send_request", "client.decode_reply")), 2)
    return {"n": len(windows), "total_us": round(total, 2), "steps_p50_us": steps,
            "unaccounted_us": round(total - own, 2), **derived}


def export_in_process(t: Target, n: int) -> dict[str, Any]:
    """Export and FD close of a 2 MiB chunk in this process, which holds a context (the daemon holds none)."""
    export, close = [], []
    for _ in range(n):
        handle = driver.create(DEVICE, t.granule, rdma=False)
        try:
            t0 = now_ns()
            fd = driver.export_fd(handle)
            t1 = now_ns()
            os.close(fd)
            t2 = now_ns()
        finally:
            driver.release(handle)
        export.append(t1 - t0)
        close.append(t2 - t1)
    return {"export_fd": summarize_ns(export), "close_fd": summarize_ns(close)}


def step_windows(t: Target, client: Client, n: int) -> dict[str, list[tuple[int, int]]]:
    """The spans of ``n`` successive 2 MiB commits by ``client``, and of as many in-process ones, interleaved."""
    step = t.granule
    tensor, buffer = t.tensor(n * step, client=client), t.in_process(n * step)
    spans: dict[str, list[tuple[int, int]]] = {"hbmd": [], "in_process": []}
    try:
        for i in range(n):
            size = (i + 1) * step
            pair(
                i,
                lambda: window(spans["hbmd"], lambda: (tensor.resize_(size, zero_new=True), t.sync())),
                lambda: window(spans["in_process"], lambda: (buffer.commit(size), t.sync())),
            )
    finally:
        tensor.free()
        buffer.free()
    return spans


@bench.case("breakdown")
def breakdown_case(t: Target) -> dict[str, Any]:
    """The commit paths again, with timers around each step in this process and in a probed daemon."""
    n = t.reps(200, 50)
    windows: dict[str, dict[str, list[tuple[int, int]]]] = {}
    with probed_daemon("--backend", "cuda", "--device", str(DEVICE)) as (probed, daemon_events):
        client = t.connect("bench-breakdown", probed)
        try:
            with client_probe() as probe:
                windows["2 MiB step"] = step_windows(t, client, n)
                # Every commit a round trip: where the time of a commit with the lease empty goes.
                without_lease = t.connect("bench-breakdown-no-lease", probed, lease=False)
                try:
                    windows["2 MiB step, lease empty"] = step_windows(t, without_lease, n)
                finally:
                    without_lease.close()
                for size, reps in on_this_card(BREAKDOWN_SIZES)[0].items():
                    spans = windows[format_bytes(size)] = {"hbmd": [], "in_process": []}
                    for _ in range(t.reps(*reps)):
                        tensor = t.tensor(size, client=client)
                        window(spans["hbmd"], lambda: (tensor.resize_(size, zero_new=True), t.sync()))
                        tensor.free()
                        buffer = t.in_process(size)
                        window(spans["in_process"], lambda: (buffer.commit(size), t.sync()))
                        buffer.free()
                status = windows["status"] = {"hbmd": []}
                for _ in range(n):
                    window(status["hbmd"], client.status)
            client_events = list(probe.events)
        finally:
            client.close()
    events = client_events + daemon_events
    figures: dict[str, Any] = {
        op: {side: summarize_windows(events, spans) for side, spans in sides.items()} for op, sides in windows.items()
    }
    figures["export_2mib_with_context"] = export_in_process(t, n)
    return figures


# entry point


@contextlib.contextmanager
def setup(args: Any):
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_bench needs a CUDA GPU (bench/host_bench.py runs anywhere)")
    # torch creates the primary context first; the client and the baseline then share it.
    torch.zeros(1, device=f"cuda:{DEVICE}")
    torch.cuda.synchronize()
    options = ([] if args.warm_chunks is None else ["--warm-chunks", str(args.warm_chunks)]) + (
        ["--no-export-sentinel"] if args.no_export_sentinel else [])
    with Daemon("--backend", "cuda", "--device", str(DEVICE), *options) as daemon, fd_sink() as sink:
        client = connect(f"cuda:{DEVICE}", run_dir=daemon.run_dir, client_name="gpu_bench")
        try:
            client.mapper  # noqa: B018 - the mapper's context and stream, made before any clock starts
            # The baseline zeroes on a stream of its own, as the client mapper does on its.
            stream = driver.create_stream()
            yield Target(
                quick=args.quick,
                daemon=daemon,
                client=client,
                device=f"cuda:{DEVICE}",
                granule=client.granularity,
                in_process=lambda capacity: CudaInProcessBuffer(capacity, DEVICE, client.granularity, stream),
                handover=lambda capacity: CudaInProcessBuffer(capacity, DEVICE, client.granularity, stream, sink),
                # Granules made ahead as many as the daemon's warm pool holds.
                granted=lambda: granted_buffers(DEVICE, client.granularity, stream,
                                                DEFAULT_WARM_CHUNKS if args.warm_chunks is None else args.warm_chunks),
                # Looked up per call, so that the breakdown's probe sees it.
                sync=lambda: driver.context_synchronize(),
            )
        finally:
            client.close()


def describe(t: Target) -> dict[str, Any]:
    import torch

    return {
        **gpu_metadata(DEVICE),
        "cuda_driver_api_version": driver.call("cuDriverGetVersion"),
        "torch_cuda": torch.version.cuda,
        "granule_bytes": t.granule,
        "daemon_command": " ".join(t.daemon.command),
    }


def default_out() -> Path:
    name = gpu_metadata(DEVICE).get("gpu_name", "gpu").split()[-1].lower()
    return RESULTS_DIR / f"{name}-{today_utc()}.json"


def main() -> int:
    parser = bench.parser(default_out())
    parser.add_argument("--warm-chunks", type=int, default=None, metavar="N",
                        help="start the daemon with --warm-chunks N (the commit cases' daemon; default: the daemon's)")
    parser.add_argument("--no-export-sentinel", action="store_true",
                        help="start the daemon with --no-export-sentinel: exports and closes off the driver's "
                             "fast path")
    return bench.run(parser.parse_args(), setup, describe)


if __name__ == "__main__":
    sys.exit(main())
