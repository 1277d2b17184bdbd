"""Engram (docs/model.md#engram-rows-and-gate): hashed n-gram rows -> a gated value added to every
residual stream.

Rows come from a *row source* (docs/design.md): `read(row_ids int64 [N]) -> uint8 [N, row_bytes]`
with each row = head_dim e4m3 bytes then head_dim/32 e8m0 scale bytes, plus `prefetch(row_ids)`
and `stats`. `MemoryRowSource` is the in-memory one (tests); `mlx_dsv41.engram_store` serves the
real tables from SSD.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_dsv41.config import ModelArgs

# |dot| floor before the signed square root (docs/model.md#engram-gate).
_GATE_FLOOR = 1e-6


class RowSource(Protocol):
    def read(self, row_ids: np.ndarray) -> np.ndarray: ...

    def prefetch(self, row_ids: np.ndarray) -> None: ...

    @property
    def stats(self): ...


@dataclass
class RowStats:
    rows: int = 0
    bytes: int = 0
    seconds: float = 0.0


class MemoryRowSource:
    """A whole table in RAM: uint8 [rows, row_bytes]."""

    def __init__(self, table: np.ndarray):
        table = np.ascontiguousarray(table)
        if table.dtype != np.uint8 or table.ndim != 2:
            raise ValueError(f"MemoryRowSource: table must be uint8 [rows, row_bytes], got {table.dtype} {table.shape}")
        self.table = table
        self._stats = RowStats()

    @property
    def num_rows(self) -> int:
        return self.table.shape[0]

    def read(self, row_ids: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        row_ids = np.asarray(row_ids, dtype=np.int64).reshape(-1)
        if row_ids.size and (row_ids.min() < 0 or row_ids.max() >= self.num_rows):
            bad = row_ids[(row_ids < 0) | (row_ids >= self.num_rows)][0]
            raise IndexError(f"Engram row {int(bad)} is outside the table (0..{self.num_rows - 1})")
        rows = self.table[row_ids]
        self._stats.rows += row_ids.size
        self._stats.bytes += rows.nbytes
        self._stats.seconds += time.perf_counter() - start
        return rows

    def prefetch(self, row_ids: np.ndarray) -> None:
        pass  # already in memory

    @property
    def stats(self) -> RowStats:
        return self._stats


@lru_cache
def _e8m0_table() -> mx.array:
    """fp32 value of every e8m0 byte: 2^(b - 127), and NaN for 255 (exact, 2^-127 is subnormal)."""
    table = np.append(np.ldexp(1.0, np.arange(255) - 127), np.nan).astype(np.float32)
    return mx.array(table)


def decode_rows(raw: mx.array, head_dim: int) -> mx.array:
    """uint8 [..., head_dim + head_dim/32] rows -> bf16 [..., head_dim] (docs/model.md#engram-rows).

    value = e4m3(byte) · 2^(scale byte - 127), one scale per 32 values, in fp32, then cast to bf16.
    """
    if raw.dtype != mx.uint8 or raw.shape[-1] != head_dim + head_dim // 32:
        raise ValueError(f"Engram rows must be uint8 [..., {head_dim + head_dim // 32}], got {raw.dtype} {raw.shape}")
    lead = raw.shape[:-1]
    values = mx.from_fp8(raw[..., :head_dim], mx.float32).reshape(*lead, head_dim // 32, 32)
    scales = _e8m0_table()[raw[..., head_dim:]]  # [..., head_dim/32]
    return (values * scales[..., None]).reshape(*lead, head_dim).astype(mx.bfloat16)


class Engram(nn.Module):
    """One Engram layer's weights: `wkv` [(HC+1)·D, columns·head_dim], `q_weight`, `k_weight` [HC, D].

    The table itself is not a parameter: its rows arrive already read (`rows`).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.hc, self.dim = args.hc_mult, args.hidden_size
        self.head_dim = args.engram_head_dim
        self.eps = args.rms_norm_eps
        self.wkv = nn.Linear(args.engram_columns * self.head_dim, (self.hc + 1) * self.dim, bias=False)
        self.q_weight = 1.0 + 0.1 * mx.random.normal((self.hc, self.dim))
        self.k_weight = 1.0 + 0.1 * mx.random.normal((self.hc, self.dim))

    def __call__(self, streams: mx.array, rows: mx.array, live: mx.array | None = None) -> mx.array:
        """streams [B, S, HC, D] bf16, rows uint8 [B, S, columns, row_bytes] -> streams.

        `live` [B, S] bool: False at DEAD (image) positions, whose gate is 0.
        """
        gate, value = self.gate_and_value(streams, rows, live)
        h = streams.astype(mx.float32)
        return (h + gate[..., None] * value[:, :, None, :]).astype(streams.dtype)

    def gate_and_value(
        self, streams: mx.array, rows: mx.array, live: mx.array | None = None
    ) -> tuple[mx.array, mx.array]:
        """(gate [B, S, HC] fp32 per stream, value [B, S, D] fp32 shared by the streams)."""
        B, S = streams.shape[:2]
        e = decode_rows(rows, self.head_dim).reshape(B, S, -1)  # [B, S, columns·head_dim] bf16
        kv = self.wkv(e)  # [B, S, (HC+1)·D]
        key = kv[..., : self.hc * self.dim].reshape(B, S, self.hc, self.dim).astype(mx.float32)
        value = kv[..., self.hc * self.dim :].astype(mx.float32)  # one value for all streams
        h = streams.astype(mx.float32)
        # Only the product q_weight·k_weight enters the gate; per-stream norms over D
        # (docs/model.md#engram-gate).
        wqk = self.q_weight.astype(mx.float32) * self.k_weight.astype(mx.float32)
        dot = mx.sum(h * wqk * key, axis=-1)
        dot = dot * mx.rsqrt(mx.mean(h * h, axis=-1) + self.eps)
        dot = dot * mx.rsqrt(mx.mean(key * key, axis=-1) + self.eps) * self.dim**-0.5
        gate = mx.sigmoid(mx.sign(dot) * mx.sqrt(mx.maximum(mx.abs(dot), _GATE_FLOOR)))  # [B, S, HC]
        if live is not None:
            gate = mx.where(live[..., None], gate, 0.0)
        return gate, value
