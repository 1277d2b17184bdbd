"""The exact fp16 product of many rows on tensor cores (docs/exl3.md#many-row-gemm):

    gemm(a [M, K] fp16, b [G, K, N] fp16, spans) -> y [M, N] float32,
    y[r] = a[r] · b[g] for the rows r of spans[g] = (first, end), fp32 sums

The EXL3 product xh · W̃ of a prefill has fp16 operands, so each product is exact and only the
sums round. MLX's matmul returns its input dtype: an fp16 GEMM would round the fp32 sums to fp16
(a second rounding before the output transform), and an fp32 GEMM runs on CUDA cores without TF32,
which this package turns off (docs/numerics.md#tf32). This kernel reads fp16, multiplies on the
tensor cores (mma.m16n8k16, fp32 accumulation) and writes float32. It is used on CUDA; on Metal,
where its body runs per-lane FMAs, MLX's fp32 matmul is the path (ops choose).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_dsv41 import graph_constants
from mlx_dsv41.kernels import Kernel, backend, register

BM, BN, BK = 64, 128, 32  # f16_gemm.h: F16G_BM, F16G_BN, F16G_BK
_THREADS = 256

GEMM = register(
    Kernel(
        "f16_gemm",
        ("a", "b", "tiles"),
        ("y",),
        includes=("f16_gemm.h",),
        max_threads=_THREADS,
        examples=lambda: _examples(),
    )
)


def row_tiles(spans) -> np.ndarray:
    """int32 [T, 3]: (first row, end row, g) of every tile of at most BM rows of each span."""
    tiles = [(r, min(r + BM, end), g) for g, (first, end) in enumerate(spans) for r in range(first, end, BM)]
    return np.array(tiles, np.int32).reshape(-1, 3)


@graph_constants.constant
def _dense_tiles(m: int) -> np.ndarray:
    return row_tiles([(0, m)])


def gemm_args(a: mx.array, b: mx.array, tiles: mx.array, guard: int = 0, init_value=None) -> dict:
    M, N = a.shape[0], b.shape[2]
    return dict(
        inputs=[a, b, tiles],
        output_shapes=[(M + guard, N)],
        output_dtypes=[mx.float32],
        grid=(_THREADS * (N // BN), tiles.shape[0], 1),
        threadgroup=(_THREADS, 1, 1),
        init_value=init_value,
    )


def takes_kernel(k: int, n: int) -> bool:
    """Whether a k x n product runs on f16_gemm: on CUDA, k a multiple of BK, n of BN (EXL3 pads
    both to 128)."""
    return backend() == "cuda" and k % BK == 0 and n % BN == 0


def gemm(a: mx.array, b: mx.array, spans=None) -> mx.array:
    """See the module docstring; ``spans`` default: every row times b[0]. The spans must cover
    rows 0 .. M - 1 in order (the rows of no span are not written)."""
    if a.dtype != mx.float16 or b.dtype != mx.float16 or a.ndim != 2 or b.ndim != 3 or a.shape[1] != b.shape[1]:
        raise ValueError(
            f"f16_gemm: a [M, K] and b [G, K, N] must be fp16, got {a.dtype} {a.shape}, {b.dtype} {b.shape}"
        )
    if spans is None:
        tiles = _dense_tiles(a.shape[0])
    else:
        if len(spans) != b.shape[0] or spans[0][0] != 0 or spans[-1][1] != a.shape[0]:
            raise ValueError(f"f16_gemm: spans {spans[:3]}... must cover the {a.shape[0]} rows, one per b")
        tiles = mx.array(row_tiles(spans))
    return GEMM(**gemm_args(a, b, tiles))[0]


def _examples():
    a = mx.random.normal((70, 256), key=mx.random.key(1)).astype(mx.float16)
    b = mx.random.normal((2, 256, 128), key=mx.random.key(2)).astype(mx.float16)
    return [gemm_args(a, b[:1], _dense_tiles(70)), gemm_args(a, b, mx.array(row_tiles([(0, 5), (5, 70)])))]
