"""The client of this tree against the client of another revision, interleaved A/B on the host backend (no GPU).

    python3 bench/client_ab.py --baseline REV [--rounds 5] [--steps 200] [--calls 2000] [--out FILE]

Each round runs one process per side, in alternating order, each with its
own host daemon (``python -m hbmd.daemon --backend host``, from that side's
tree): ``--steps`` 2 MiB commits to one buffer by a session without a lease
(every commit a round trip: what a commit costs when the lease is empty),
then ``--calls`` ``status()`` calls. The baseline's tree is ``git archive``d
into a temporary directory and imported in place of this one, so both sides
run the same Python, the same machine and the same minute.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
TREE = BENCH_DIR.parent
MiB = 1 << 20


def measure(steps: int, calls: int) -> dict[str, Any]:
    """One side's figures: p50 and p90 of each, in µs, from a daemon and a session of the ``hbmd`` this process
    imports."""
    import hbmd
    from common import Daemon
    from hbmd.client import ExtensibleTensor, connect

    with Daemon("--backend", "host") as daemon:
        client = connect("cpu", run_dir=daemon.run_dir, client_name="client_ab", lease=False)
        try:
            commits = []
            for _ in range(2):  # the first pass warms the daemon's pool: the second is timed
                commits.clear()
                tensor = ExtensibleTensor(steps * 2 * MiB, "cpu", client=client)
                for i in range(steps):
                    started = time.perf_counter_ns()
                    tensor.resize_((i + 1) * 2 * MiB)
                    commits.append(time.perf_counter_ns() - started)
                tensor.free()
            status = []
            for _ in range(calls):
                started = time.perf_counter_ns()
                client.status()
                status.append(time.perf_counter_ns() - started)
        finally:
            client.close()
    return {"tree": os.path.dirname(hbmd.__file__), "commit_2mib_no_lease": _summary(commits),
            "status": _summary(status)}


def _summary(samples_ns: list[int]) -> dict[str, float]:
    cuts = statistics.quantiles(samples_ns, n=10)
    return {"p50_us": round(statistics.median(samples_ns) / 1e3, 1), "p90_us": round(cuts[-1] / 1e3, 1)}


def export(revision: str, into: Path) -> Path:
    """``revision``'s tree as an importable ``hbmd`` under ``into``; returns the directory to put on the path."""
    package = into / "hbmd"
    package.mkdir()
    archive = subprocess.run(["git", "-C", str(TREE), "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(package)], input=archive, check=True)
    if not (package / "testing").is_dir():
        # A revision from before hbmd.testing: the daemon-starting helper (not what is measured) is this tree's.
        shutil.copytree(TREE / "testing", package / "testing", ignore=shutil.ignore_patterns("__pycache__"))
    return into


def side(path_entry: Path | None, steps: int, calls: int) -> dict[str, Any]:
    """One run of :func:`measure` in a process that imports ``hbmd`` from ``path_entry`` (None: this tree)."""
    env = dict(os.environ)
    if path_entry is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path_entry), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, __file__, "--measure", "--steps", str(steps), "--calls", str(calls)],
                         check=True, capture_output=True, text=True, env=env, cwd=BENCH_DIR, timeout=600)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="git revision of the other side (e.g. HEAD, main~3)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="2 MiB commits per side per round")
    parser.add_argument("--calls", type=int, default=2000, help="status() calls per side per round")
    parser.add_argument("--out", type=Path, help="write the rounds and their medians here as JSON")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.steps, args.calls)))
        return 0
    if not args.baseline:
        parser.error("--baseline REV is required")
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hbmd-ab-") as scratch:
        baseline = export(args.baseline, Path(scratch))
        for i in range(args.rounds):
            order = [("baseline", baseline), ("this tree", None)]
            if i % 2:
                order.reverse()
            figures = {name: side(entry, args.steps, args.calls) for name, entry in order}
            rounds.append(figures)
            print(json.dumps({name: {k: v for k, v in f.items() if k != "tree"} for name, f in figures.items()}),
                  flush=True)
    result: dict[str, Any] = {"baseline": args.baseline, "rounds": rounds, "median_of_rounds_p50_us": {}}
    for what in ("commit_2mib_no_lease", "status"):
        medians = {name: statistics.median(r[name][what]["p50_us"] for r in rounds) for name in rounds[0]}
        medians["ratio_this_over_baseline"] = round(medians["this tree"] / medians["baseline"], 3)
        result["median_of_rounds_p50_us"][what] = medians
    print(json.dumps(result["median_of_rounds_p50_us"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
