"""What fp32 sums cost per linear (issue 15): device time and error of MLX's matmul kernels with the
activation as it comes (bf16) against fp32 activations, and of our modules (quant/accumulation.py
picks per backend, op, weight width and rows), at 1 and 512 rows; and the head held in bf16 and
summed in fp32 (kernels/fp32_linear.py) against its fp32 copy, at 1, 5 (a DSpark verify) and 512 rows;
and fp32_gemv on weights of few rows (the mHC mixes' fn, a router), K split over 8 SIMD groups per
output (the default below fp32_linear.SPLIT_BELOW_N rows) against one SIMD group per 4 outputs.

Square 5120 x 5120 layers, so each call's output feeds the next (a dependent chain of --chain calls
between two device clock stamps, medians of --repeats; bench_sparse_attention.device_us), in the
formats of the official release (FP8 -> mxfp8, FP4 -> mxfp4), dense bf16, and routed experts
(mxfp4 `gather_qmm`, 6 slots per token, summed back to one row). The error column is the relative L2
error of one call against float64 `x @ W` rounded once (W decoded exactly).

    python3 benchmarks/bench_linear_arithmetic.py --out DIR        # GPU (CUDA)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sparse_attention import device_us  # noqa: E402

from mlx_dsv41.kernels import backend, fp32_linear, mxfp4_gemv  # noqa: E402
from mlx_dsv41.quant import make_experts, make_linear, mx_experts  # noqa: E402
from mlx_dsv41.synthetic_checkpoints import decode_fp4, decode_fp8, quantize_fp4, quantize_fp8  # noqa: E402

K = 5120
E, TOPK = 16, 6


def _layer(fmt: str, seed: int = 0):
    w = np.random.default_rng(seed).standard_normal((K, K)) / np.sqrt(K)
    if fmt == "mxfp8":
        codes, scale = quantize_fp8(w)
        return make_linear({"p.weight": mx.array(codes), "p.scale": mx.array(scale)}, "p", K, K), decode_fp8(
            codes, scale
        )
    if fmt == "mxfp4":
        packed, scale = quantize_fp4(w)
        return make_linear({"p.weight": mx.array(packed), "p.scale": mx.array(scale)}, "p", K, K), decode_fp4(
            packed, scale
        )
    wb = mx.array(w.astype(np.float32)).astype(mx.bfloat16)
    return make_linear({"p.weight": wb}, "p", K, K), np.array(wb.astype(mx.float32), np.float64)


def _raw(layer, x):
    """MLX's own op on x as given (the state before the policy)."""
    if hasattr(layer, "scales"):
        return mx.quantized_matmul(
            x, layer.weight, layer.scales, transpose=True, group_size=32, bits=layer.bits, mode=layer.mode
        ).astype(mx.bfloat16)
    return (x @ layer.weight.T).astype(mx.bfloat16)


PADDED_ROWS = 8  # CUDA: quantized products with 8 or more rows take qmm, which sums in fp32


def _pad_rows(x):
    return mx.concatenate([x, mx.zeros((PADDED_ROWS - x.shape[0], x.shape[1]), x.dtype)])


ERR_ROWS = 16  # the error is measured on the first rows (float64 on the host is slow at 512)


def _err(y, x, w) -> float:
    want = np.array(x[:ERR_ROWS].astype(mx.float32), np.float64) @ w.T
    got = np.array(y[:ERR_ROWS].astype(mx.float32), np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def linears(rows_list, chain, repeats) -> list[dict]:
    out = []
    for fmt in ("mxfp8", "mxfp4", "dense bf16"):
        layer, w = _layer(fmt)
        mx.eval(layer.parameters())
        for rows in rows_list:
            x = mx.array(np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32)).astype(mx.bfloat16)
            variants = {
                "bf16 x (MLX as is)": lambda v: _raw(layer, v),
                "fp32 x": lambda v: _raw(layer, v.astype(mx.float32)),
                "ours (policy)": lambda v: layer(v),
            }
            if rows < PADDED_ROWS:  # an alternative to fp32 x: enough rows for the fp32-summing qmm
                variants["bf16 x padded to 8 rows"] = lambda v: _raw(layer, _pad_rows(v))[: v.shape[0]]
            for name, fn in variants.items():
                us = device_us(lambda i, prev: fn(prev), x, repeats, chain)
                out.append({"what": fmt, "rows": rows, "variant": name, "us": us, "rel_err": _err(fn(x), x, w)})
                print(_row(out[-1]), flush=True)
    return out


@contextlib.contextmanager
def _activations_as_given():
    """The experts with the policy switched off: gather_qmm gets x as it comes (no mxfp4_gemv)."""
    saved = mx_experts.quantized_input, mxfp4_gemv.takes_kernel
    mx_experts.quantized_input, mxfp4_gemv.takes_kernel = (lambda x, *a: x), (lambda *a: False)
    try:
        yield
    finally:
        mx_experts.quantized_input, mxfp4_gemv.takes_kernel = saved


def experts(rows_list, chain, repeats) -> list[dict]:
    rng = np.random.default_rng(3)
    tensors = {}
    for e in range(E):
        for p, (o, i) in (("w1", (2304, K)), ("w3", (2304, K)), ("w2", (K, 2304))):
            packed, scale = quantize_fp4(rng.standard_normal((o, i)) / np.sqrt(i))
            tensors[f"x.{e}.{p}.weight"], tensors[f"x.{e}.{p}.scale"] = mx.array(packed), mx.array(scale)
    module = make_experts(tensors, "x", E, K, 2304, 10.0)
    mx.eval(module.parameters())
    out = []
    for rows in rows_list:
        idx = mx.array(np.sort(np.stack([rng.choice(E, TOPK, replace=False) for _ in range(rows)]), 1).astype(np.int32))
        wts = mx.array(rng.uniform(0.1, 0.4, (rows, TOPK)).astype(np.float32))
        x = mx.array(rng.standard_normal((rows, K)).astype(np.float32)).astype(mx.bfloat16)
        step = lambda i, prev: module(prev, idx, wts).sum(1).astype(mx.bfloat16)  # noqa: E731
        out.append(
            {
                "what": "experts mxfp4 (gather_qmm x3)",
                "rows": rows,
                "variant": "ours (policy)",
                "us": device_us(step, x, repeats, chain),
                "rel_err": None,
            }
        )
        print(_row(out[-1]), flush=True)
        with _activations_as_given():
            out.append(
                {
                    "what": "experts mxfp4 (gather_qmm x3)",
                    "rows": rows,
                    "variant": "bf16 x (MLX as is)",
                    "us": device_us(step, x, repeats, chain),
                    "rel_err": None,
                }
            )
        print(_row(out[-1]), flush=True)
    return out


VOCAB = 129280  # Flash's head: [129280, 5120] bf16


def head(rows_list, chain, repeats) -> list[dict]:
    """The head as session 8 held it (an fp32 copy, MLX's fp32 matmul) against the stored bf16
    through fp32_linear (fp32_gemv up to 8 rows, widened pieces beyond): issue 16 item 5."""
    wb = (mx.random.normal((VOCAB, K), key=mx.random.key(9)) * K**-0.5).astype(mx.bfloat16)
    w32 = wb.astype(mx.float32)
    mx.eval(wb, w32)
    w = np.array(w32, np.float64)
    variants = {
        "fp32-held weight (2.65 GB)": lambda v: v.astype(mx.float32) @ w32.T,
        "bf16 weight, fp32 sums (ours)": lambda v: fp32_linear.linear(v, wb),
    }
    out = []
    for rows in rows_list:
        x = mx.array(np.random.default_rng(rows).standard_normal((rows, K)).astype(np.float32)).astype(mx.bfloat16)
        for name, fn in variants.items():
            step = lambda i, prev, fn=fn: fn(prev)[:, :K].astype(prev.dtype)  # noqa: E731 (a dependent chain)
            y = fn(x)
            want = np.array(x[:ERR_ROWS].astype(mx.float32), np.float64) @ w.T
            err = float(np.linalg.norm(np.array(y[:ERR_ROWS], np.float64) - want) / np.linalg.norm(want))
            out.append(
                {
                    "what": "head 129280 x 5120",
                    "rows": rows,
                    "variant": name,
                    "us": device_us(step, x, repeats, chain),
                    "rel_err": err,
                }
            )
            print(_row(out[-1]), flush=True)
    return out


def few_row_weights(rows_list, chain, repeats) -> list[dict]:
    """fp32_gemv at split 8 (default) and split 1 on the mHC fn and a 256-expert router's shapes; the
    chain feeds each output back through a fixed slice (the output is narrower than x)."""
    out = []
    for what, N, Kw, dtype in (
        ("mHC fn 24 x 20480 fp32", 24, 4 * K, mx.float32),
        ("router 256 x 5120", 256, K, mx.bfloat16),
    ):
        w = (mx.random.normal((N, Kw), key=mx.random.key(3)) * Kw**-0.5).astype(dtype)
        for rows in rows_list:
            x = mx.random.normal((rows, Kw), key=mx.random.key(rows)).astype(mx.bfloat16)
            mx.eval(w, x)
            want = np.array(x.astype(mx.float32), np.float64) @ np.array(w.astype(mx.float32), np.float64).T
            for split in (8, 1):

                def fn(v, split=split):
                    return fp32_linear.GEMV(**fp32_linear.gemv_args(v, w, split=split))[0]

                def step(i, prev, fn=fn):  # a dependent chain: x's first N columns become the output
                    return mx.concatenate([fn(prev).astype(prev.dtype), prev[:, N:]], axis=1)

                y = np.array(fn(x), np.float64)
                out.append(
                    {
                        "what": what,
                        "rows": rows,
                        "variant": f"fp32_gemv, split {split}" + (" (default)" if split == 8 else ""),
                        "us": device_us(step, x, repeats, chain),
                        "rel_err": float(np.linalg.norm(y - want) / np.linalg.norm(want)),
                    }
                )
                print(_row(out[-1]), flush=True)
    return out


HEADER = "| layer | rows | variant | device µs / call | rel. error vs float64 |\n|---|---|---|---|---|"


def _row(r: dict) -> str:
    err = "—" if r["rel_err"] is None else f"{r['rel_err']:.2e}"
    return f"| {r['what']} | {r['rows']} | {r['variant']} | {r['us']:.1f} | {err} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_out"))
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 512])
    a = ap.parse_args()
    if a.chain < 1 or a.repeats < 1 or min(a.rows) < 1:
        ap.error("--chain, --repeats and --rows must be >= 1")
    if backend() != "cuda":
        print("bench_linear_arithmetic: needs MLX's CUDA backend (device clock stamps); nothing measured")
        return 0
    results = few_row_weights([r for r in sorted({*a.rows, 5}) if r <= fp32_linear.MAX_ROWS], a.chain, a.repeats)
    results += head(sorted({*a.rows, 5}), a.chain, a.repeats) + linears(a.rows, a.chain, a.repeats)
    results += experts(a.rows, a.chain, a.repeats)
    print("\n".join([HEADER, *map(_row, results)]))
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "bench_linear_arithmetic.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
