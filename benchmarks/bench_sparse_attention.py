"""Sparse attention kernels on the GPU: serial vs parallel vs auto, per call (issue 2).

One decode call (64 heads, 1 row) and one prefill call (64 heads, 128 rows) at 128 and 640 keys,
D = 512, bf16 q and keys (the model's dtypes), W = 128 window rows and T = 8192 pool rows. Index
pattern per row as the model builds it: the window in order (contiguous rows), then the selected
pool entries (distinct, random, ascending). Each number is the median over --repeats of the time
to evaluate --calls launches queued together (after --warmup such rounds), divided by --calls:
microseconds per call, graph building excluded. `auto` goes through sparse_attention(); its first
call per shape class (which times both variants) is reported separately. serial and parallel
outputs are also compared byte for byte. Results: a markdown table on stdout and
bench_sparse_attention.json in --out.

    python3 benchmarks/bench_sparse_attention.py --out /tmp/bench_out   (on the GPU machine)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_dsv41.kernels import backend
from mlx_dsv41.kernels import sparse_attention as sa

H, D, W, T = 64, 512, 128, 8192
CASES = (("decode", 1, 128), ("decode", 1, 640), ("prefill", 128, 128), ("prefill", 128, 640))
TARGET_SPEEDUP = 3.5  # parallel over serial, decode at 640 keys
AUTO_NOISE = 1.10  # auto may be this much slower than the better variant


def make_inputs(rows: int, keys: int, seed: int):
    rng = np.random.default_rng(seed)

    def bf16(shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    window_part = np.arange(min(keys, W))
    picks = keys - len(window_part)
    indices = np.stack([np.concatenate([window_part, W + np.sort(rng.choice(T, picks, replace=False))])
                        for _ in range(rows)]).astype(np.int32)[None]
    inputs = (bf16((1, rows, H, D)), bf16((1, W, D)), bf16((1, T, D)), mx.array(indices),
              mx.array(rng.standard_normal(H).astype(np.float32)))
    mx.eval(*inputs)
    return inputs


def per_call_us(launch, calls: int, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        mx.eval([launch() for _ in range(calls)])
    samples = []
    for _ in range(repeats):
        outs = [launch() for _ in range(calls)]  # lazy: the kernels run inside eval
        t0 = time.perf_counter()
        mx.eval(outs)
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--decode-calls", type=int, default=200)
    ap.add_argument("--prefill-calls", type=int, default=20)
    args = ap.parse_args()
    if backend() == "cpu":
        print("bench_sparse_attention: needs an MLX GPU backend (Metal or CUDA); nothing measured")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    scale = D**-0.5
    t_start = time.perf_counter()
    results = []
    for i, (name, rows, keys) in enumerate(CASES):
        inputs = make_inputs(rows, keys, seed=i)
        calls = args.decode_calls if name == "decode" else args.prefill_calls
        serial, parallel = (np.array(sa._run(v, *inputs, scale)) for v in ("serial", "parallel"))
        identical = serial.view(np.uint32).tobytes() == parallel.view(np.uint32).tobytes()
        launches = {
            "serial": lambda: sa._run("serial", *inputs, scale),
            "parallel": lambda: sa._run("parallel", *inputs, scale),
            "auto": lambda: sa.sparse_attention(*inputs, scale, variant="auto"),
        }
        t0 = time.perf_counter()
        mx.eval(launches["auto"]())  # first call of this shape class: auto times both variants
        auto_first_ms = (time.perf_counter() - t0) * 1e3
        us = {v: per_call_us(f, calls, args.repeats, args.warmup) for v, f in launches.items()}
        choice = sa.auto_choices()[sa._shape_class(*inputs[:2], inputs[3])]
        best = min(us["serial"], us["parallel"])
        results.append(dict(
            case=name, rows=rows, heads=H, keys=keys, calls_per_eval=calls,
            serial_us=us["serial"], parallel_us=us["parallel"], auto_us=us["auto"],
            auto_choice=choice, auto_first_call_ms=auto_first_ms,
            speedup=us["serial"] / us["parallel"],
            auto_over_best=us["auto"] / best, bytes_identical=identical,
        ))
    decode_640 = next(r for r in results if r["case"] == "decode" and r["keys"] == 640)
    summary = dict(
        device=str(mx.default_device()), backend=backend(), mlx=mx.__version__,
        shapes=dict(H=H, D=D, W=W, T=T, dtype="bfloat16"), repeats=args.repeats,
        warmup=args.warmup, results=results,
        decode_640_speedup=decode_640["speedup"],
        target_met=decode_640["speedup"] >= TARGET_SPEEDUP,
        auto_within_noise=all(r["auto_over_best"] <= AUTO_NOISE for r in results),
        all_bytes_identical=all(r["bytes_identical"] for r in results),
        parallel_refusals={str(k): v for k, v in sa.parallel_refusals().items() if v},
        seconds=time.perf_counter() - t_start,
    )
    (args.out / "bench_sparse_attention.json").write_text(json.dumps(summary, indent=2))

    print(f"sparse attention, {backend()}, H={H} D={D} bf16, W={W} T={T}; µs per call (median)")
    print("| case | rows | keys | serial µs | parallel µs | auto µs (choice) | parallel speedup "
          "| auto first call ms | serial == parallel bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(f"| {r['case']} | {r['rows']} | {r['keys']} | {r['serial_us']:.1f} "
              f"| {r['parallel_us']:.1f} | {r['auto_us']:.1f} ({r['auto_choice']}) "
              f"| {r['speedup']:.2f}x | {r['auto_first_call_ms']:.1f} | {r['bytes_identical']} |")
    print(f"decode @640 keys: parallel {decode_640['speedup']:.2f}x serial "
          f"(target >= {TARGET_SPEEDUP}x: {'met' if summary['target_met'] else 'NOT met'}); "
          f"auto within {AUTO_NOISE:.2f}x of the better everywhere: "
          f"{summary['auto_within_noise']}; "
          f"{summary['seconds']:.0f} s")
    return 0 if summary["all_bytes_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
