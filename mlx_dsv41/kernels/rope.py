"""The rope kernel (docs/numerics.md#rope-launch): RoPE over whole rows of x [B, S, H, D] at
positions offset.., in one launch, optionally with the cast and the RMSNorm before it and the fake
quantization after it (docs/model.md#fake-quant), each of which is otherwise its own launch. It
computes what mx.fast.rope computes, expression for expression, on rows laid out as the model holds
them (no transpose to put positions on axis -2, so no copy after it); the norm is hc_collapse_norm's
for one stream, operation for operation.

    run(x, offset, periods, out_dtype, step, inverse, quant, norm, ring) -> x's shape in out_dtype
    quant: None or (block, mode), mode one of kernels.fake_quant's modes
    norm: None or (weight [D], eps)
    ring: None, or a window ring [B, R, D] in out_dtype: the result is then the ring with x's rows
          [B, S, D] written at slots (offset + s) % R (docs/cache.md#window-ring), in the same launch

    run_pair(q, x, ...) -> (the plain rope of q [B, S, H, D], run(x, ...)): the two in one rope_pair
          launch, each row with its own launch's bytes (the queries and the window keys of a layer)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlx_dsv41.kernels import Kernel, fake_quant, float_bits, register, scalar_int32

_THREADS = 256

ROPE = register(
    Kernel(
        "rope",
        ("x", "offset", "period", "weight", "ring"),
        ("out",),
        includes=("fake_quant.h", "float_bits.h", "hc.h", "rope.h"),
        max_threads=_THREADS,
        examples=lambda: _examples(),
    )
)
PAIR = register(
    Kernel(
        "rope_pair",
        ("q", "x", "offset", "period", "weight", "ring"),
        ("q_out", "out"),
        includes=("fake_quant.h", "float_bits.h", "hc.h", "rope.h"),
        max_threads=_THREADS,
        examples=lambda: _pair_examples(),
    )
)


@dataclass(frozen=True)
class Turn:
    """The plain rope (no norm, no quantization) of the rows a kernel stores, for a kernel that turns
    its own output (exl3_gemv's ROPE, docs/design.md#roped-linears): row s of [.., S, .., D] at
    position offset + s (a 0-d int32), pair k of each D = 2 · len(periods) values by periods[k];
    `apply(y)` is that rope as its own launch, for where the storing kernel cannot (the caller's)."""

    offset: mx.array
    periods: mx.array
    apply: Callable[[mx.array], mx.array] | None = None


@dataclass(frozen=True)
class WindowWrite:
    """The window keys' rope, for a kernel that writes them into the ring itself (exl3_gemv's RING):
    rows [B, S, D] through the RMSNorm (weight [D], eps), turned at offset + s by periods, fake
    quantized (quant = (block, mode)) and written at slots (offset + s) % R of ring [B, R, D]:
    what `run(rows, offset, periods, ring.dtype, 1, False, quant, (weight, eps), ring)` gives."""

    offset: mx.array
    periods: mx.array
    weight: mx.array
    eps: float
    quant: tuple[int, int]
    ring: mx.array

    def refusal(self, rows: tuple) -> str | None:
        """Why the rope kernel could not write rows of this shape so (the writer takes what it takes)."""
        why = shape_refusal(rows, self.quant, self.ring)
        D = rows[-1]
        if why is None and (self.weight.shape != (D,) or 2 * self.periods.shape[0] != D):
            why = f"a norm weight [{D}] and {D // 2} periods, got {self.weight.shape}, {self.periods.shape}"
        return why


def refusal(x: mx.array, quant: tuple[int, int] | None, ring: mx.array | None = None) -> str | None:
    """Why the kernel cannot take x (and write its rows into `ring`), or None (the offset is one
    position: a 0-d array)."""
    return shape_refusal(x.shape, quant, ring)


def shape_refusal(shape: tuple, quant: tuple[int, int] | None, ring: mx.array | None = None) -> str | None:
    """`refusal` for rows of this shape (a kernel that makes the rows itself: exl3_gemv's RING)."""
    shape, size = tuple(shape), math.prod(shape)
    if len(shape) not in (3, 4) or size == 0 or shape[-1] % 32:
        return f"rows [B, S, D] or [B, S, H, D] of a width that is a multiple of 32, got {shape}"
    size = max(size, 0 if ring is None else ring.size)
    if size >= 1 << 31:
        return f"{size} elements: the kernel indexes with 32 bits"
    if quant is not None and not fake_quant.takes_shape(shape, quant[0]):
        return f"fake quantization in blocks of {quant[0]} along a last axis of {shape[-1]}"
    if ring is not None and (
        len(shape) != 3 or ring.ndim != 3 or ring.shape[::2] != shape[::2] or shape[1] > ring.shape[1]
    ):
        return f"rows [B, S, D] into a ring [B, R >= S, D], got {shape} into {ring.shape}"
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
    ring: mx.array | None = None,
    init_value=None,
    guard: int = 0,
) -> dict:
    """Launch kwargs: a threadgroup per row of the output, in x's shape (the ring's with `ring`; as
    rows [rows + guard, D] with ``guard`` extra rows: tests). No reshape of x or of the output:
    each is a graph node a decode step would build and evaluate."""
    block, mode = quant or (32, 0)
    shape = x.shape if ring is None else ring.shape
    rows = math.prod(shape[:-1])
    weight, eps = norm if norm is not None else (periods, 0.0)  # without NORM the weight is not read
    offset = scalar_int32(offset)
    return dict(
        inputs=[x, offset, periods, weight, periods if ring is None else ring],  # without RING the ring is not read
        output_shapes=[shape if not guard else (rows + guard, shape[-1])],
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
            ("RING", int(ring is not None)),
        ],
        init_value=init_value,
        absent=(*(("weight",) if norm is None else ()), *(("ring",) if ring is None else ())),  # the stand-ins
    )


def run(x, offset, periods, out_dtype, step: int, inverse: bool, quant, norm=None, ring=None) -> mx.array:
    return ROPE(**args(x, offset, periods, out_dtype, step, inverse, quant, norm, ring))[0]


def pair_refusal(q: mx.array, x: mx.array, quant, ring: mx.array | None = None) -> str | None:
    """Why rope_pair cannot take q's plain rope with x's (`refusal`), or None."""
    why = refusal(q, None) or refusal(x, quant, ring)
    if why is None and (
        q.ndim != 4 or q.shape[-1] != x.shape[-1] or q.size + (ring if ring is not None else x).size >= 1 << 31
    ):
        why = f"queries [B, S, H, D] of x's width beside x, got {q.shape} beside {x.shape}"
    return why


def pair_args(
    q: mx.array,
    x: mx.array,
    offset,
    periods,
    out_dtype,
    step: int,
    inverse: bool,
    quant,
    norm=None,
    ring=None,
    init_value=None,
    guard: int = 0,
) -> dict:
    """rope_pair launch kwargs: q's rows' threadgroups, then `args`' for x (``guard`` rows past each
    output: tests)."""
    one = args(x, offset, periods, out_dtype, step, inverse, quant, norm, ring, init_value, guard)
    q_rows = math.prod(q.shape[:-1])
    return one | dict(
        inputs=[q, *one["inputs"]],
        output_shapes=[q.shape if not guard else (q_rows + guard, q.shape[-1]), *one["output_shapes"]],
        output_dtypes=[out_dtype, out_dtype],
        grid=(one["grid"][0] + _THREADS * q_rows, 1, 1),
    )


def run_pair(q, x, offset, periods, out_dtype, step: int, inverse: bool, quant, norm=None, ring=None):
    q_out, out = PAIR(**pair_args(q, x, offset, periods, out_dtype, step, inverse, quant, norm, ring))
    return q_out, out


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
        args(
            x[:, :1, 0],
            offset,
            periods,
            mx.bfloat16,
            1,
            False,
            (32, fake_quant.FP8_UE8M0),
            (mx.ones((64,)), 1e-20),
            mx.zeros((2, 6, 64), mx.bfloat16),
        ),
    ]


def _pair_examples():
    q = (mx.random.normal((2, 3, 4, 64), key=mx.random.key(9)) * 3).astype(mx.bfloat16)
    x = mx.random.normal((2, 3, 64), key=mx.random.key(10)).astype(mx.bfloat16)
    periods = mx.array([float("inf")] * 16 + [10000.0 ** (k / 16) for k in range(16)])
    offset, fp8 = mx.array(5, mx.int32), (32, fake_quant.FP8_UE8M0)
    return [
        pair_args(q, x, offset, periods, mx.bfloat16, 1, False, fp8, (mx.ones((64,)), 1e-20)),
        pair_args(
            q[:, :1],
            x[:, :1],
            offset,
            periods,
            mx.bfloat16,
            1,
            False,
            fp8,
            (mx.ones((64,)), 1e-20),
            mx.zeros((2, 6, 64), mx.bfloat16),
        ),
    ]
