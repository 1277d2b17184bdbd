"""Sparse attention over a sliding window ∪ selected compressed entries, with a per-head sink.

    out[b, s, h] = Σ_j exp(l_j - m) kv_j / (Σ_j exp(l_j - m) + exp(sink_h - m)),
    l_j = scale · (q[b, s, h] · kv_j),  j over indices[b, s, :] that are >= 0   (spec §4.3)

Index i < W reads window[b, i]; i >= W reads pool[b, i - W]; -1 is skipped. K = V (one shared
latent). The sink is an extra logit in the denominator only.
"""

from __future__ import annotations

import mlx.core as mx

# Query rows per gather in the reference path: bounds its [rows, N, D] temporary.
_REFERENCE_ROW_CHUNK = 64


def _check(q, window, pool, indices, sinks):
    if q.ndim != 4:
        raise ValueError(f"sparse_attention: q must be [B, S, H, D], got shape {q.shape}")
    B, S, H, D = q.shape
    if window.ndim != 3 or window.shape[0] != B or window.shape[2] != D:
        raise ValueError(f"sparse_attention: window must be [B={B}, W, D={D}], got {window.shape}")
    if pool.ndim != 3 or pool.shape[0] != B or pool.shape[2] != D:
        raise ValueError(f"sparse_attention: pool must be [B={B}, T, D={D}], got {pool.shape}")
    if indices.ndim != 3 or indices.shape[:2] != (B, S):
        raise ValueError(f"sparse_attention: indices must be [B={B}, S={S}, N], got {indices.shape}")
    if indices.dtype != mx.int32:
        raise ValueError(f"sparse_attention: indices must be int32, got {indices.dtype}")
    if sinks.shape != (H,):
        raise ValueError(f"sparse_attention: sinks must be [H={H}], got {sinks.shape}")


def sparse_attention_reference(q, window, pool, indices, sinks, scale: float) -> mx.array:
    """Plain-MLX path (CPU, and the oracle for the kernels). fp32 throughout."""
    B, S, H, D = q.shape
    W, T, N = window.shape[1], pool.shape[1], indices.shape[2]
    kv = mx.concatenate([window, pool], axis=1).astype(mx.float32).reshape(B * (W + T), D)
    if W + T == 0:
        kv = mx.zeros((1, D), mx.float32)
    base = (mx.arange(B, dtype=mx.int32) * (W + T))[:, None, None]
    sink = sinks.astype(mx.float32)[:, None]  # [H, 1]
    outs = []
    for s0 in range(0, S, _REFERENCE_ROW_CHUNK):
        idx = indices[:, s0 : s0 + _REFERENCE_ROW_CHUNK]  # [B, s, N]
        valid = idx >= 0
        rows = kv[mx.where(valid, idx, 0) + base]  # [B, s, N, D]
        qc = q[:, s0 : s0 + _REFERENCE_ROW_CHUNK].astype(mx.float32)  # [B, s, H, D]
        logits = (qc @ rows.swapaxes(-1, -2)) * scale  # [B, s, H, N]
        logits = mx.where(valid[:, :, None, :], logits, -mx.inf)
        m = mx.maximum(mx.max(logits, axis=-1, keepdims=True), sink) if N else mx.broadcast_to(sink, logits.shape[:-1] + (1,))
        p = mx.exp(logits - m)
        denom = mx.sum(p, axis=-1, keepdims=True) + mx.exp(sink - m)
        outs.append((p @ rows) / denom)
    return mx.concatenate(outs, axis=1) if outs else mx.zeros((B, 0, H, D), mx.float32)


def sparse_attention(q, window, pool, indices, sinks, scale: float, variant: str | None = None):
    """[B, S, H, D] float32. See the module docstring for the contract."""
    _check(q, window, pool, indices, sinks)
    return sparse_attention_reference(q, window, pool, indices, sinks, scale)
