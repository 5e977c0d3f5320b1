"""What bounding a kept prefix index costs and saves: a long-serving engine's churn, rewritten against appended.

    python3 bench/kv_index_bench.py [--blocks 54309] [--steps 40000] [--churn 16] [--out bench/results/...json]

A stand-in for the scheduler of an engine that keeps its KV cache
(``HBMD_VLLM_KEEP_KV``): its pool of ``--blocks`` blocks is full and
published, and every step withdraws ``--churn`` blocks evicted for reuse and
publishes as many newly computed ones, with hashes of vLLM's size (a 32-byte
sha256 and its group id), then flushes once, as the scheduler does. Two
writers run the same steps in the same run, the order swapped every step:
the index as it is (rewritten with what it publishes once it holds
``COMPACT_FACTOR`` times that, past ``COMPACT_AT_BYTES``), and the same
writer never rewriting (appended forever, the baseline). It reports for each
the flush times (p50, p99, max: the longest is a rewrite, the pause it puts
in one scheduler step), the file's size at the end, and how long a successor
takes to read it (``read_index``), the start-up cost the size turns into.

The defaults are the 156M model's pool on an H100 (54,309 blocks, see
``bench/results/h100-2026-12-07-vllm-tier-keep-big-keep.log``) and 16 blocks
a step (1,024 tokens at vLLM's block size of 64). No GPU: the index is a file.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, metadata, percentile, today_utc, write_json
from hbmd.integrations import kv_index
from hbmd.integrations.kv_index import IndexWriter, Published, read_index

HASH_BYTES = 36
"""vLLM 0.34's block hash with its group id, as the scheduler hands it to the index."""
HEADER = {"key": {"model": "bench", "block_size": 64}, "buffers": [1]}


@contextlib.contextmanager
def never_rewritten() -> Iterator[None]:
    """The baseline: the writer as it was before the index was bounded, appending forever."""
    bound = kv_index.COMPACT_AT_BYTES
    kv_index.COMPACT_AT_BYTES = sys.maxsize
    try:
        yield
    finally:
        kv_index.COMPACT_AT_BYTES = bound


def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    rng = random.Random(0)
    pool = {block_id: Published(rng.randbytes(HASH_BYTES), 64) for block_id in range(1, args.blocks)}
    writers = {"rewritten": IndexWriter(folder / "rewritten.index", HEADER, pool),
               "appended": IndexWriter(folder / "appended.index", HEADER, pool)}
    flushes: dict[str, list[int]] = {name: [] for name in writers}
    rewrites = dict.fromkeys(writers, 0)
    for step in range(args.steps):
        evicted = rng.sample(range(1, args.blocks), args.churn)
        computed = [(block_id, rng.randbytes(HASH_BYTES)) for block_id in evicted]
        for name in sorted(writers, reverse=bool(step % 2)):
            writer = writers[name]
            for block_id in evicted:
                writer.withdraw(block_id)
            for block_id, block_hash in computed:
                writer.publish(block_id, block_hash, 64)
            appended = writer.file_bytes + len(writer.pending)
            with never_rewritten() if name == "appended" else contextlib.nullcontext():
                started = time.perf_counter_ns()
                writer.flush()
                flushes[name].append(time.perf_counter_ns() - started)
            rewrites[name] += writer.file_bytes < appended
    result: dict[str, Any] = {}
    for name, writer in writers.items():
        writer.close()
        started = time.perf_counter()
        read = read_index(writer.path)
        read_s = time.perf_counter() - started
        assert len(read.blocks) == args.blocks - 1, "the index lost blocks"
        times = flushes[name]
        result[name] = {"flush_us": {"p50": round(percentile(times, 50) / 1e3, 1),
                                     "p99": round(percentile(times, 99) / 1e3, 1),
                                     "max": round(max(times) / 1e3, 1)},
                        "rewrites": rewrites[name],
                        "file_mib": round(writer.path.stat().st_size / 2**20, 2),
                        "successor_read_s": round(read_s, 3)}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=54309, help="the pool's blocks, all published")
    parser.add_argument("--steps", type=int, default=40000, help="scheduler steps")
    parser.add_argument("--churn", type=int, default=16, help="blocks withdrawn and published again each step")
    parser.add_argument("--dir", help="where the two index files go (default: a new folder in /dev/shm)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / f"kv-index-{today_utc()}.json")
    args = parser.parse_args()
    base = args.dir or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
    with tempfile.TemporaryDirectory(prefix="hbmd-kv-index-bench-", dir=base) as folder:
        result = run(args, Path(folder))
    payload = {"meta": metadata(), "params": {k: v for k, v in vars(args).items() if k != "out"},
               "bound": {"COMPACT_AT_BYTES": kv_index.COMPACT_AT_BYTES, "COMPACT_FACTOR": kv_index.COMPACT_FACTOR},
               "cases": result}
    write_json(args.out, payload)
    for name, case in result.items():
        print(f"{name:>9}: flush p50 {case['flush_us']['p50']} us, p99 {case['flush_us']['p99']} us, "
              f"max {case['flush_us']['max']} us; {case['rewrites']} rewrites; file {case['file_mib']} MiB; "
              f"successor reads it in {case['successor_read_s']} s")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
