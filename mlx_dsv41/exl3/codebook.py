"""EXL3 codebooks: one 16-bit trellis state -> one fp16 weight (docs/exl3.md#codebooks).

All integer arithmetic is unsigned 32-bit with wrap-around on the zero-extended state; each
codebook rounds to fp16 exactly once, which is what makes a float32 computation bit-exact.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

CODEBOOKS = ("3inst", "mcg", "mul1")

# 3INST (no marker tensor): QTIP's constants.
INST3_MULTIPLIER = 89226354
INST3_ADDEND = 64248484
# Locked multipliers (exllamav3 0f2da5d); the marker tensors store them as int32.
MCG_MULTIPLIER = 0xCBAC1FED
MUL1_MULTIPLIER = 0x83DCD12D
MARKER_VALUES = {"mcg": MCG_MULTIPLIER, "mul1": MUL1_MULTIPLIER}

# cb 0/1: keep sign and low exponent/mantissa bits of both halves, then set the exponent bias.
HALVES_MASK = 0x8FFF8FFF
HALVES_XOR = 0x3B603B60
# MUL1: value = fp16((1024 + bytesum) * K_INV + K_BIAS), both constants exact fp16 numbers.
MUL1_K_INV = 1774 / 2**18  # fp16 0x1EEE
MUL1_K_BIAS = -1329 / 128  # fp16 0xC931


def _u32(v: int) -> mx.array:
    return mx.array(v, dtype=mx.uint32)


def _fp16_from_bits(bits: mx.array) -> mx.array:
    return mx.view(bits.astype(mx.uint16), mx.float16)


def byte_sum(x: mx.array) -> mx.array:
    """Sum of the four bytes of each uint32 (0..1020)."""
    ff = _u32(0xFF)
    return (x & ff) + ((x >> 8) & ff) + ((x >> 16) & ff) + (x >> 24)


def decode_states(states: mx.array, codebook: str) -> mx.array:
    """fp16 weights for uint32 states in [0, 65536), same shape."""
    s = states.astype(mx.uint32)
    if codebook == "mul1":
        x = s * _u32(MUL1_MULTIPLIER)
        h = (byte_sum(x) + 1024).astype(mx.float32)
        # (1024+bs)*1774 - 2721792 fits in 21 bits: this float32 expression is exact
        # (docs/exl3.md#codebooks).
        return (h * MUL1_K_INV + MUL1_K_BIAS).astype(mx.float16)
    if codebook == "mcg":
        x = s * _u32(MCG_MULTIPLIER)
    elif codebook == "3inst":
        x = s * _u32(INST3_MULTIPLIER) + _u32(INST3_ADDEND)
    else:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")
    x = (x & _u32(HALVES_MASK)) ^ _u32(HALVES_XOR)
    lo = _fp16_from_bits(x & _u32(0xFFFF)).astype(mx.float32)
    hi = _fp16_from_bits(x >> 16).astype(mx.float32)
    # Both halves lie in [2^-3, 2^0] in magnitude, so their float32 sum is exact: one rounding.
    return (lo + hi).astype(mx.float16)


def codebook_table(codebook: str) -> np.ndarray:
    """All 65,536 values of a codebook, fp16, indexed by state (docs/exl3.md#codebooks gives their SHA-256)."""
    states = mx.arange(1 << 16, dtype=mx.uint32)
    return np.array(decode_states(states, codebook))
