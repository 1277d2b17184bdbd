"""QAT fake quantization (docs/model.md#fake-quant): round a tensor to the values an FP8 / FP4 block
format can hold, and keep it in its own dtype. This is model semantics, not an optimisation: the
reference attends over, and scores with, these rounded values.

Three uses, all along the last axis:
  window KV          fake_quant_fp8(x, 32)                    e4m3, ue8m0 scale per 32
  compressed KV      fake_quant_fp4(x, 16, scale="e4m3")      e2m1, e4m3(amax/6) scale per 16
  indexer q and k    fake_quant_fp4(x, 32)                    e2m1, ue8m0 scale per 32

Rounding is round-to-nearest-even on the target grid (FP4 ties at 0.25, 1.25, 2.5, 5 go down,
at 0.75, 1.75, 3.5 go up), with saturation at the grid's largest finite value. Scales:
ue8m0 = 2^ceil(log2(amax / max)), a power of two; e4m3 = the e4m3 rounding (RNE) of amax / 6.

Exponents are read from the fp32 bit pattern, not from log2, so every rule is exact on every
backend. All products and quotients by power-of-two scales are exact in fp32, and every result
(≤ 4 significant bits times a ≤ 4-bit scale) is exact in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_dsv41.kernels import backend
from mlx_dsv41.kernels import fake_quant as kernel


@dataclass(frozen=True)
class FloatGrid:
    """The finite values of a small float format: sign, exponent >= min_exponent, mantissa bits."""

    mantissa_bits: int
    min_exponent: int  # exponent of the smallest normal; subnormals share its quantum
    max_value: float  # largest finite value; larger magnitudes saturate to it


E4M3 = FloatGrid(mantissa_bits=3, min_exponent=-6, max_value=448.0)  # OCP float8_e4m3fn
E2M1 = FloatGrid(mantissa_bits=1, min_exponent=0, max_value=6.0)  # OCP float4_e2m1fn

# Floors on a block's amax, so an all-zero block gets a finite, normal scale.
_FP8_AMAX_FLOOR = 1e-4  # as the reference's FP8 activation quantizer (docs/numerics.md#dtypes)
_FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126  # amax/6 = smallest normal fp32 (docs/model.md#indexer)
_FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9  # amax/6 = smallest e4m3 subnormal (docs/model.md#compressor)


def _floor_log2(a: mx.array) -> mx.array:
    """floor(log2(a)) for non-negative normal fp32 a (int32); 0 and subnormals give -127."""
    return mx.right_shift(mx.view(a, mx.int32), 23) - 127


def _exp2(k: mx.array) -> mx.array:
    """2^k as fp32 for int32 k in [-126, 127], built from the exponent field."""
    return mx.view(mx.left_shift(k + 127, 23), mx.float32)


def _sign_bit(v: mx.array) -> mx.array:
    return mx.view(v, mx.int32) < 0


def round_to_grid(v: mx.array, grid: FloatGrid) -> mx.array:
    """Round fp32 v to the nearest value of `grid`, ties to even, saturating at ±max_value."""
    v = v.astype(mx.float32)
    a = mx.minimum(mx.abs(v), grid.max_value)
    # The spacing of grid values around a is 2^(e - mantissa_bits), e = a's exponent (clamped to
    # the subnormal range). Dividing by a power of two is exact; mx.round is half-to-even.
    quantum = _exp2(mx.maximum(_floor_log2(a), grid.min_exponent) - grid.mantissa_bits)
    r = mx.round(a / quantum) * quantum
    return mx.where(_sign_bit(v), -r, r)


def ue8m0_scale(amax: mx.array, max_value: float) -> mx.array:
    """2^ceil(log2(amax / max_value)) for positive normal amax / max_value (fp32)."""
    y = amax / max_value
    inexact = mx.bitwise_and(mx.view(y, mx.int32), 0x7FFFFF) != 0  # not a power of two: round up
    return _exp2(_floor_log2(y) + inexact.astype(mx.int32))


def _blocks(x: mx.array, block: int, what: str) -> mx.array:
    if x.shape[-1] % block:
        raise ValueError(f"{what}: last dim {x.shape[-1]} is not a multiple of the block size {block}")
    return x.astype(mx.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _amax(blocks: mx.array, floor: float) -> mx.array:
    return mx.maximum(mx.max(mx.abs(blocks), axis=-1, keepdims=True), floor)


def _on_kernel(x: mx.array, block: int) -> bool:
    """A GPU runs the fake_quant kernel (the same operations, one launch); the CPU these."""
    return backend() != "cpu" and kernel.takes(x, block)


def fake_quant_fp8(x: mx.array, block: int = 32) -> mx.array:
    """FP8 e4m3 with one ue8m0 (power-of-two) scale per `block` values of the last axis."""
    if _on_kernel(x, block):
        return kernel.run(x, block, kernel.FP8_UE8M0)
    b = _blocks(x, block, "fake_quant_fp8")
    scale = ue8m0_scale(_amax(b, _FP8_AMAX_FLOOR), E4M3.max_value)
    return (round_to_grid(b / scale, E4M3) * scale).reshape(x.shape).astype(x.dtype)


def fake_quant_fp4(x: mx.array, block: int, scale: str = "ue8m0") -> mx.array:
    """FP4 e2m1 with one scale per `block` values of the last axis; scale "ue8m0" or "e4m3"."""
    if scale not in ("ue8m0", "e4m3"):
        raise ValueError(f"fake_quant_fp4: scale must be 'ue8m0' or 'e4m3', got {scale!r}")
    if _on_kernel(x, block):
        return kernel.run(x, block, kernel.FP4_UE8M0 if scale == "ue8m0" else kernel.FP4_E4M3)
    b = _blocks(x, block, "fake_quant_fp4")
    if scale == "ue8m0":
        s = ue8m0_scale(_amax(b, _FP4_UE8M0_AMAX_FLOOR), E2M1.max_value)
    else:
        s = round_to_grid(_amax(b, _FP4_E4M3_AMAX_FLOOR) / E2M1.max_value, E4M3)
    # An e4m3 scale may round below amax/6: the quotient then exceeds 6 and saturates.
    return (round_to_grid(b / s, E2M1) * s).reshape(x.shape).astype(x.dtype)


@dataclass(frozen=True)
class FakeQuant:
    """One use of the fake quantization (the table above), to hand to an op that ends with it (the
    rope kernel applies it in the same launch)."""

    block: int
    mode: int  # kernels.fake_quant's FP8_UE8M0, FP4_UE8M0 or FP4_E4M3

    def __call__(self, x: mx.array) -> mx.array:
        if self.mode == kernel.FP8_UE8M0:
            return fake_quant_fp8(x, self.block)
        return fake_quant_fp4(x, self.block, "ue8m0" if self.mode == kernel.FP4_UE8M0 else "e4m3")


WINDOW_KV = FakeQuant(32, kernel.FP8_UE8M0)
COMPRESSED_KV = FakeQuant(16, kernel.FP4_E4M3)
INDEXER = FakeQuant(32, kernel.FP4_UE8M0)
