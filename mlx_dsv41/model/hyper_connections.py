"""mHC single-pass hyper-connections (spec §4.2).

The residual is `hc_mult` bf16 streams [B, S, HC, D]. Each block site (attention, FFN) computes
three mixes from the streams in fp32: `pre` (how the *next* site collapses the streams into its
input), `post` (how the site's output is spread over the streams) and `comb` (a doubly stochastic
HC×HC stream mix, made by Sinkhorn). The lag is the V4.1 "single-pass" change: a site collapses
with the `pre` computed at the site before it (spec §8.1); the Block does that bookkeeping.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx


def _sinkhorn(comb: mx.array, iters: int, eps: float) -> mx.array:
    """Columns first, then (rows, columns) iters - 1 more times; sums over i are axis -2."""
    comb = comb / (mx.sum(comb, axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (mx.sum(comb, axis=-1, keepdims=True) + eps)
        comb = comb / (mx.sum(comb, axis=-2, keepdims=True) + eps)
    return comb


def hc_mixes(
    streams: mx.array,
    fn: mx.array,
    base: mx.array,
    scale: mx.array,
    *,
    iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[mx.array, mx.array, mx.array]:
    """streams [B, S, HC, D] -> pre [B, S, HC], post [B, S, HC], comb [B, S, HC, HC] (all fp32).

    fn [(2+HC)·HC, HC·D], base [(2+HC)·HC], scale [3] are one site's fp32 parameters.
    comb[..., i, j] is the weight of old stream i in new stream j.
    """
    *lead, hc, dim = streams.shape
    z = streams.reshape(*lead, hc * dim).astype(mx.float32)  # stream-major flatten
    # One RMS statistic over all HC·D values, applied after the projection (spec §4.2).
    inv_rms = mx.rsqrt(mx.mean(z * z, axis=-1, keepdims=True) + norm_eps)
    m = (z @ fn.astype(mx.float32).T) * inv_rms
    # scale[0] scales the pre columns, scale[1] the post columns, scale[2] the comb columns.
    column_scale = scale.astype(mx.float32)[_scale_ids(hc)]
    m = m * column_scale + base.astype(mx.float32)
    gates = mx.sigmoid(m[..., : 2 * hc])
    pre = gates[..., :hc] + hc_eps
    post = 2.0 * gates[..., hc:]
    comb = mx.softmax(m[..., 2 * hc :].reshape(*lead, hc, hc), axis=-1) + hc_eps
    return pre, post, _sinkhorn(comb, iters, hc_eps)


@lru_cache
def _scale_ids(hc: int) -> mx.array:
    return mx.array([0] * hc + [1] * hc + [2] * hc * hc, dtype=mx.int32)


def collapse(streams: mx.array, pre: mx.array) -> mx.array:
    """Σ_i pre[i]·stream_i in fp32, cast to the stream dtype: [B, S, HC, D] -> [B, S, D]."""
    x = pre[..., None, :] @ streams.astype(mx.float32)  # [B, S, 1, D]
    return x.squeeze(-2).astype(streams.dtype)


def expand(y: mx.array, residual: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """new_j = post[j]·y + Σ_i comb[i, j]·old_i in fp32, cast to the stream dtype (spec §4.2)."""
    mixed = comb.swapaxes(-1, -2) @ residual.astype(mx.float32)  # sums over the FIRST index of comb
    out = post[..., None] * y.astype(mx.float32)[..., None, :] + mixed
    return out.astype(residual.dtype)


def initial_pre(batch: int, length: int, hc: int) -> mx.array:
    """Layer 0 collapses with stream 0 alone (one-hot pre): all streams still equal the embedding."""
    return mx.broadcast_to((mx.arange(hc) == 0).astype(mx.float32), (batch, length, hc))
