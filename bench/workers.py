"""Helper processes the benchmarks start: ``python bench/workers.py <role> ...``.

Each prints ``ready`` once set up, then answers lines on stdin with one JSON
line each (see :class:`common.Worker`):

- ``commit``: a client (of a GPU, or of the host with ``--device cpu``) that,
  per command ``hbmd SECONDS``, ``in_process SECONDS`` or (GPU) ``handover
  SECONDS`` or ``handover_imported SECONDS``, commits 2 MiB at a time for that
  long (through the daemon, in-process, or in-process exporting each chunk's
  FD to another process: the floor of a commit that outlives its worker;
  ``handover_imported``: that process imports each, the floor where one
  process makes a chunk and another checks or maps it), releasing its buffer
  whenever it is full.
- ``attach``: a fresh process that, on ``go``, re-attaches a persistent
  buffer (connect, import, map) and checks its data, as a restarted worker.
- ``echo``: a ZeroMQ ROUTER that sends every request back, the floor under
  any control round trip (:func:`echo_round_trips`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from typing import Any

import zmq
from common import MiB, Worker, now_ns, summarize_ns

PATTERN_BYTES = 64


def _answer(payload: dict[str, Any]) -> None:
    print(json.dumps(payload), flush=True)


def write_pattern(view: Any, num_bytes: int) -> None:
    """``0, 1, ..., 63`` at the start and at the end of the first ``num_bytes``: what a re-attach or a defragment must
    keep."""
    import torch

    pattern = torch.arange(PATTERN_BYTES, dtype=torch.uint8, device=view.device)
    view[:PATTERN_BYTES] = pattern
    view[num_bytes - PATTERN_BYTES : num_bytes] = pattern
    torch.cuda.synchronize()


def has_pattern(view: Any, num_bytes: int) -> bool:
    import torch

    pattern = torch.arange(PATTERN_BYTES, dtype=torch.uint8, device=view.device)
    return bool(torch.equal(view[:PATTERN_BYTES], pattern)) and bool(
        torch.equal(view[num_bytes - PATTERN_BYTES : num_bytes], pattern)
    )


def commit_worker(args: argparse.Namespace) -> None:
    with contextlib.ExitStack() as sinks:
        _commit(args, sinks)


def _commit(args: argparse.Namespace, sinks: contextlib.ExitStack) -> None:
    """:func:`commit_worker`, its handover sink (GPU) entered in ``sinks``."""
    from hbmd.client import ExtensibleTensor, connect

    device = "cpu" if args.device == "cpu" else f"cuda:{args.device}"
    client = connect(device, run_dir=args.run_dir, client_name="bench-commit-worker")
    mapper = client.mapper  # creates this process's context and stream before the clock starts
    step = client.granularity
    if device == "cpu":
        from baseline import HostInProcessBuffer

        def in_process_buffer(mode: str) -> Any:
            return HostInProcessBuffer(args.capacity, step)
    else:
        from baseline import CudaInProcessBuffer, fd_sink
        from hbmd import driver

        stream = driver.create_stream()
        handover = {"handover": sinks.enter_context(fd_sink()),
                    "handover_imported": sinks.enter_context(fd_sink(imports=True))}

        def in_process_buffer(mode: str) -> Any:
            # The mapper made the primary context current on this (only) thread: the baseline runs in it too.
            return CudaInProcessBuffer(args.capacity, mapper.ordinal, step, stream, handover.get(mode))

    def loop(seconds: float, grow: Any, release: Any, capacity: int) -> dict[str, Any]:
        samples: list[int] = []
        size = releases = 0
        start = time.monotonic()
        deadline = start + seconds
        while time.monotonic() < deadline:
            if size + step > capacity:
                release()
                releases += 1
                size = 0
            size += step
            t0 = now_ns()
            grow(size)
            samples.append(now_ns() - t0)
        elapsed = time.monotonic() - start
        return {"commits": len(samples), "elapsed_s": elapsed, "releases": releases, **summarize_ns(samples)}

    print("ready", flush=True)
    while line := sys.stdin.readline():
        mode, seconds = line.split()
        if mode == "hbmd":
            tensor = ExtensibleTensor(args.capacity, device, client=client)
            result = loop(float(seconds), lambda n: tensor.resize_per_segment_(n, zero_new=True),
                          tensor.release_physical, tensor.capacity_bytes)
            tensor.free()
        else:
            buffer = in_process_buffer(mode)
            result = loop(float(seconds), buffer.commit, buffer.release, buffer.capacity)
            buffer.free()
        _answer({"mode": mode, **result})


def attach_worker(args: argparse.Namespace) -> None:
    import torch
    from hbmd.client import ExtensibleTensor, connect

    # A restarted engine has torch and its CUDA context before it looks for its KV cache.
    torch.zeros(1, device=f"cuda:{args.device}")
    torch.cuda.synchronize()
    print("ready", flush=True)
    sys.stdin.readline()
    cycles = []
    for _ in range(args.cycles):
        t0 = now_ns()
        client = connect(f"cuda:{args.device}", run_dir=args.run_dir, client_name="bench-attach-worker")
        t1 = now_ns()
        tensor = ExtensibleTensor.attach(args.name, f"cuda:{args.device}", client=client)
        torch.cuda.synchronize()
        t2 = now_ns()
        intact = has_pattern(tensor.full_view(), tensor.num_bytes)
        cycles.append({
            "connect_ms": (t1 - t0) / 1e6,
            "attach_ms": (t2 - t1) / 1e6,
            "total_ms": (t2 - t0) / 1e6,
            "num_chunks": tensor.num_chunks,
            "num_bytes": tensor.num_bytes,
            "data_intact": intact,
        })
        # Leave it orphaned again, for the next cycle or the next process.
        client.close()
        tensor.free()
    _answer({"cycles": cycles})


def echo_worker(args: argparse.Namespace) -> None:
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(args.endpoint)
    print("ready", flush=True)
    while True:
        router.send_multipart(router.recv_multipart())


def echo_round_trips(n: int, warmup: int = 50, spin: float = 0.0) -> dict[str, Any]:
    """Round trips of a Status request to a bare ROUTER echo: transport and codec, no daemon work. ``spin``: seconds
    each waits polling before it sleeps, as hbmd's client does (``poll_spinning``); 0 sleeps at once."""
    from hbmd.client.transport import poll_spinning
    from hbmd.proto import Status, decode_frames, encode_frames

    with tempfile.TemporaryDirectory(prefix="hbmdb-echo-", dir="/tmp") as directory:
        endpoint = f"ipc://{directory}/echo.sock"
        worker = Worker(["echo", "--endpoint", endpoint])
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        try:
            worker.wait_ready(60)
            dealer.connect(endpoint)
            samples = []
            for i in range(warmup + n):
                t0 = now_ns()
                dealer.send_multipart(encode_frames(Status(), i, "0" * 32))
                sent = time.monotonic()
                if not poll_spinning(poller, sent + 5, sent + spin):
                    raise TimeoutError("the echo worker did not answer within 5 s")
                decode_frames(dealer.recv_multipart())
                if i >= warmup:
                    samples.append(now_ns() - t0)
            return summarize_ns(samples)
        finally:
            dealer.close(linger=0)
            worker.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    commit = roles.add_parser("commit")
    commit.add_argument("--run-dir", required=True)
    commit.add_argument("--device", default="0", help="a CUDA device ordinal, or cpu (the host backend)")
    commit.add_argument("--capacity", type=int, default=1024 * MiB)
    attach = roles.add_parser("attach")
    attach.add_argument("--run-dir", required=True)
    attach.add_argument("--device", type=int, default=0)
    attach.add_argument("--name", required=True)
    attach.add_argument("--cycles", type=int, default=1)
    echo = roles.add_parser("echo")
    echo.add_argument("--endpoint", required=True)
    args = parser.parse_args()
    {"commit": commit_worker, "attach": attach_worker, "echo": echo_worker}[args.role](args)


if __name__ == "__main__":
    main()
