"""EXL3 trellis geometry and the plain-MLX decoder: trellis -> W̃ (k, n) fp16
(docs/exl3.md#trellis).

K2 = 2K (bits per two positions) names a bitrate with an integer: even K2 is integer K = 1..8, odd
K2 = 3, 5, 7 is the half-integer K = 1.5, 2.5, 3.5 (docs/exl3.md#half-integer-k). Position p's
16-bit state is the window of ring bits ending at floor((p+1)·K2/2), taken mod the tile's 128·K2-bit
ring, MSB-first across little-endian uint32 words; this one rule covers both kinds of K
(docs/exl3.md#bit-ring, docs/exl3.md#half-integer-k).
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx
import numpy as np

from mlx_dsv41.exl3.codebook import CODEBOOKS, decode_states

TILE = 16  # a tile is 16x16 weights, 256 trellis positions
HALF_K2 = (3, 5, 7)  # K = 1.5, 2.5, 3.5: MUL1 only
VALID_K2 = (2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)
_TILES_PER_CHUNK = 1 << 14  # bounds the reference decoder's temporaries


def k2_from_trellis_shape(shape) -> int:
    """2K from a trellis shape (k/16, n/16, 16K); a clear error for anything else."""
    shape = tuple(shape)
    if len(shape) != 3 or shape[0] <= 0 or shape[1] <= 0:
        raise ValueError(f"EXL3 trellis must have shape (k/16, n/16, 16*K), got {shape}")
    last = shape[2]
    if last % 8 or last // 8 not in VALID_K2:
        raise ValueError(f"EXL3 trellis last dim {last} is not 16*K for K in 1..8 or 1.5/2.5/3.5 (shape {shape})")
    return last // 8


def check_trellis(trellis: mx.array, codebook: str, block: int = TILE) -> tuple[int, int, int]:
    """(K2, k, n) of a trellis (k/16, n/16, 16K) that ``codebook`` decodes, with k and n multiples
    of ``block``; a clear error otherwise."""
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}; expected one of {CODEBOOKS}")
    if trellis.dtype not in (mx.int16, mx.uint16):
        raise ValueError(f"EXL3 trellis must be int16 (or uint16), got {trellis.dtype}")
    k2 = k2_from_trellis_shape(trellis.shape)
    if k2 in HALF_K2 and codebook != "mul1":
        raise ValueError(f"half-integer K={k2 / 2} needs the mul1 codebook, got {codebook!r}")
    k, n = trellis.shape[0] * TILE, trellis.shape[1] * TILE
    if k % block or n % block:
        raise ValueError(f"EXL3 dims must be multiples of {block}, trellis {trellis.shape} gives {k}x{n}")
    return k2, k, n


def bits_per_weight(k2: int) -> float:
    return k2 / 2


@cache
def tile_permutation() -> np.ndarray:
    """perm[p] = element index (row*16 + col) of trellis position p in a tile
    (docs/exl3.md#tile-permutation)."""
    perm = np.empty(256, np.int64)
    for t in range(32):
        r0, c0 = 2 * (t % 4), t // 4
        rows = (r0, r0 + 1, r0 + 8, r0 + 9)
        for j in range(8):
            perm[8 * t + j] = rows[j % 4] * TILE + c0 + (8 if j >= 4 else 0)
    return perm


@cache
def _element_order() -> mx.array:
    """order[e] = trellis position of tile element e (row*16 + col): tile_permutation inverted."""
    return mx.array(np.argsort(tile_permutation()), mx.int32)


@cache
def _state_windows(k2: int):
    """Per position: the two uint32 words holding its 16-bit window and the shift that extracts it
    from their 64-bit concatenation (high word first)."""
    words, ring = 4 * k2, 128 * k2
    p = np.arange(256)
    start = ((p + 1) * k2 // 2 - 16) % ring  # first (most significant) bit of the state
    hi = start // 32
    lo = (hi + 1) % words
    shift = 48 - start % 32
    return mx.array(hi, mx.int32), mx.array(lo, mx.int32), mx.array(shift, mx.uint64)


def tile_states(trellis: mx.array) -> mx.array:
    """uint32 states [tk, tn, 256] in position order, from an int16/uint16 trellis [tk, tn, 16K]."""
    k2 = k2_from_trellis_shape(trellis.shape)
    words = mx.view(trellis, mx.uint32).astype(mx.uint64)  # [tk, tn, 4*K2], little-endian pairs
    hi, lo, shift = _state_windows(k2)
    pair = (mx.take(words, hi, axis=-1) << 32) | mx.take(words, lo, axis=-1)
    return ((pair >> shift) & 0xFFFF).astype(mx.uint32)


def reconstruct(trellis: mx.array, codebook: str) -> mx.array:
    """W̃ (k, n) fp16 from a trellis (k/16, n/16, 16K), bit-exact to exllamav3 (plain MLX)."""
    check_trellis(trellis, codebook)
    tk, tn, _ = trellis.shape
    rows = max(1, _TILES_PER_CHUNK // tn)
    parts = []
    for r0 in range(0, tk, rows):
        chunk = trellis[r0 : r0 + rows]
        values = decode_states(tile_states(chunk), codebook)  # position order
        tiles = mx.take(values, _element_order(), axis=-1).reshape(chunk.shape[0], tn, TILE, TILE)
        parts.append(tiles.transpose(0, 2, 1, 3).reshape(chunk.shape[0] * TILE, tn * TILE))
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
