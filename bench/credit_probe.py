"""Where a fresh commit made on credit spends its time beyond its floor, in one run (GPU only).

Five sides commit a new buffer of each size, in a rotated order, with every
driver call and the client's bind send probed (``probe.client_probe``):

- ``in_process``: create, map, set access, zero, synchronize;
- ``floor``: the same, and the chunk's FD exported and sent to another
  process before the commit returns (``baseline.fd_sink``);
- ``hbmd``: ``ExtensibleTensor.resize_per_segment_(size, zero_new=True)``
  on credit (the first commit of each size goes through the daemon, untimed);
- ``hbmd_check_delayed``: the same against a second daemon that waits
  :data:`CHECK_DELAY_S` before it checks each chunk made on credit, so that
  its check cannot overlap the client's commit;
- ``replica``: the driver calls of hbmd's client, in its order and with its
  context switches, own stream and release, the FD sent to the sink: what
  hbmd's client costs without its Python.

hbmd ÷ replica is the client's own cost; hbmd ÷ hbmd_check_delayed what the
daemon's check costs the commit while it runs beside it::

    python3 bench/credit_probe.py [--out probe.json]
    python3 bench/credit_probe.py --daemon SECONDS <hbmd arguments>   # the daemon with its check delayed
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import Daemon, GiB, MiB, percentile, write_json  # noqa: E402

SIZES = {2 * MiB: 30, 64 * MiB: 30, GiB: 12}
CHECK_DELAY_S = 0.003
"""Longer than a commit of any size measured here: the delayed check runs after the commit has returned."""
PAUSE_S = 0.01
"""Between two commits: the daemon's check of the last one is over before the next starts."""

Side = Callable[[int], tuple[int, int, dict[str, Any]]]


def delayed_check_daemon(delay: float, argv: list[str]) -> int:
    """``python -m hbmd.daemon``, waiting ``delay`` seconds before each check of a chunk made on credit."""
    from hbmd.daemon.main import main
    from hbmd.daemon.state.chunks import Chunks

    accept = Chunks.accept

    def delayed(self: Chunks, *args: Any) -> Any:
        time.sleep(delay)
        return accept(self, *args)

    Chunks.accept = delayed
    return main(argv)


def sides(device: int, sink: socket.socket, normal: Any, delayed: Any) -> dict[str, Side]:
    import torch
    from baseline import CudaInProcessBuffer
    from hbmd import driver
    from hbmd.client import ExtensibleTensor

    granule = normal.granularity
    stream = driver.create_stream()
    mapper = normal.mapper
    now = time.monotonic_ns

    def hbmd(client: Any) -> Side:
        def run(size: int) -> tuple[int, int, dict[str, Any]]:
            tensor = ExtensibleTensor(size, f"cuda:{device}", client=client)
            sent = client.requests_sent
            t0 = now()
            tensor.resize_per_segment_(size, zero_new=True)
            driver.context_synchronize()
            t1 = now()
            round_trips = client.requests_sent - sent
            tensor.free()
            return t0, t1, {"round_trips": round_trips}
        return run

    def baseline(handover: bool) -> Side:
        def run(size: int) -> tuple[int, int, dict[str, Any]]:
            buffer = CudaInProcessBuffer(size, device, granule, stream, sink if handover else None)
            t0 = now()
            buffer.commit(size)
            driver.context_synchronize()
            t1 = now()
            buffer.free()
            return t0, t1, {}
        return run

    def replica(size: int) -> tuple[int, int, dict[str, Any]]:
        # As transaction.py's _make_on_credit and the CUDA mapper do it.
        base = driver.reserve(size, granule)
        t0 = now()
        handle = driver.create(device, size, rdma=False)
        driver.make_current(mapper._ctx)
        driver.map(base, size, handle)
        driver.set_access(base, size, [device])
        driver.make_current(mapper._ctx)
        driver.memset_async(base, size, mapper._stream)
        fd = driver.export_fd(handle)
        socket.send_fds(sink, [b"x" * 64], [fd])
        driver.release(handle)
        driver.make_current(mapper._ctx)
        driver.context_synchronize()  # the mapper's wait for the zeroing
        driver.context_synchronize()  # the sides' common end
        t1 = now()
        os.close(fd)
        driver.unmap(base, size)
        driver.unreserve(base, size)
        return t0, t1, {}

    torch.cuda.synchronize()
    return {"in_process": baseline(False), "floor": baseline(True), "hbmd": hbmd(normal),
            "hbmd_check_delayed": hbmd(delayed), "replica": replica}


def measure(device: int) -> dict[str, Any]:
    import torch
    from baseline import fd_sink
    from hbmd.client import connect
    from probe import breakdown, client_probe

    torch.zeros(1, device=f"cuda:{device}")  # torch's primary context first, as an engine has it
    torch.cuda.synchronize()
    delayed_command = [sys.executable, os.path.abspath(__file__), "--daemon", str(CHECK_DELAY_S)]
    results: dict[str, Any] = {}
    with Daemon("--backend", "cuda", "--device", str(device)) as first, \
            Daemon("--backend", "cuda", "--device", str(device), command=delayed_command) as second, \
            fd_sink() as sink:
        normal = connect(f"cuda:{device}", run_dir=first.run_dir, client_name="credit-probe")
        delayed = connect(f"cuda:{device}", run_dir=second.run_dir, client_name="credit-probe-delayed")
        try:
            run = sides(device, sink, normal, delayed)
            names = list(run)
            with client_probe() as probe:
                for size, n in SIZES.items():
                    for name in names:  # untimed: the session's first commit of a size goes through the daemon
                        run[name](size)
                        time.sleep(PAUSE_S)
                    windows: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
                    round_trips = {name: 0 for name in names}
                    for i in range(n):
                        for name in names[i % len(names):] + names[: i % len(names)]:
                            t0, t1, extra = run[name](size)
                            windows[name].append((t0, t1))
                            round_trips[name] += extra.get("round_trips", 0)
                            time.sleep(PAUSE_S)
                    entry: dict[str, Any] = {}
                    for name in names:
                        us = [(t1 - t0) / 1e3 for t0, t1 in windows[name]]
                        entry[name] = {"p50_us": round(percentile(us, 50), 1), "min_us": round(min(us), 1),
                                       "steps_p50_us": breakdown(probe.events, windows[name])}
                        if name.startswith("hbmd"):
                            entry[name]["round_trips"] = round_trips[name]
                    results[f"{size >> 20} MiB"] = entry
                    print(f"{size >> 20} MiB:", {name: entry[name]["p50_us"] for name in names}, flush=True)
        finally:
            normal.close()
            delayed.close()
    return results


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--daemon":
        return delayed_check_daemon(float(sys.argv[2]), sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    results = measure(args.device)
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
