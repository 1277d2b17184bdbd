"""The EXL3 input and output transforms around W̃ (docs/exl3.md#transforms).

Both sides use the natural-order (Sylvester) Hadamard of size 128, scaled by 1/sqrt(128) and applied
block-diagonally to consecutive 128-element blocks; it is symmetric and orthonormal.
"""

from __future__ import annotations

import math

import mlx.core as mx

BLOCK = 128
SCALE = 1 / math.sqrt(BLOCK)  # rounded to float32 wherever it is used, kernels included


def hadamard_128(x: mx.array, axis: int = -1) -> mx.array:
    """Block-diagonal H128 along ``axis`` (its size a multiple of 128), computed in float32."""
    x = mx.moveaxis(x.astype(mx.float32), axis, -1)
    n = x.shape[-1]
    if n % BLOCK:
        raise ValueError(f"Hadamard-128 needs a multiple of 128 elements, got {n}")
    y = mx.hadamard_transform(x.reshape(*x.shape[:-1], n // BLOCK, BLOCK), scale=SCALE)
    return mx.moveaxis(y.reshape(x.shape), -1, axis)


def input_transform(x: mx.array, suh: mx.array) -> mx.array:
    """xh = fp16(H128(fp16(x ⊙ suh))) for x [m, k] (already zero-extended to k):
    docs/exl3.md#forward steps 1-2.

    x ⊙ suh is formed in float32 and rounded once to fp16: for fp16 or bf16 x the product is exact
    in float32, so this equals exllamav3's fp16 multiply.
    """
    xs = (x.astype(mx.float32) * suh.astype(mx.float32)).astype(mx.float16)
    return hadamard_128(xs).astype(mx.float16)


def output_transform(acc: mx.array, svh: mx.array) -> mx.array:
    """y = H128(acc) ⊙ svh in float32 for acc [m, n]: docs/exl3.md#forward steps 4-5 (fp32-output
    form)."""
    return hadamard_128(acc) * svh.astype(mx.float32)
