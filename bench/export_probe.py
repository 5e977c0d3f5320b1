"""The driver's export fast path: POSIX-FD export and close of a 2 MiB handle, alone and beside an open exported FD.

On the H200 (driver 580) ``cuMemExportToShareableHandle`` and the ``close()``
of the exported FD were an order of magnitude slower while no exported FD was
open anywhere on the machine. This probe measures it from a context-free
process (``cuInit`` only, as the daemon is) in three settings, one run:

- ``alone``: nothing else holds an exported FD (run it with no hbmd on the node);
- ``bystander``: another process holds one exported granule's FD;
- ``own_sentinel``: this process holds one, as ``hbmd`` does by default.

    python3 bench/export_probe.py [--device 0] [--n 200] [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from hbmd import driver

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import percentile  # noqa: E402


def export_and_close(device: int, size: int, n: int) -> dict[str, Any]:
    """``n`` rounds of create, export, close, release; p50/p99 of export and close in microseconds."""
    export_us: list[float] = []
    close_us: list[float] = []
    for _ in range(n):
        handle = driver.create(device, size, rdma=False)
        try:
            started = time.perf_counter()
            fd = driver.export_fd(handle)
            exported = time.perf_counter()
            os.close(fd)
            closed = time.perf_counter()
        finally:
            driver.release(handle)
        export_us.append((exported - started) * 1e6)
        close_us.append((closed - exported) * 1e6)
    return {
        "n": n,
        "export_p50_us": round(percentile(export_us, 50), 1),
        "export_p99_us": round(percentile(export_us, 99), 1),
        "close_p50_us": round(percentile(close_us, 50), 1),
        "close_p99_us": round(percentile(close_us, 99), 1),
    }


def hold(device: int) -> None:
    """The bystander: export one granule, say so, keep the FD open until stdin closes."""
    driver.init()
    handle = driver.create(device, driver.granularity(device), rdma=False)
    fd = driver.export_fd(handle)
    print("holding", flush=True)
    sys.stdin.read()
    os.close(fd)
    driver.release(handle)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--n", type=int, default=200, help="rounds per setting (default: 200)")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hold:
        hold(args.device)
        return 0
    driver.pin_device_order()
    driver.init()
    size = driver.granularity(args.device)
    figures: dict[str, Any] = {"device": args.device, "size_bytes": size}
    figures["alone"] = export_and_close(args.device, size, args.n)

    bystander = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--hold", "--device", str(args.device)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        if bystander.stdout.readline().strip() != "holding":
            raise SystemExit(f"the bystander did not start (exit {bystander.wait(10)})")
        figures["bystander"] = export_and_close(args.device, size, args.n)
    finally:
        bystander.stdin.close()
        bystander.wait(30)

    sentinel = driver.create(args.device, size, rdma=False)
    sentinel_fd = driver.export_fd(sentinel)
    try:
        figures["own_sentinel"] = export_and_close(args.device, size, args.n)
    finally:
        os.close(sentinel_fd)
        driver.release(sentinel)
    for setting in ("bystander", "own_sentinel"):
        figures[f"{setting}_speedup_p50"] = {
            op: round(figures["alone"][f"{op}_p50_us"] / max(figures[setting][f"{op}_p50_us"], 1e-3), 1)
            for op in ("export", "close")
        }
    text = json.dumps(figures, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
