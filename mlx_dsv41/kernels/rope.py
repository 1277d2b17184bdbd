"""The rope kernel (docs/numerics.md#rope-launch): RoPE over whole rows of x [B, S, H, D] at
positions offset.., in one launch, optionally with the cast and the RMSNorm before it and the fake
quantization after it (docs/model.md#fake-quant), each of which is otherwise its own launch. It
computes what mx.fast.rope computes, expression for expression, on rows laid out as the model holds
them (no transpose to put positions on axis -2, so no copy after it); the norm is hc_collapse_norm's
for one stream, operation for operation.

    run(x, offset, periods, out_dtype, step, inverse, quant, norm) -> x's shape in out_dtype
    quant: None or (block, mode), mode one of kernels.fake_quant's modes
    norm: None or (weight [D], eps)
"""

from __future__ import annotations

import mlx.core as mx

from mlx_dsv41.kernels import Kernel, fake_quant, float_bits, register

_THREADS = 256

ROPE = register(
    Kernel(
        "rope",
        ("x", "offset", "period", "weight"),
        ("out",),
        includes=("fake_quant.h", "hc.h"),
        max_threads=_THREADS,
        examples=lambda: _examples(),
    )
)


def refusal(x: mx.array, quant: tuple[int, int] | None) -> str | None:
    """Why the kernel cannot take x, or None (the offset is one position: a 0-d array)."""
    if x.ndim not in (3, 4) or x.size == 0 or x.shape[-1] % 32:
        return f"rows [B, S, D] or [B, S, H, D] of a width that is a multiple of 32, got {x.shape}"
    if x.size >= 1 << 31:
        return f"{x.size} elements: the kernel indexes with 32 bits"
    if quant is not None and not fake_quant.takes(x, quant[0]):
        return f"fake quantization in blocks of {quant[0]} along a last axis of {x.shape[-1]}"
    return None


def args(
    x: mx.array,
    offset: mx.array,
    periods: mx.array,
    out_dtype,
    step: int,
    inverse: bool,
    quant: tuple[int, int] | None,
    norm: tuple[mx.array, float] | None = None,
    init_value=None,
    guard: int = 0,
) -> dict:
    """Launch kwargs: a threadgroup per row of x, the output in x's shape (as rows [rows + guard,
    D] with ``guard`` extra rows: tests). No reshape of x or of the output: each is a graph node a
    decode step would build and evaluate."""
    block, mode = quant or (32, 0)
    rows = x.size // x.shape[-1]
    weight, eps = norm if norm is not None else (periods, 0.0)  # without NORM the weight is not read
    return dict(
        inputs=[x, offset.astype(mx.int32).reshape(()) if offset.ndim else offset.astype(mx.int32), periods, weight],
        output_shapes=[x.shape if not guard else (rows + guard, x.shape[-1])],
        output_dtypes=[out_dtype],
        grid=(_THREADS * rows, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        template=[
            ("T", out_dtype),
            ("STEP", int(step)),
            ("INVERSE", int(bool(inverse))),
            ("NORM", int(norm is not None)),
            ("EPS_BITS", float_bits(eps)),
            ("QUANT", int(quant is not None)),
            ("BLOCK", block),
            ("MODE", mode),
        ],
        init_value=init_value,
    )


def run(x, offset, periods, out_dtype, step: int, inverse: bool, quant, norm=None) -> mx.array:
    return ROPE(**args(x, offset, periods, out_dtype, step, inverse, quant, norm))[0]


def _examples():
    x = (mx.random.normal((2, 3, 4, 64), key=mx.random.key(8)) * 3).astype(mx.bfloat16)
    periods = mx.array([float("inf")] * 16 + [10000.0 ** (k / 16) for k in range(16)])
    offset = mx.array(5, mx.int32)
    return [
        args(x, offset, periods, mx.bfloat16, 1, False, None),
        args(x.astype(mx.float32), offset, periods, mx.bfloat16, 1, True, None),
        args(x[:, :, 0], offset, periods, mx.bfloat16, 4, False, (32, fake_quant.FP8_UE8M0)),
        args(x, offset, periods, mx.bfloat16, 1, False, (16, fake_quant.FP4_E4M3)),
        args(x[:, :, 0], offset, periods, mx.bfloat16, 1, False, (32, fake_quant.FP8_UE8M0), (mx.ones((64,)), 1e-20)),
    ]
