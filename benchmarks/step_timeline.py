"""One profiled decode step's kernels in the order they ran (bench_model.py's `timeline`): per kernel
name, the launches, their median and total device µs, and the idle time before them (the gap from
the previous kernel's end: the device waiting on a launch, or on the host).

    python3 benchmarks/step_timeline.py logs/bench_model.json [--run N] [--first 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def summary(timeline: list) -> tuple[list, float, float]:
    """Rows (name, launches, median µs, total µs, total idle µs before them), busy µs, idle µs."""
    by_name, idle_before = defaultdict(list), defaultdict(float)
    end = None
    for name, start, dur in timeline:
        if end is not None and start > end:
            idle_before[name] += start - end
        end = start + dur if end is None else max(end, start + dur)
        by_name[name].append(dur)
    rows = [
        (name, len(ds), statistics.median(ds), sum(ds), idle_before[name])
        for name, ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    ]
    return rows, sum(r[3] for r in rows), sum(idle_before.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path)
    ap.add_argument("--run", type=int, default=0, help="which run of the file (0: the first)")
    ap.add_argument("--first", type=int, default=0, help="also list the first N kernels in order")
    args = ap.parse_args()
    try:
        run = json.loads(args.json.read_text())["runs"][args.run]
        timeline = run["decode"]["cuda"]["timeline"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        print(f"step_timeline: error: no timeline in {args.json} ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    rows, busy, idle = summary(timeline)
    print(f"{run['label']}: {len(timeline)} kernels, device {busy / 1e3:.2f} ms, idle between them {idle / 1e3:.2f} ms")
    print("| kernel | launches | median µs | total µs | idle before µs |\n|---|---:|---:|---:|---:|")
    for name, n, med, tot, gap in rows:
        print(f"| {name.replace('mlx::core::cu::', '')} | {n} | {med:.1f} | {tot:.0f} | {gap:.0f} |")
    for name, start, dur in timeline[: args.first]:
        print(f"{start:9.1f} {dur:7.1f}  {name.replace('mlx::core::cu::', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
