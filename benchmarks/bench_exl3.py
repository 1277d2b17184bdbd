"""EXL3 linear and MoE kernels on the GPU against the exllamav3 anchor and MLX's own matmuls (issue 6).

For m = 1 and 8 rows (bf16 activations, bf16 outputs), K = 2..5 MUL1, on the DeepSeek-V4.1-Flash
shapes (in x out); then one token through 6 of 384 experts (gate+up 5120x2304, down 2304x5120) at
K = 2..5. Method (the anchor's): every case rotates over enough random weight sets (> --rotate-mib
in total) that weights stream from device memory rather than the 60 MB L2; --calls launches are
queued and evaluated together (graph building excluded); after a warm-up round (JIT compiles
included there), the median over --repeats rounds of time/calls is reported in microseconds.

Three timings per case:
- "device" (the anchor's method: calls inside one CUDA graph, device time only): a chain of
  DEVICE_CHAIN dependent calls between two %globaltimer stamps (bench_sparse_attention.stamp), all
  in one graph; the kernels plus the device's own gaps between dependent launches, without MLX's
  host cost per launch (~5-6 µs per custom kernel here, measured by profile_exl3.py --part host).
  CUDA only; this is the column compared with exllamav3;
- "chained" (what a model's layer sequence sees through MLX, host cost included): call i+1
  depends on call i's output (a linear takes it as its bias, an MoE block as its input), so no
  two calls overlap on the GPU;
- "independent" (as in the first GPU run): the calls have no data dependencies, and MLX's CUDA
  graphs may run them concurrently (a throughput, not a latency).
Packed bytes are the trellis bytes a call must read; the roofline is this device's read bandwidth
measured here (a large float32 reduction and a large copy, the faster). MLX baselines on the same
shapes: bf16 matmul, affine 4-bit (group 64) and mxfp4 quantized_matmul; for the MoE block,
gather_qmm. Results: markdown tables on stdout and bench_exl3.json in --out.

--quick: m = 1, K = 3 and 4, every shape, the MoE block, no MLX baselines; then --sweep: every
launch shape of SWEEP (mlx_dsv41.kernels.exl3.Tuning) on every shape at m = 1 and each K of
--sweep-bits (default 3), and the MoE block; a table of µs per shape, K and tuning with the best
marked. (~3 minutes.) --sweep-only skips everything but the sweep.

    python3 benchmarks/bench_exl3.py --out /tmp/bench_out                  (on the GPU machine)
    python3 benchmarks/bench_exl3.py --quick --out /tmp/bench_out
    python3 benchmarks/bench_exl3.py --sweep-only --sweep-bits 3 4 5 --shapes "expert w2" --out /tmp/b
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("MLX_MAX_OPS_PER_BUFFER", "64")  # a device-timed chain stays one graph (before MLX starts)

import mlx.core as mx  # noqa: E402
from bench_sparse_attention import device_us  # noqa: E402  (benchmarks/ is the script's directory)

from mlx_dsv41.exl3 import ops  # noqa: E402
from mlx_dsv41.exl3.experts import EXL3ExpertProjection, EXL3Experts  # noqa: E402
from mlx_dsv41.kernels import backend  # noqa: E402
from mlx_dsv41.kernels import exl3 as launch  # noqa: E402

SHAPES = (
    ("wq_a", 5120, 1280),
    ("wq_b", 1280, 32768),
    ("wkv", 5120, 512),
    ("wo_a group", 4096, 1024),
    ("wo_b", 8192, 5120),
    ("expert w1/w3", 5120, 2304),
    ("expert w2", 2304, 5120),
    ("head", 5120, 129280),
)
# exllamav3 v1.4.1 on the H200, fp16 activations (issue 6): (shape, K) -> (m=1 µs, m=8 µs).
ANCHOR = {
    ("wq_a", 3): (17.8, 18.1),
    ("wq_a", 4): (16.7, 16.9),
    ("wq_a", 5): (21.9, 22.6),
    ("wq_b", 3): (26.6, 27.9),
    ("wq_b", 4): (22.3, 22.5),
    ("wq_b", 5): (27.5, 29.2),
    ("wkv", 3): (17.5, 18.4),
    ("wkv", 4): (16.4, 17.1),
    ("wkv", 5): (21.6, 22.0),
    ("wo_a group", 3): (15.0, 15.4),
    ("wo_a group", 4): (14.1, 14.5),
    ("wo_a group", 5): (20.3, 20.8),
    ("wo_b", 3): (34.9, 35.8),
    ("wo_b", 4): (32.3, 33.4),
    ("wo_b", 5): (39.2, 40.8),
    ("expert w1/w3", 2): (16.3, 16.4),
    ("expert w1/w3", 3): (18.0, 18.5),
    ("expert w1/w3", 4): (16.8, 17.1),
    ("expert w2", 2): (12.7, 13.4),
    ("expert w2", 3): (13.4, 14.2),
    ("expert w2", 4): (12.7, 13.6),
    ("head", 4): (318.7, 322.1),
    ("head", 5): (380.7, 386.8),
}
ANCHOR_BITS = {name: sorted(b for s, b in ANCHOR if s == name) for name, _, _ in SHAPES}  # K measured per shape
MOE_ANCHOR = {2: 132.1, 3: 137.2, 4: 131.4, 5: 150.8}  # µs, one token, 6 of 384 experts
MOE_TARGET_US = 60.0  # K = 3
N_EXPERTS, TOP_K, HIDDEN, INTER = 384, 6, 5120, 2304

T = launch.Tuning
# Launch shapes measured by --sweep: the default and one change at a time.
SWEEP = {
    "default": T(),
    "4 groups x 4 columns": T(warps=4, gate_up_warps=4),
    "16 groups x 2 columns": T(warps=16, gate_up_warps=16, down_warps=16, nc=2),
    "8 groups x 8 columns": T(nc=8),
    "down: 16 groups": T(down_warps=16),
    "down: 4 groups": T(down_warps=4),
    "ring of 2 blocks": T(ring_words=3072),
    "2x SIMD groups (splits)": T(dense_split_warps=4224, gate_up_split_warps=12672),
    "1/2 SIMD groups (splits)": T(dense_split_warps=1056, gate_up_split_warps=3168),
    "down: 2x splits": T(down_split_warps=25344),
    "down: 1/2 splits": T(down_split_warps=6336),
    "down: no split": T(down_split_warps=1),
    "one launch from 32 col blocks": T(dense_single_blocks=32),
    "one launch from 512 col blocks": T(dense_single_blocks=512),
}


@contextlib.contextmanager
def tuning(t: launch.Tuning):
    saved = launch.TUNING
    launch.TUNING = t
    try:
        yield
    finally:
        launch.TUNING = saved


def per_call_us(launch, calls: int, repeats: int, chained: bool) -> float:
    """Median over rounds of the time per call; launch(i, prev) -> output (prev: the previous
    call's output when chained, else None)."""

    def round_():
        outs, prev = [], None
        for i in range(calls):
            prev = launch(i, prev if chained else None)
            outs.append(prev)
        return outs

    mx.eval(round_())  # warm-up: JIT, allocator, caches
    samples = []
    for _ in range(repeats):
        outs = round_()
        t0 = time.perf_counter()
        mx.eval(outs)
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


# Calls between two clock stamps (bench_sparse_attention.device_us): <= 2 launches each, one MLX
# CUDA graph with MLX_MAX_OPS_PER_BUFFER = 64 (set above).
DEVICE_CHAIN = 8


def n_sets(set_bytes: int, rotate_mib: int) -> int:
    return max(1, math.ceil(rotate_mib * 2**20 / set_bytes) + 1)


def calls_for(sets: int, minimum: int) -> int:
    """Every weight set is used once per round (at least ``minimum`` launches)."""
    return max(minimum, sets)


def device_read_bandwidth(repeats: int) -> dict:
    a = mx.random.uniform(shape=(1 << 30,))  # 4 GiB float32
    mx.eval(a)
    sum_us = per_call_us(lambda i, p: mx.sum(a), 4, repeats, False)
    copy_us = per_call_us(lambda i, p: a * 1.0, 4, repeats, False)
    read_sum = a.nbytes / sum_us / 1e3  # GB/s
    read_copy = a.nbytes / copy_us / 1e3  # the read half of a copy that moves 2x the bytes
    a = None  # frees the 4 GiB (the closures above read `a`: rebound, not deleted)
    return {
        "sum_read_GBps": read_sum,
        "copy_read_GBps": read_copy,
        "copy_total_GBps": 2 * read_copy,
        "roofline_GBps": max(read_sum, 2 * read_copy),
    }


def random_trellis(shape_prefix, bits: int) -> mx.array:
    """Random int16 trellis (every pattern is valid, docs/exl3.md#bit-ring): 16K words per tile."""
    return mx.random.randint(-(1 << 15), 1 << 15, (*shape_prefix, 16 * bits), dtype=mx.int16)


def random_words(shape) -> mx.array:
    """Random packed uint32 words (for MLX's quantized formats; only the timing matters)."""
    return mx.random.randint(-(1 << 31), (1 << 31) - 1, shape, dtype=mx.int32).view(mx.uint32)


def linear_sets(k, n, bits, rotate_mib):
    set_bytes = k * n * bits // 8 + 2 * (k + n)
    sets = []
    for _ in range(n_sets(set_bytes, rotate_mib)):
        sets.append(
            (
                random_trellis((k // 16, n // 16), bits),
                (mx.random.normal((k,)) * 0.02).astype(mx.float16),
                mx.random.normal((n,)).astype(mx.float16),
            )
        )
    mx.eval(sets)
    return sets


def exl3_time(sets, m, args, chained: bool) -> tuple[float, int]:
    k, n = sets[0][1].shape[0], sets[0][2].shape[0]
    x = mx.random.normal((m, k)).astype(mx.bfloat16)
    first_bias = mx.zeros((n,), mx.bfloat16) if chained else None  # one kernel variant for every call
    calls = calls_for(len(sets), args.calls)

    def launch(i, prev):
        # Chained: the previous output (as the bias) is an input of both launches of this call.
        return ops.linear(x, *sets[i % len(sets)], "mul1", bias=first_bias if prev is None else prev[0])

    return per_call_us(launch, calls, args.repeats, chained), calls


def exl3_device_time(sets, m, args) -> float:
    k, n = sets[0][1].shape[0], sets[0][2].shape[0]
    x = mx.random.normal((m, k)).astype(mx.bfloat16)
    # Each call's output row 0 is the next call's bias (both launches of a k-split call read it).
    return device_us(
        lambda i, prev: ops.linear(x, *sets[i % len(sets)], "mul1", bias=prev[0]),
        mx.zeros((1, n), mx.bfloat16),
        args.repeats,
        DEVICE_CHAIN,
    )


def timings(device, chained, independent, calls) -> dict:
    """The three timings of a case (device None where there is no device clock)."""
    return {"device_us": device, "chained_us": chained, "independent_us": independent, "calls": calls}


def headline_us(t: dict) -> float:
    """The number compared with the anchor: device time where measured, else chained wall time."""
    return t["device_us"] if t["device_us"] is not None else t["chained_us"]


def exl3_row(name, k, n, bits, m, t: dict, roofline, label="default") -> dict:
    splits, _ = launch.dense_plan(k // 128, n // 128)
    packed = k * n * bits // 8
    us = headline_us(t)
    anchor = ANCHOR.get((name, bits), (None, None))[0 if m == 1 else 1]
    return {
        "kind": "exl3",
        "shape": name,
        "k": k,
        "n": n,
        "K": bits,
        "m": m,
        **t,
        "tuning": label,
        "tuning_fields": asdict(launch.TUNING),
        "packed_GBps": packed / us / 1e3,
        "roofline_frac": packed / us / 1e3 / roofline,
        "anchor_us": anchor,
        "splits": splits,
        "launches": 1 if (m <= launch.GEMV_MAX_ROWS and splits == 1) else 2,
    }


def mlx_case(name, k, n, fmt, m, args, roofline) -> dict:
    def one():
        w = mx.random.normal((n, k)).astype(mx.bfloat16) * 0.02
        if fmt == "bf16":
            return (w,)
        if fmt == "affine4":
            return mx.quantize(w, group_size=64, bits=4)
        return mx.quantize(w, mode="mxfp4")

    w0 = one()
    set_bytes = sum(a.nbytes for a in w0)
    sets = [w0] + [one() for _ in range(n_sets(set_bytes, args.rotate_mib) - 1)]
    mx.eval(sets)
    x = mx.random.normal((m, k)).astype(mx.bfloat16)

    def launch(i, prev):
        w = sets[i % len(sets)]
        if fmt == "bf16":
            return x @ w[0].T
        if fmt == "affine4":
            return mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=4)
        return mx.quantized_matmul(x, *w, transpose=True, mode="mxfp4")

    calls = calls_for(len(sets), args.calls)
    us = per_call_us(launch, calls, args.repeats, False)
    sets = None  # frees the weights (launch() reads `sets`: rebound, not deleted)
    return {
        "kind": "mlx",
        "shape": name,
        "k": k,
        "n": n,
        "format": fmt,
        "m": m,
        "us": us,
        "chained": False,
        "packed_GBps": set_bytes / us / 1e3,
        "roofline_frac": set_bytes / us / 1e3 / roofline,
        "calls": calls,
    }


def routing(calls: int, seed: int):
    key = mx.random.key(seed)
    picks = []
    for _ in range(calls):
        k1, k2, key = mx.random.split(key, 3)
        idx = mx.argsort(mx.random.uniform(shape=(N_EXPERTS,), key=k1))[:TOP_K].astype(mx.int32)[None]
        w = mx.random.uniform(0.05, 0.5, (1, TOP_K), key=k2)
        picks.append((idx, w))
    mx.eval(picks)
    return picks


def moe_experts(bits) -> EXL3Experts:
    def projection(k, n):
        trellis = random_trellis((N_EXPERTS, k // 16, n // 16), bits)
        suh = (mx.random.normal((N_EXPERTS, k)) * 0.02).astype(mx.float16)
        svh = mx.random.normal((N_EXPERTS, n)).astype(mx.float16)
        return EXL3ExpertProjection.from_stacked(trellis, suh, svh, "mul1")

    experts = EXL3Experts(projection(HIDDEN, INTER), projection(HIDDEN, INTER), projection(INTER, HIDDEN), N_EXPERTS)
    mx.eval(experts.parameters())
    return experts


def moe_time(experts, bits, args, chained: bool) -> float:
    x = mx.random.normal((1, HIDDEN))  # float32, as the chained calls' inputs (one kernel variant)
    picks = routing(args.moe_calls, seed=bits)

    def launch(i, prev):
        # Chained: the previous block's first slot is this block's input.
        return experts(x if prev is None else prev.reshape(TOP_K, HIDDEN)[:1], *picks[i])

    return per_call_us(launch, args.moe_calls, args.repeats, chained)


def moe_device_time(experts, bits, args) -> float:
    # Each round routes its chain to other experts, and rounds differ by several µs (which experts
    # share L2 lines and SMs): the median needs more rounds than the dense rows (--moe-repeats).
    picks = routing(DEVICE_CHAIN * (args.moe_repeats + 1), seed=bits)
    return device_us(
        lambda i, prev: experts(prev.reshape(-1, HIDDEN)[:1], *picks[i]),
        mx.random.normal((1, HIDDEN)),
        args.moe_repeats,
        DEVICE_CHAIN,
    )


def moe_row(bits, t: dict, roofline, label="default") -> dict:
    packed = TOP_K * 3 * HIDDEN * INTER * bits // 8
    us = headline_us(t)
    return {
        "kind": "exl3_moe",
        "K": bits,
        **t,
        "tuning": label,
        "tuning_fields": asdict(launch.TUNING),
        "packed_GBps": packed / us / 1e3,
        "roofline_frac": packed / us / 1e3 / roofline,
        "anchor_us": MOE_ANCHOR[bits],
        "target_us": MOE_TARGET_US if bits == 3 else None,
    }


def moe_mlx_case(fmt, args, roofline) -> dict:
    """mlx-lm's SwitchGLU pattern: gather_qmm gate, up, silu * up, gather_qmm down (random bits)."""

    def stack(n, k):
        if fmt == "affine4":
            w = random_words((N_EXPERTS, n, k // 8))
            scales = (mx.random.uniform(shape=(N_EXPERTS, n, k // 64)) * 0.01).astype(mx.bfloat16)
            return w, scales, (mx.random.normal((N_EXPERTS, n, k // 64)) * 0.01).astype(mx.bfloat16)
        w = random_words((N_EXPERTS, n, k // 8))
        return w, mx.random.randint(118, 126, (N_EXPERTS, n, k // 32)).astype(mx.uint8)

    gate, up, down = stack(INTER, HIDDEN), stack(INTER, HIDDEN), stack(HIDDEN, INTER)
    mx.eval(gate, up, down)
    kw = dict(transpose=True, group_size=64, bits=4) if fmt == "affine4" else dict(transpose=True, mode="mxfp4")
    x = mx.random.normal((1, 1, 1, HIDDEN)).astype(mx.bfloat16)
    picks = routing(args.moe_calls, seed=99)

    def launch(i, prev):
        idx, w = picks[i]
        g = mx.gather_qmm(x, *gate, rhs_indices=idx, **kw)
        u = mx.gather_qmm(x, *up, rhs_indices=idx, **kw)
        h = (g * mx.sigmoid(g) * u).astype(mx.bfloat16)
        y = mx.gather_qmm(h, *down, rhs_indices=idx, **kw)
        return (y.squeeze(-2) * w[..., None]).sum(axis=-2)

    us = per_call_us(launch, args.moe_calls, args.repeats, False)
    packed = sum(a.nbytes for a in (*gate, *up, *down)) * TOP_K // N_EXPERTS
    gate = up = down = None  # frees the weights (launch() reads them: rebound, not deleted)
    return {
        "kind": "mlx_moe",
        "format": fmt,
        "us": us,
        "chained": False,
        "packed_GBps": packed / us / 1e3,
        "roofline_frac": packed / us / 1e3 / roofline,
        "calls": args.moe_calls,
    }


def fmt_us(v):
    return "–" if v is None else f"{v:.1f}"


def print_tables(bw, rows):
    print(
        f"\nDevice read bandwidth: {bw['roofline_GBps']:.0f} GB/s (sum {bw['sum_read_GBps']:.0f}, "
        f"copy {bw['copy_total_GBps']:.0f} GB/s read+write)\n"
    )
    main = [r for r in rows if r["kind"] == "exl3" and not r.get("sweep")]
    if main:
        print(
            "| shape (in x out) | K | m | device µs | chained µs | independent µs | packed GB/s (device) | "
            "of roofline | launches | exllamav3 µs | vs exllamav3 (device) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    order = [s[0] for s in SHAPES]
    for r in sorted(main, key=lambda r: (order.index(r["shape"]), r["K"], r["m"])):
        ratio = "–" if r["anchor_us"] is None else f"{r['anchor_us'] / headline_us(r):.2f}x"
        print(
            f"| {r['shape']} {r['k']}x{r['n']} | {r['K']} | {r['m']} | {fmt_us(r['device_us'])} | "
            f"{fmt_us(r['chained_us'])} | {fmt_us(r['independent_us'])} | {r['packed_GBps']:.0f} | "
            f"{100 * r['roofline_frac']:.0f}% | {r['launches']} | {fmt_us(r['anchor_us'])} | {ratio} |"
        )
    mlx_rows = [r for r in rows if r["kind"] == "mlx"]
    if mlx_rows:
        print("\n| shape (in x out) | m | MLX bf16 µs | MLX affine4 µs | MLX mxfp4 µs |")
        print("|---|---:|---:|---:|---:|")
        for name, k, n in SHAPES:
            for m in sorted({r["m"] for r in mlx_rows}):
                got = {r["format"]: r["us"] for r in mlx_rows if r["shape"] == name and r["m"] == m}
                if got:
                    print(
                        f"| {name} {k}x{n} | {m} | {fmt_us(got.get('bf16'))} | {fmt_us(got.get('affine4'))} | "
                        f"{fmt_us(got.get('mxfp4'))} |"
                    )
    moe = [r for r in rows if r["kind"] == "exl3_moe" and not r.get("sweep")]
    if moe:
        print(
            "\n| MoE block, 1 token, 6 of 384 experts | device µs | chained µs | independent µs | packed GB/s "
            "(device) | of roofline | exllamav3 µs | target µs |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in moe:
            print(
                f"| EXL3 K={r['K']} | {fmt_us(r['device_us'])} | {fmt_us(r['chained_us'])} | "
                f"{fmt_us(r['independent_us'])} | {r['packed_GBps']:.0f} | {100 * r['roofline_frac']:.0f}% | "
                f"{fmt_us(r['anchor_us'])} | {fmt_us(r['target_us'])} |"
            )
    for r in [r for r in rows if r["kind"] == "mlx_moe"]:
        print(
            f"| MLX gather_qmm {r['format']} (independent) | – | – | {r['us']:.1f} | {r['packed_GBps']:.0f} | "
            f"{100 * r['roofline_frac']:.0f}% | – | – |"
        )
    sweep = [r for r in rows if r["kind"] in ("exl3", "exl3_moe") and r.get("sweep")]
    if sweep:
        # Columns: (shape or "MoE block", K) pairs in measuring order.
        cols = list(dict.fromkeys((r.get("shape", "MoE block"), r["K"]) for r in sweep))
        print("\nSweep (device µs where measured, else chained; m = 1; * = best per column):\n")
        print("| tuning | " + " | ".join(f"{name} K={k}" for name, k in cols) + " |")
        print("|---|" + "---:|" * len(cols))
        best = {}
        for r in sweep:
            col = (r.get("shape", "MoE block"), r["K"])
            best[col] = min(best.get(col, math.inf), headline_us(r))
        for label in SWEEP:
            cells = []
            for col in cols:
                got = [
                    headline_us(r)
                    for r in sweep
                    if r["tuning"] == label and (r.get("shape", "MoE block"), r["K"]) == col
                ]
                cells.append("–" if not got else f"{got[0]:.1f}{'*' if got[0] == best[col] else ''}")
            print(f"| {label} | " + " | ".join(cells) + " |")


def linear_timings(sets, m, args, walls: bool = True) -> dict:
    """device (CUDA), chained and independent µs of one linear case (walls=False: device only
    where there is a device clock)."""
    device = exl3_device_time(sets, m, args) if backend() == "cuda" else None
    if device is not None and not walls:
        return timings(device, None, None, None)
    chained, calls = exl3_time(sets, m, args, True)
    independent, _ = exl3_time(sets, m, args, False)
    return timings(device, chained, independent, calls)


def moe_timings(experts, bits, args, walls: bool = True) -> dict:
    device = moe_device_time(experts, bits, args) if backend() == "cuda" else None
    if device is not None and not walls:
        return timings(device, None, None, None)
    return timings(device, moe_time(experts, bits, args, True), moe_time(experts, bits, args, False), args.moe_calls)


def run_sweep(args, roofline, rows, t_start):
    for bits in args.sweep_bits:
        for name, k, n in [s for s in SHAPES if s[0] in args.shapes]:
            sets = linear_sets(k, n, bits, args.rotate_mib)
            for label, t in SWEEP.items():
                with tuning(t):
                    rows.append(
                        dict(
                            exl3_row(name, k, n, bits, 1, linear_timings(sets, 1, args, walls=False), roofline, label),
                            sweep=True,
                        )
                    )
            del sets
            print(f"  sweep {name} K={bits}: done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
        if not args.skip_moe:
            experts = moe_experts(bits)
            for label, t in SWEEP.items():
                with tuning(t):
                    rows.append(
                        dict(moe_row(bits, moe_timings(experts, bits, args, walls=False), roofline, label), sweep=True)
                    )
            del experts
            print(f"  sweep MoE K={bits}: done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)


def positive_int(text: str) -> int:
    """argparse type: an int >= 1 (a median needs at least one round)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=positive_int, default=5, metavar="N")
    ap.add_argument("--calls", type=int, default=16, help="minimum launches per evaluation")
    ap.add_argument("--moe-calls", type=int, default=100)
    ap.add_argument(
        "--moe-repeats", type=positive_int, default=15, metavar="N", help="rounds of the MoE device time (median)"
    )
    ap.add_argument("--rotate-mib", type=int, default=256)
    ap.add_argument("--bits", type=int, nargs="+", help="K values (default: the anchor's per shape; MoE 2..5)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES])
    ap.add_argument("--skip-mlx", action="store_true", help="no MLX baselines")
    ap.add_argument("--skip-moe", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time every launch shape of SWEEP (m = 1)")
    ap.add_argument(
        "--sweep-bits",
        type=int,
        nargs="+",
        default=[3],
        choices=range(1, 9),
        metavar="K",
        help="K values of the sweep (1..8, default 3)",
    )
    ap.add_argument("--sweep-only", action="store_true", help="only the sweep (implies --sweep, --skip-mlx)")
    ap.add_argument("--quick", action="store_true", help="m = 1, K = 3 and 4, no MLX baselines, --sweep")
    args = ap.parse_args()
    if args.quick:
        args.bits, args.rows, args.skip_mlx, args.sweep = [3, 4], [1], True, True
    if args.sweep_only:
        args.sweep, args.skip_mlx = True, True
    if backend() == "cpu":
        print("bench_exl3: needs an MLX GPU backend (Metal or CUDA); nothing measured")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    bw = device_read_bandwidth(args.repeats)
    roofline = bw["roofline_GBps"]
    rows = []
    shapes = [] if args.sweep_only else [s for s in SHAPES if s[0] in args.shapes]
    for name, k, n in shapes:
        for bits in args.bits or ANCHOR_BITS[name]:
            sets = linear_sets(k, n, bits, args.rotate_mib)
            for m in args.rows:
                rows.append(exl3_row(name, k, n, bits, m, linear_timings(sets, m, args), roofline))
                r = rows[-1]
                print(
                    f"  {name} K={bits} m={m}: {fmt_us(r['device_us'])} µs device, {r['chained_us']:.1f} chained, "
                    f"{r['independent_us']:.1f} independent ({time.perf_counter() - t_start:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
            del sets
    if not args.skip_mlx:
        for name, k, n in shapes:
            for fmt in ("bf16", "affine4", "mxfp4"):
                for m in args.rows:
                    rows.append(mlx_case(name, k, n, fmt, m, args, roofline))
        print(f"  MLX baselines done ({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)
    if not args.skip_moe and not args.sweep_only:
        for bits in args.bits or sorted(MOE_ANCHOR):
            experts = moe_experts(bits)
            rows.append(moe_row(bits, moe_timings(experts, bits, args), roofline))
            del experts
            r = rows[-1]
            print(
                f"  MoE K={bits}: {fmt_us(r['device_us'])} µs device, {r['chained_us']:.1f} chained, "
                f"{r['independent_us']:.1f} independent ({time.perf_counter() - t_start:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
        if not args.skip_mlx:
            for fmt in ("affine4", "mxfp4"):
                rows.append(moe_mlx_case(fmt, args, roofline))
    if args.sweep:
        run_sweep(args, roofline, rows, t_start)
    print_tables(bw, rows)
    total = time.perf_counter() - t_start
    print(f"\nbench_exl3: {total:.0f} s")
    result = {
        "device": str(mx.default_device()),
        "backend": backend(),
        "mlx": mx.__version__,
        "bandwidth": bw,
        "rows": rows,
        "seconds": total,
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.out / "bench_exl3.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
