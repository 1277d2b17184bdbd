"""The reference's fp32 linears from weights held as stored (docs/numerics.md#fp32-linears):

    linear(x [..., K], w [N, K]) -> y [..., N] float32,  y = fp32(x) · fp32(w)ᵀ, fp32 sums

The head, the router, the ratio > 1 compressor projections and DSpark's markov and confidence heads
are computed by the reference from fp32 copies of bf16 tensors. Holding those copies doubles the
head's memory and the bytes read per token, so the weights stay bf16 (or fp16) and are widened where
they are used:
- on a GPU, up to 8 rows, the fp32_gemv kernel reads the 16-bit weights and sums in fp32; a row's
  bytes do not depend on the other rows (solo == batched, a verify row == a one-row step);
- otherwise (the CPU reference, many rows, K not a multiple of 8) pieces of `w` are widened and
  multiplied with MLX's matmul, which sums fp32 inputs in fp32 on every backend; a piece is at most
  `PIECE_BYTES` of fp32, so no full fp32 copy of a large weight ever exists.
fp32 weights (the mHC mixes' `fn`) take the same kernel: one launch where MLX needs a cast of x first.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlx_dsv41.kernels import Kernel, backend, register

MAX_ROWS = 8  # rows of x one fp32_gemv launch takes (its per-lane accumulators are M x COLS)
_COLS, THREADS = 4, 256  # outputs per SIMD group; 8 SIMD groups per threadgroup
# Weights of fewer rows than this split K over a threadgroup's 8 SIMD groups, one output each: at
# 4 outputs per SIMD group the mHC mixes' fn (24 rows) ran in one threadgroup, 126 µs per call on
# the H200, 10 ms of a Flash decode step (docs/benchmarks.md, twelfth session).
SPLIT_BELOW_N = 2048
PIECE_BYTES = 1 << 26  # fp32 bytes of w widened at once off the kernel path
_W_CODES = {mx.float32: 0, mx.float16: 1, mx.bfloat16: 2}

GEMV = register(
    Kernel(
        "fp32_gemv", ("x", "w"), ("y",), includes=("fp32_gemv.h",), max_threads=THREADS, examples=lambda: _examples()
    ),
)


def linear_reference(x: mx.array, w: mx.array, piece_bytes: int = PIECE_BYTES) -> mx.array:
    """x [M, K] float32 · fp32(w)ᵀ, widening at most `piece_bytes` of w at a time."""
    N, K = w.shape
    rows = max(1, piece_bytes // (4 * K))
    if w.dtype == mx.float32 or N <= rows:
        return x @ w.astype(mx.float32).T
    return mx.concatenate([x @ w[i : i + rows].astype(mx.float32).T for i in range(0, N, rows)], axis=-1)


def gemv_launch(rows: int, w: mx.array, split: int | None = None) -> dict:
    """The grid, threadgroup and template of fp32_gemv's work for `rows` rows of x against w [N, K]
    (also the first part of the launches that finish it: hc_site, moe_gate); split: SIMD groups per
    output (1 or 8), by default 8 below SPLIT_BELOW_N rows of w. It sets the order of an output's
    sums (fp32_gemv.metal), so it depends on w alone."""
    N = w.shape[0]
    split = split or (8 if N < SPLIT_BELOW_N else 1)
    cols = 1 if split > 1 else _COLS
    per_group = cols * (THREADS // 32) // split
    return dict(
        grid=(THREADS * math.ceil(N / per_group), 1, 1),
        threadgroup=(THREADS, 1, 1),
        template=[("M", rows), ("COLS", cols), ("SPLIT", split), ("W", _W_CODES[w.dtype])],
    )


def gemv_args(x: mx.array, w: mx.array, init_value=None, guard: int = 0, split: int | None = None) -> dict:
    """Kernel kwargs for x [..., K] (rows in order; no reshape: the output is [..., N], or [M + guard,
    N] with ``guard`` rows for tests); split: as `gemv_launch`."""
    M, N = math.prod(x.shape[:-1]), w.shape[0]
    return dict(
        inputs=[x, w],
        output_shapes=[(*x.shape[:-1], N) if not guard else (M + guard, N)],
        output_dtypes=[mx.float32],
        init_value=init_value,
        **gemv_launch(M, w, split),
    )


def takes_kernel(rows: int, w: mx.array) -> bool:
    """Whether `rows` rows against w run on fp32_gemv (a GPU, K a multiple of 8)."""
    return 1 <= rows <= MAX_ROWS and w.dtype in _W_CODES and w.shape[1] % 8 == 0 and backend() != "cpu"


def linear(x: mx.array, w: mx.array) -> mx.array:
    """See the module docstring. x any float dtype, w [N, K] float32, bfloat16 or float16."""
    if w.ndim != 2 or not mx.issubdtype(w.dtype, mx.floating) or not mx.issubdtype(x.dtype, mx.floating):
        raise ValueError(f"fp32 linear: w must be a float [N, K] and x float, got {w.dtype} {w.shape} and {x.dtype}")
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"fp32 linear: x {x.shape} does not end in K = {K} (w {w.shape})")
    lead = x.shape[:-1]
    rows = math.prod(lead)
    if takes_kernel(rows, w):
        return GEMV(**gemv_args(x, w))[0]  # [..., N]: the kernel reads x's rows in order
    return linear_reference(x.reshape(rows, K).astype(mx.float32), w).reshape(*lead, N)


def _examples():
    x = mx.random.normal((3, 256), key=mx.random.key(4))
    w = mx.random.normal((100, 256), key=mx.random.key(5))
    return [
        gemv_args(x.astype(mx.bfloat16), w.astype(mx.bfloat16)),
        gemv_args(x[:1], w.astype(mx.float16)),
        gemv_args(x.astype(mx.bfloat16)[:2], w),
        gemv_args(mx.concatenate([x, x, x[:2]]), w.astype(mx.bfloat16)),
        gemv_args(x[:1], w.astype(mx.bfloat16), split=1),
        gemv_args(mx.concatenate([x, x, x[:2]]), w, split=1),
    ]
