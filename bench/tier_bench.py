"""Demote and promote against a plain copy of the same bytes between the same memories, in one run.

    python3 bench/tier_bench.py --backend cuda [--sizes 1GiB,8GiB,64GiB] [--out bench/results/tier-h200-DATE.json]
    python3 bench/tier_bench.py --backend host --quick

Starts its own daemon with a host tier as large as the largest buffer
(``--host-budget``) and a host pool as large (``--host-pool``), so that a
demote finds its pinned host memory made ahead and what is timed is the move
itself: the daemon's request, the copy, the remap and the finish. Before each
demote the bench waits for the pool to be full. On a GPU, a size whose buffer
and scratch copy do not fit side by side (64 GiB on an 80 GB H100) is
skipped, said on the console and in the result's ``skipped_sizes``.

The floor is measured on the same memory in the same run: while the buffer
is demoted, a plain copy of its bytes from a scratch buffer on the device
into its host-tier pages (device to host, what a demote copies) and back out
of them (host to device, what a promote copies), each one driver copy of the
whole buffer. The goal is each move at 0.8 of its floor or better.

``--breakdown`` runs the daemon under ``probe.py`` and times the steps of each
move in both processes (the request, the copy, the remap, the finish, the
driver calls and the host pool's work); each size then reports the median
time of every step (probes cost a few microseconds a call).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    BENCH_DIR,
    RESULTS_DIR,
    Bench,
    Daemon,
    GiB,
    goal,
    sized_to_card,
    summarize_ns,
    timed_ns,
    today_utc,
)
from hbmd.client import Client, ExtensibleTensor, connect
from hbmd.proto.units import format_bytes, parse_size
from probe import Probe, breakdown, move_probe

bench = Bench("tier", "demote and promote against a plain copy between the same memories")

GOAL_OF_FLOOR = 0.8
POOL_WAIT_S = 600.0
"""How long the bench waits for the daemon to make a buffer's worth of host-tier memory ahead (~250 ms a GiB on an
H200: 16 s for 64 GiB)."""


@dataclasses.dataclass
class TierTarget:
    quick: bool
    daemon: Daemon
    client: Client
    backend: str
    device: str
    sizes: list[int]
    skipped: list[str]
    """The sizes asked for that the GPU could not hold, and why."""
    piece: int
    """The daemon's ``--host-piece``: the pool holds whole pieces."""
    pool: int
    """The daemon's ``--host-pool``."""
    sync: Callable[[], None]
    probe: Probe | None
    """The client's steps, timed (``--breakdown``)."""
    events_path: Path | None
    """Where the probed daemon writes its steps when it stops."""
    windows: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    """Per move and size, the spans of each one on the probes' clock."""

    def reps(self, size: int) -> int:
        return 1 if self.quick else (2 if size >= 32 * GiB else 3)


def gbps(size: int, us: float) -> float:
    return round(size / us / 1e3, 2)  # bytes per ns is GB/s


def wait_for_pool(t: TierTarget) -> float:
    """Wait until the daemon's host pool is full (its target, or the room the host tier leaves); returns the wait in s.

    Full, not just holding this buffer's pieces: a pool still filling pins memory beside the move, which holds up
    the driver's calls in every process, and the move would measure that.
    """
    start = time.monotonic()
    while time.monotonic() - start < POOL_WAIT_S:
        status = t.client.status()
        room = status.host_budget_bytes - status.host_bytes
        if status.host_pool_bytes >= min(t.pool, room) // t.piece * t.piece:
            break
        time.sleep(0.05)
    return round(time.monotonic() - start, 2)


def timed_move(t: TierTarget, name: str, move: Callable[[], Any]) -> int:
    """Nanoseconds ``move`` took; with ``--breakdown``, its span is kept under ``name`` for the breakdown."""
    start = time.monotonic_ns()
    move()
    end = time.monotonic_ns()
    t.windows.setdefault(name, []).append((start, end))
    return end - start


def move_once(t: TierTarget, size: int, value: int) -> dict[str, Any]:
    """Demote, measure both floors on the demoted pages, promote; the buffer reads ``value`` throughout."""
    import torch

    buffer = ExtensibleTensor(size, t.device, client=t.client)
    try:
        buffer.resize_(size)
        view = buffer.full_view()[:size]
        view.fill_(value)
        scratch = torch.full((size,), value, dtype=torch.uint8, device=view.device)
        t.sync()
        pool_wait_s = wait_for_pool(t)
        demote_ns = timed_move(t, f"demote {format_bytes(size)}", buffer.demote)
        assert buffer.tier == "host"
        floor_d2h_ns = timed_ns(lambda: (view.copy_(scratch), t.sync()))
        floor_h2d_ns = timed_ns(lambda: (scratch.copy_(view), t.sync()))
        promote_ns = timed_move(t, f"promote {format_bytes(size)}", buffer.promote)
        assert buffer.tier == "device"
        # Reductions, not a comparison: a 64 GiB boolean tensor would not fit beside the buffer and its scratch copy.
        intact = all(int(x.min()) == value == int(x.max()) for x in (view, scratch))
        view = scratch = None  # the buffer is freed next: no view of it may outlive it
        return {"demote_ns": demote_ns, "promote_ns": promote_ns, "floor_d2h_ns": floor_d2h_ns,
                "floor_h2d_ns": floor_h2d_ns, "pool_wait_s": pool_wait_s, "intact": intact,
                "chunks_demoted": buffer.num_chunks}
    finally:
        buffer.free()


@bench.case("move")
def move_case(t: TierTarget) -> dict[str, Any]:
    sizes, goals = [], []
    for size in t.sizes:
        runs = [move_once(t, size, 1 + index % 250) for index in range(t.reps(size))]
        figures: dict[str, Any] = {"label": format_bytes(size), "bytes": size, "repetitions": len(runs),
                                   "intact": all(r["intact"] for r in runs),
                                   "pool_wait_s": [r["pool_wait_s"] for r in runs]}
        for key in ("demote", "promote", "floor_d2h", "floor_h2d"):
            summary = summarize_ns([r[f"{key}_ns"] for r in runs])
            figures[key] = {**summary, "gbps_p50": gbps(size, summary["p50_us"])}
        figures["demote_of_floor"] = round(figures["demote"]["gbps_p50"] / figures["floor_d2h"]["gbps_p50"], 3)
        figures["promote_of_floor"] = round(figures["promote"]["gbps_p50"] / figures["floor_h2d"]["gbps_p50"], 3)
        goals += [
            goal(f"demote {figures['label']} GB/s of the device-to-host copy", figures["demote_of_floor"], ">=",
                 GOAL_OF_FLOOR),
            goal(f"promote {figures['label']} GB/s of the host-to-device copy", figures["promote_of_floor"], ">=",
                 GOAL_OF_FLOOR),
        ]
        sizes.append(figures)
        print(f"{figures['label']}: demote {figures['demote']['gbps_p50']} GB/s "
              f"({figures['demote_of_floor']} of {figures['floor_d2h']['gbps_p50']}), promote "
              f"{figures['promote']['gbps_p50']} GB/s ({figures['promote_of_floor']} of "
              f"{figures['floor_h2d']['gbps_p50']}), intact {figures['intact']}", flush=True)
    figures = {"sizes": sizes, "goals": goals}
    if t.probe is not None:
        figures["breakdown"] = move_breakdown(t)
    return figures


def move_breakdown(t: TierTarget) -> dict[str, Any]:
    """The median time of each step of every move measured, in µs, both processes' steps together (the daemon's
    events reach the bench once it stops)."""
    assert t.probe is not None and t.events_path is not None
    events = list(t.probe.events)
    t.probe.restore()
    t.daemon.stop()
    events += [tuple(e) for e in json.loads(t.events_path.read_text())]
    return {name: {"total_us": summarize_ns([end - start for start, end in spans])["p50_us"],
                   "steps_p50_us": breakdown(events, spans)}
            for name, spans in t.windows.items()}


@contextlib.contextmanager
def setup(args: Any):
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    skipped: list[str] = []
    if args.backend == "cuda":
        # The buffer and its scratch copy side by side, and a context in each process.
        sizes, skipped = sized_to_card(sizes, copies=2, spare=2 * GiB)
        if not sizes:
            raise SystemExit("tier_bench: no size asked for fits on this GPU")
    largest = max(sizes)
    host_budget = largest + args.host_piece_bytes
    daemon_args = ["--backend", args.backend, "--host-budget", str(host_budget), "--host-pool", str(largest),
                   "--host-piece", str(args.host_piece_bytes), "--lease", "0"]
    if args.backend == "cuda":
        daemon_args += ["--device", "0", "--budget", str(largest + GiB)]
    else:
        daemon_args += ["--budget", str(largest + GiB)]
    events_path = probe = None
    command = None
    if args.breakdown:
        with tempfile.NamedTemporaryFile(prefix="hbmdb-events-", suffix=".json", dir="/tmp", delete=False) as f:
            events_path = Path(f.name)
        command = [sys.executable, str(BENCH_DIR / "probe.py"), "--events", str(events_path)]
    with contextlib.ExitStack() as cleanup:
        if events_path is not None:
            cleanup.callback(events_path.unlink, missing_ok=True)
        daemon = cleanup.enter_context(Daemon(*daemon_args, command=command))
        if args.backend == "cuda":
            import torch

            torch.cuda.init()
            device, sync = "cuda:0", torch.cuda.synchronize
        else:
            device, sync = "cpu", lambda: None
        client = connect(device, run_dir=daemon.run_dir, client_name="tier_bench", lease=False)
        cleanup.callback(client.close)
        if args.breakdown:
            probe = cleanup.enter_context(move_probe())
        yield TierTarget(args.quick, daemon, client, args.backend, device, sizes, skipped, args.host_piece_bytes,
                         largest, sync, probe, events_path)


def describe(t: TierTarget) -> dict[str, Any]:
    meta: dict[str, Any] = {"backend": t.backend, "daemon_command": " ".join(t.daemon.command),
                            "skipped_sizes": t.skipped}
    if t.backend == "cuda":
        from common import gpu_metadata

        meta.update(gpu_metadata(0))
    return meta


def main() -> int:
    parser = bench.parser(RESULTS_DIR / f"tier-{today_utc()}.json")
    parser.add_argument("--backend", choices=("host", "cuda"), required=True)
    parser.add_argument("--sizes", help="buffer sizes, comma-separated (default: 1GiB,8GiB,64GiB on cuda; "
                                        "64MiB,1GiB on host; --quick: 1GiB on cuda)")
    parser.add_argument("--host-piece", default="256MiB", help="the daemon's --host-piece (default: %(default)s)")
    parser.add_argument("--breakdown", action="store_true", help="time each step of every move (a probed daemon)")
    args = parser.parse_args()
    if args.sizes is None:
        args.sizes = ("1GiB" if args.quick else "1GiB,8GiB,64GiB") if args.backend == "cuda" else "64MiB,1GiB"
    args.host_piece_bytes = parse_size(args.host_piece)
    return bench.run(args, setup, describe)


if __name__ == "__main__":
    sys.exit(main())
