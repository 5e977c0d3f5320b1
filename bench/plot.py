"""Commit latency against size (log-log), hbmd and in-process, from a gpu_bench result (needs matplotlib).

    python3 bench/plot.py [bench/results/h200-DATE.json] [--out commit.png]

Without a result it plots the newest GPU run under bench/results/ (by the
date its meta records) into bench/results/commit-latency.png, the picture the
README shows: rerun it after a new GPU run so that the picture tells the truth.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).with_name("results")
PICTURE = RESULTS / "commit-latency.png"


def newest_gpu_result() -> Path | None:
    """The GPU run under ``bench/results/`` with a commit case, the newest by its recorded date."""
    runs = []
    for path in RESULTS.glob("*.json"):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        meta = result.get("meta", {}) if isinstance(result, dict) else {}
        if meta.get("gpu_name") and result.get("cases", {}).get("commit", {}).get("sizes"):
            runs.append((meta.get("date_utc", ""), path.name, path))
    return max(runs)[2] if runs else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("result", type=Path, nargs="?",
                        help="a gpu_bench.py (or host_bench.py) JSON result (default: the newest GPU run)")
    parser.add_argument("--out", type=Path, help=f"PNG to write (default: the result's name with .png; {PICTURE} for "
                        "the newest GPU run)")
    args = parser.parse_args()
    if args.result is None:
        args.result, args.out = newest_gpu_result(), args.out or PICTURE
        if args.result is None:
            print(f"no GPU result with a commit case under {RESULTS}", file=sys.stderr)
            return 1
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1

    result = json.loads(args.result.read_text())
    sizes = result.get("cases", {}).get("commit", {}).get("sizes")
    if not sizes:
        print(f"{args.result} has no commit case to plot", file=sys.stderr)
        return 1
    out = args.out or args.result.with_suffix(".png")
    meta = result["meta"]
    x = [s["bytes"] for s in sizes]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side, label, marker in (("hbmd", "hbmd (daemon + FD + import/map)", "o"),
                                ("in_process", "in-process (create/map/access)", "s")):
        p50 = [s["commit"][side]["p50_us"] / 1e3 for s in sizes]
        p99 = [s["commit"][side]["p99_us"] / 1e3 for s in sizes]
        ax.errorbar(x, p50, yerr=[[0] * len(p50), [hi - lo for lo, hi in zip(p50, p99)]], marker=marker,
                    capsize=3, label=f"{label}, p50 (bar to p99)")
    for s in sizes:
        ax.annotate(f"×{s['commit']['ratio_p50']:.2f}", (s["bytes"], s["commit"]["hbmd"]["p50_us"] / 1e3),
                    textcoords="offset points", xytext=(4, 8), fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [s["label"] for s in sizes])
    ax.set_xlabel("bytes committed in one call (one chunk), zeroed and synchronized")
    ax.set_ylabel("latency (ms)")
    device = meta.get("gpu_name") or meta.get("backend", result["bench"])
    run = "quick run, " if result.get("quick") else ""
    ax.set_title(f"commit latency on {device}, {run}{meta['date_utc'][:10]} (labels: hbmd ÷ in-process)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
