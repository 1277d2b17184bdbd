"""mxfp4 products of a few rows with fp32 sums (docs/numerics.md#mxfp4-gemv):

    linear(x [M, K], weight [N, K/8], scales [N, K/32]) -> y [M, N] float32       (M <= 8)
    gathered(x [T, K], weight [E, N, K/8], scales [E, N, K/32], rows, experts)
        -> y [S, N] float32, y[s] = x[rows[s]] · W_{experts[s]}ᵀ

MLX's CUDA qmv kernels (fewer than 8 rows) keep bf16 partial sums for bf16 x and 4-bit weights
(quant/accumulation.py); widening x to fp32 cost 15 µs per linear and 145 µs per expert layer on
the H200 (docs/benchmarks.md, tenth session). This kernel reads x in its own dtype, decodes the
codes exactly and sums in fp32. Used on CUDA where MLX's kernel would sum in bf16.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlx_dsv41 import graph_constants
from mlx_dsv41.kernels import Kernel, backend, register

MAX_ROWS = 8  # rows sharing one weight read (the per-lane sums are M x COLS)
_COLS = 4  # outputs per threadgroup (M x COLS <= 32 lane sums)
_MAX_SPLIT = 8  # SIMD groups splitting k (the body's threadgroup memory holds 8)

GEMV = register(
    Kernel(
        "mxfp4_gemv",
        ("x", "w", "scales", "slots"),
        ("y",),
        includes=("mxfp4.h",),
        max_threads=32 * _MAX_SPLIT,
        examples=lambda: _examples(),
    )
)


def gemv_args(x, weight, scales, slots, rows_per_group: int, guard: int = 0, init_value=None) -> dict:
    """Kernel kwargs: weight [E, N, K/8] and scales [E, N, K/32] stacked, slots int32 [G, 2] of
    (first x row, expert); rows_per_group (M) consecutive x rows per group. A threadgroup of
    split(K) SIMD groups per COLS outputs of a group."""
    N, G = weight.shape[1], slots.shape[0]
    threads = 32 * split(weight.shape[2] * 8)
    return dict(
        inputs=[x, weight, scales, slots],
        output_shapes=[(G * rows_per_group + guard, N)],
        output_dtypes=[mx.float32],
        grid=(threads * math.ceil(N / _COLS), G, 1),
        threadgroup=(threads, 1, 1),
        template=[("M", rows_per_group), ("COLS", _COLS)],
        init_value=init_value,
    )


def split(K: int) -> int:
    """SIMD groups per threadgroup (S), each taking a run of consecutive 256-k steps: about 4 steps
    each (one batch of loads in flight per SIMD group), at most 8. From K alone, because it sets
    the order of the sums."""
    return min(_MAX_SPLIT, max(1, math.ceil(math.ceil(K / 256) / 4)))


def takes_kernel(bits: int, mode: str, rows: int) -> bool:
    """Whether `rows` rows (token-slot pairs for experts) of an MX product take this kernel: on
    CUDA, mxfp4, fewer rows than MLX's qmv limit (where MLX would sum bf16 x in bf16)."""
    return backend() == "cuda" and mode == "mxfp4" and bits == 4 and 1 <= rows < MAX_ROWS


def linear(x: mx.array, weight: mx.array, scales: mx.array) -> mx.array:
    """x [M, K] (M <= 8) times one mxfp4 weight [N, K/8] -> float32 [M, N]."""
    args = gemv_args(x, weight[None], scales[None], graph_constants.array(((0, 0),), mx.int32), x.shape[0])
    return GEMV(**args)[0]


def gathered(x: mx.array, weight: mx.array, scales: mx.array, rows: mx.array, experts: mx.array) -> mx.array:
    """Slot s = x[rows[s]] times expert experts[s]'s weight -> float32 [S, N]."""
    slots = mx.stack([rows.astype(mx.int32), experts.astype(mx.int32)], axis=1)
    return GEMV(**gemv_args(x, weight, scales, slots, 1))[0]


def _examples():
    w = mx.random.normal((3, 100, 256), key=mx.random.key(7))
    q, s = mx.quantize(w, group_size=32, bits=4, mode="mxfp4")
    x = mx.random.normal((5, 256), key=mx.random.key(8))
    one = graph_constants.array(((0, 0),), mx.int32)
    return [
        gemv_args(x.astype(mx.bfloat16), q[:1], s[:1], one, 5),
        gemv_args(x, q, s, mx.array([[0, 2], [4, 0], [1, 1]], mx.int32), 1),
    ]
