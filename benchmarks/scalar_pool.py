"""What a kernel pays to read or write MLX's small arrays on CUDA (issue 16; docs/benchmarks.md,
seventeenth session).

MLX 0.32's CUDA allocator gives every array of at most 8 bytes (a 0-d position, a dynamic
offset, a sampled token) a block of one managed-memory pool (`cudaMallocManaged`, advised
`AccessedBy` the GPU), and an array made on the host managed memory whatever its size; larger
GPU outputs come from device memory (`cudaMallocAsync`). A page of managed memory that the host
touches moves to the host, and the GPU keeps reading it there. Each case below chains N
dependent launches that read (or write) one kind of array and reports CUPTI's device time per
launch, so the cases compare directly:

    python3 benchmarks/scalar_pool.py [--n 200] [--out DIR]

Cases, in the order run (the pool's pages see the host only where a case says so):
- add, device vector: `x + s`, s a [1] view of a 16-byte GPU output (device memory)
- add, pool scalar, GPU-written: s a 0-d GPU output (the pool), never read by the host
- add, pool scalar, host-made: s = mx.array(3.0) (the pool, written by the host)
- add, pool scalar, GPU-written then host-read: the second case's kind after `s.item()`
- slice_update at a start from device memory / from a host-made pool scalar
- scalar chain: `s = s + one` on 0-d arrays (each output a pool block) / on [4] vectors
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import cuda_kernels  # noqa: E402


def per_launch(build, n: int, repeats: int = 3) -> dict:
    """Median over repeats of CUPTI's device µs per launch of the kernels `build()`'s graph runs."""
    mx.eval(build())  # JIT and first-touch outside the timing
    runs = []
    for _ in range(repeats):
        out = build()
        got = cuda_kernels(lambda: mx.eval(out))
        if got is None:
            raise SystemExit("scalar_pool.py: needs MLX's CUDA backend and torch's profiler (CUPTI)")
        runs.append(got)
    kinds = {name: (count, ms) for name, count, ms in runs[-1]["all"]}
    return {
        "us_per_launch": statistics.median(1e3 * r["device_ms"] / max(r["kernels"], 1) for r in runs),
        "launches": runs[-1]["kernels"],
        "kernels": {name: [count, round(1e3 * ms / count, 2)] for name, (count, ms) in kinds.items()},
    }


def add_chain(s: mx.array, n: int):
    def build():
        x = mx.arange(1024, dtype=mx.float32)  # device memory
        for _ in range(n):
            x = x + s
        return x

    return build


def update_chain(start: mx.array, n: int):
    def build():
        buf = mx.zeros((1, 64, 256), mx.bfloat16) + 1  # a device-memory cache row buffer
        row = mx.ones((1, 1, 256), mx.bfloat16) * 2
        for _ in range(n):
            buf = mx.slice_update(buf, row, start, axes=(1,))
            row = row + 1  # one more kernel, device memory only, so each update waits on a write
        return buf

    return build


def scalar_chain(seed: mx.array, n: int):
    def build():
        s, one = seed, seed * 0 + 1
        for _ in range(n):
            s = s + one
        return s

    return build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200, help="dependent launches per case")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    n = a.n

    vec4 = mx.arange(4, dtype=mx.float32) + 3  # 16 bytes: device memory
    gpu_scalar = mx.max(mx.arange(4, dtype=mx.float32))  # 0-d GPU output: a pool block
    mx.eval(vec4, gpu_scalar)
    cases = {}
    cases["add, device vector"] = per_launch(add_chain(vec4[:1], n), n)
    cases["add, pool scalar, GPU-written"] = per_launch(add_chain(gpu_scalar, n), n)
    host_scalar = mx.array(3.0)
    cases["add, pool scalar, host-made"] = per_launch(add_chain(host_scalar, n), n)
    gpu_read = mx.max(mx.arange(4, dtype=mx.float32) * 2)
    mx.eval(gpu_read)
    gpu_read.item()
    cases["add, pool scalar, GPU-written then host-read"] = per_launch(add_chain(gpu_read, n), n)
    cases["add, pool scalar, GPU-written (after the host touched the pool)"] = per_launch(add_chain(gpu_scalar, n), n)

    ivec4 = mx.arange(4, dtype=mx.int32) + 5
    mx.eval(ivec4)
    cases["slice_update, start in device memory"] = per_launch(update_chain(ivec4[:1], n // 2), n)
    cases["slice_update, start host-made (pool)"] = per_launch(update_chain(mx.array([5], mx.int32), n // 2), n)

    seed0 = mx.max(mx.arange(4, dtype=mx.float32))
    seed4 = mx.arange(4, dtype=mx.float32) * 1
    mx.eval(seed0, seed4)
    cases["scalar chain, 0-d (pool outputs)"] = per_launch(scalar_chain(seed0, n), n)
    cases["scalar chain, [4] (device outputs)"] = per_launch(scalar_chain(seed4, n), n)

    width = max(map(len, cases))
    print(f"{'case':{width}s}  µs/launch  launches  kernels (count, µs each)")
    for name, r in cases.items():
        top = ", ".join(f"{k.split('::')[-1][:28]} {c} x {us}" for k, (c, us) in r["kernels"].items())
        print(f"{name:{width}s}  {r['us_per_launch']:9.2f}  {r['launches']:8d}  {top}")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "scalar_pool.json").write_text(json.dumps({"n": n, "mlx": mx.__version__, "cases": cases}, indent=1))


if __name__ == "__main__":
    main()
