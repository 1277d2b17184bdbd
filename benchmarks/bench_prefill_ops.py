"""The many-token EXL3 ops of a prefill one at a time, on Flash's shapes (issue 17 item 3).

For m prompt rows: a dense EXL3 linear (reconstruct, the product with fp32 sums between the
transforms) at Flash's attention and shared-expert shapes, and the routed experts (top-6 of
`--experts` held experts, 2304 wide: `ops.experts_sorted`); on a GPU also each linear's product
alone, `f16_gemm` beside MLX's fp16 matmul (cuBLAS on CUDA: what the tensor cores give), with
TFLOP/s. Each case: the host's graph-building time, the synchronous wall time of one call
(median of --repeats after a warm-up), and on CUDA the kernels and device time of one call
(CUPTI), with the kernels that took most of it. `--no-graphs` runs the same with MLX's CUDA graphs off
(MLX_USE_CUDA_GRAPHS=0, in a child process: MLX reads it once).

    python3 benchmarks/bench_prefill_ops.py --rows 512 2048 --out /tmp/out      (on the GPU machine)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import flash_model  # noqa: E402
from bench_model import cuda_kernels  # noqa: E402

from mlx_dsv41.kernels import f16_gemm  # noqa: E402

LINEARS = [("wq_a", 5120, 1024), ("wq_b", 1024, 32768), ("shared w1", 5120, 2304), ("shared w2", 2304, 5120)]


def timed(fn, repeats: int) -> dict:
    mx.eval(fn())  # warm-up: JIT compiles, caches
    build, wall = [], []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        y = fn()
        t1 = time.perf_counter()
        mx.eval(y)
        wall.append(time.perf_counter() - t0)
        build.append(t1 - t0)
    out = {"build_ms": 1e3 * statistics.median(build), "wall_ms": 1e3 * statistics.median(wall)}
    cu = cuda_kernels(lambda: mx.eval(fn()))
    if cu:
        out |= {"kernels": cu["kernels"], "device_ms": cu["device_ms"], "top_ms": cu["top_ms"][:6]}
    return out


def cases(rows: int, experts: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    for name, d_in, d_out in LINEARS:
        lin = flash_model.exl3_linear(name, d_in, d_out, 3, seed)
        x = mx.array(rng.normal(0, 1, (rows, d_in)).astype(np.float32)).astype(mx.bfloat16)
        yield f"EXL3 linear {name} {d_in}x{d_out}, K=3", lambda lin=lin, x=x: lin(x)
        if mx.default_device() == mx.gpu and f16_gemm.takes_kernel(d_in, d_out):
            # the product alone: our kernel, and MLX's fp16 matmul (cuBLAS, fp16 out) as the yardstick
            a = mx.array(rng.normal(0, 1, (rows, d_in)).astype(np.float16))
            b = mx.array(rng.normal(0, 0.02, (1, d_in, d_out)).astype(np.float16))
            flops = 2 * rows * d_in * d_out
            yield f"f16_gemm {d_in}x{d_out}", lambda a=a, b=b: f16_gemm.gemm(a, b), flops
            yield f"MLX fp16 matmul {d_in}x{d_out}", lambda a=a, b=b: a @ b[0], flops
    args = flash_model.flash_args(3, experts=experts)
    ex = flash_model.exl3_experts("experts", args, 3, seed)
    x = mx.array(rng.normal(0, 1, (rows, args.hidden_size)).astype(np.float32)).astype(mx.bfloat16)
    idx = mx.array(np.stack([rng.permutation(experts)[:6] for _ in range(rows)]).astype(np.int32))
    w = mx.array(rng.uniform(0.05, 0.3, (rows, 6)).astype(np.float32))
    yield f"routed experts, top-6 of {experts}, K=3", lambda: ex(x, idx, w)


def run(rows_list, experts: int, repeats: int) -> list[dict]:
    results = []
    for rows in rows_list:
        for label, fn, *flops in cases(rows, experts):
            r = {"case": label, "rows": rows} | timed(fn, repeats)
            if flops and "device_ms" in r:
                r["tflops"] = flops[0] / r["device_ms"] / 1e9
            print(json.dumps(r), flush=True)
            results.append(r)
    return results


def table(results: list[dict], graphs: str) -> str:
    lines = [
        f"| case ({graphs}) | rows | build ms | wall ms (sync) | kernels | device ms | TFLOP/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        dev = f"{r['device_ms']:.2f}" if "device_ms" in r else "—"
        tflops = f"{r['tflops']:.0f}" if "tflops" in r else "—"
        timing = f"{r['build_ms']:.2f} | {r['wall_ms']:.2f} | {r.get('kernels', '—')} | {dev} | {tflops}"
        lines.append(f"| {r['case']} | {r['rows']} | {timing} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[512])
    ap.add_argument("--experts", type=int, default=flash_model.HELD_EXPERTS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-graphs", action="store_true", help="also with MLX_USE_CUDA_GRAPHS=0")
    ap.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)  # the child's output
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if min(a.rows + [a.experts - 5, a.repeats]) < 1:
        print("error: --rows and --repeats must be positive, --experts at least 6", file=sys.stderr)
        return 2
    results = run(a.rows, a.experts, a.repeats)
    if a.json:
        a.json.write_text(json.dumps(results))
        return 0
    text = [table(results, "CUDA graphs on" if mx.default_device() == mx.gpu else "CPU")]
    if a.no_graphs:
        child = Path(a.out or "/tmp") / "bench_prefill_ops_nographs.json"
        argv = [sys.executable, __file__, "--rows", *map(str, a.rows), "--experts", str(a.experts)]
        subprocess.run(
            [*argv, "--repeats", str(a.repeats), "--json", str(child)],
            check=True,
            env=os.environ | {"MLX_USE_CUDA_GRAPHS": "0"},
        )
        text.append(table(json.loads(child.read_text()), "CUDA graphs off"))
    print("\n\n".join(text))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "bench_prefill_ops.md").write_text("\n\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
