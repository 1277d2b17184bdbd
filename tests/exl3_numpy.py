"""An independent, deliberately plain numpy EXL3 decoder (docs/exl3.md#trellis,
docs/exl3.md#transforms), the oracle for tests.

Written from the formulations of docs/exl3.md, not from mlx_dsv41.exl3: the bit ring is unpacked into
an array of bits, half-integer K uses the D(p) = KA + ((0xAAAA >> (p & 15)) & 1) rule, and
the codebooks use numpy's float16 type for the one rounding.
"""

from __future__ import annotations

import numpy as np

MUL1, MCG = 0x83DCD12D, 0xCBAC1FED


def ring_bits(tiles_int16: np.ndarray) -> np.ndarray:
    """Bit rings S[..., 0 .. 256K) of tiles [..., 16K]: little-endian uint32 words read MSB-first
    (docs/exl3.md#bit-ring)."""
    words = np.ascontiguousarray(tiles_int16).view(np.uint32)
    return np.unpackbits(words.astype(">u4").view(np.uint8), axis=-1)


def window_ends(k_bits: float) -> np.ndarray:
    """End bit of each position's state: (p+1)K for integer K, S(p) of docs/exl3.md#half-integer-k
    for K + 0.5."""
    if float(k_bits).is_integer():
        return (np.arange(256) + 1) * int(k_bits)
    ka = int(k_bits)
    own = np.array([ka + ((0xAAAA >> (p & 15)) & 1) for p in range(256)])
    return np.cumsum(own)


def tile_states(tiles_int16: np.ndarray, k_bits: float) -> np.ndarray:
    """States [..., 256]: the 16 ring bits before each window end, first bit most significant."""
    bits = ring_bits(tiles_int16).astype(np.int64)
    ring = bits.shape[-1]
    idx = (window_ends(k_bits)[:, None] - 16 + np.arange(16)[None, :]) % ring  # [256, 16]
    return bits[..., idx] @ (1 << np.arange(15, -1, -1))


def decode(states: np.ndarray, codebook: str) -> np.ndarray:
    """fp16 value of each state (docs/exl3.md#codebooks)."""
    s = np.asarray(states, np.uint64)
    if codebook == "mul1":
        x = (s * MUL1) % (1 << 32)
        bs = sum((x >> np.uint64(8 * i)) & np.uint64(0xFF) for i in range(4)).astype(np.float64)
        return ((1024.0 + bs) * (1774 / 2**18) + (-1329 / 128)).astype(np.float16)
    x = (s * MCG) % (1 << 32) if codebook == "mcg" else (s * 89226354 + 64248484) % (1 << 32)
    x = (x & np.uint64(0x8FFF8FFF)) ^ np.uint64(0x3B603B60)
    lo = (x & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16)
    hi = (x >> np.uint64(16)).astype(np.uint16).view(np.float16)
    return lo + hi  # numpy adds float16 in float32 and rounds once


def positions() -> list[tuple[int, int]]:
    """(row, col) of trellis position p in a tile (docs/exl3.md#tile-permutation)."""
    out = []
    for t in range(32):
        r0, c0 = 2 * (t % 4), t // 4
        for j in range(8):
            out.append(((r0, r0 + 1, r0 + 8, r0 + 9)[j % 4], c0 + 8 * (j >= 4)))
    return out


def reconstruct(trellis: np.ndarray, codebook: str) -> np.ndarray:
    """W̃ (k, n) float16 from a trellis (k/16, n/16, 16K), one row of tiles at a time."""
    tk, tn, words16 = trellis.shape
    w = np.zeros((tk * 16, tn * 16), np.float16)
    where = positions()
    rows = np.array([r for r, _ in where])
    cols = np.array([c for _, c in where])
    for i in range(tk):
        values = decode(tile_states(trellis[i], words16 / 16), codebook)  # [tn, 256]
        tiles = np.zeros((tn, 16, 16), np.float16)
        tiles[:, rows, cols] = values
        w[16 * i : 16 * i + 16] = tiles.transpose(1, 0, 2).reshape(16, tn * 16)
    return w


def hadamard(n: int = 128) -> np.ndarray:
    idx = np.arange(n)
    pop = np.vectorize(lambda v: bin(v).count("1"))(idx[:, None] & idx[None, :])
    return np.where(pop % 2 == 0, 1.0, -1.0) / np.sqrt(n)


def hadamard_blocks(a: np.ndarray, axis: int) -> np.ndarray:
    """The block-diagonal H128 applied along ``axis`` (float64)."""
    a = np.moveaxis(np.asarray(a, np.float64), axis, -1)
    out = (a.reshape(*a.shape[:-1], -1, 128) @ hadamard()).reshape(a.shape)
    return np.moveaxis(out, -1, axis)


def dequantize(trellis, suh, svh, codebook) -> np.ndarray:
    """W = diag(suh) · H · W̃ · H · diag(svh) in float64 (docs/exl3.md#weight-meaning)."""
    w = hadamard_blocks(hadamard_blocks(reconstruct(np.asarray(trellis), codebook), 0), 1)
    return np.asarray(suh, np.float64)[:, None] * w * np.asarray(svh, np.float64)[None, :]


def rel_err(a, b) -> float:
    """Relative Frobenius error of a against the reference b, in float64 (the tests' metric)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
