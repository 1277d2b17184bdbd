"""What loading a converted checkpoint holds and peaks at (issue 16 item 5), for bench_model.py --load:
the parameters' bytes (by dtype), MLX's peak memory during `load(path, lazy=False)` above what was in
use before, their ratio (target <= 1.05), the head's dtype and bytes (held as stored: bf16), the
process's max RSS and the load time.

`--load-synthetic` first writes bench_convert.py's synthetic official checkpoint (Flash's tensor
shapes, 4 layers of 16 experts, one Engram layer: ~5.3 GB) and converts it, under --out.
"""

from __future__ import annotations

import resource
import sys
import time
from collections import Counter
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(path: Path) -> dict:
    from mlx_dsv41 import loading

    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    model = loading.load_converted(path, lazy=False)
    seconds = time.perf_counter() - t0
    params = dict(tree_flatten(model.parameters()))
    by_dtype = Counter()
    for v in params.values():
        by_dtype[str(v.dtype).removeprefix("mlx.core.")] += v.nbytes
    total = sum(by_dtype.values())
    peak = mx.get_peak_memory() - before
    head = params.get("head.weight")
    return {
        "checkpoint": str(path),
        "load_s": seconds,
        "params_GB": total / 1e9,
        "params_GB_by_dtype": {k: v / 1e9 for k, v in sorted(by_dtype.items())},
        "load_peak_GB": peak / 1e9,
        "peak_over_params": peak / total,
        "head": None if head is None else {"dtype": str(head.dtype).removeprefix("mlx.core."), "GB": head.nbytes / 1e9},
        "rss_GB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
    }


def synthetic_checkpoint(workdir: Path) -> Path:
    """bench_convert's synthetic official checkpoint, converted (both reused when present)."""
    import bench_convert

    from mlx_dsv41.convert import convert_checkpoint

    src, out = workdir / "load_src", workdir / "load_converted"
    if not (src / "config.json").exists():
        bench_convert.write_source(src, bench_convert.bench_args())
    if not (out / "config.json").exists():
        convert_checkpoint(src, out, progress=False)
    return out


def table(r: dict) -> str:
    head = r["head"] or {"dtype": "—", "GB": float("nan")}
    dtypes = ", ".join(f"{k} {v:.2f}" for k, v in r["params_GB_by_dtype"].items())
    return (
        "| checkpoint | load s | parameters GB (by dtype) | load peak GB | peak / parameters | head | max RSS GB |\n"
        "|---|---:|---|---:|---:|---|---:|\n"
        f"| {r['checkpoint']} | {r['load_s']:.1f} | {r['params_GB']:.2f} ({dtypes}) | {r['load_peak_GB']:.2f} | "
        f"{r['peak_over_params']:.3f} | {head['dtype']} {head['GB']:.2f} GB | {r['rss_GB']:.2f} |"
    )
