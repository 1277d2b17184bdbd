"""mHC single-pass hyper-connections (docs/model.md#mhc).

The residual is `hc_mult` bf16 streams [B, S, HC, D]. Each block site (attention, FFN) computes
three mixes from the streams in fp32: `pre` (how the *next* site collapses the streams into its
input), `post` (how the site's output is spread over the streams) and `comb` (a doubly stochastic
HC×HC stream mix, made by Sinkhorn). The lag is the V4.1 "single-pass" change: a site collapses
with the `pre` computed at the site before it (docs/model.md#mhc-schedule); the Block does that
bookkeeping: a site's input (its norm of the collapse) and its mixes come from one `hc_site` call,
the mixes as one array m = pre | post | comb [B, S, (2+HC)·HC] that the next ops read in place.
A site's output spread back over the streams (`expand`) travels as an `Expansion` to the next site,
which forms the streams in its own launch where it can (`hc_expand_site`, docs/design.md#expand-site);
whatever else reads the streams forms them first (`formed`).

The math and its kernels are in mlx_dsv41.kernels.hyper_connections (plain MLX on the CPU, one
launch per op on a GPU); this module is the model's view of them.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from mlx_dsv41 import graph_constants
from mlx_dsv41.kernels.hyper_connections import collapse, collapse_norm, expand, expand_reference, expand_site, mixes
from mlx_dsv41.kernels.hyper_connections import site as hc_site

__all__ = [
    "Expansion",
    "collapse",
    "collapse_norm",
    "expand",
    "expand_reference",
    "expand_site",
    "formed",
    "hc_mixes",
    "hc_site",
    "initial_mixes",
    "initial_pre",
]


class Expansion(NamedTuple):
    """Streams not yet formed: expand(y, residual, m), a site's output y [B, S, D] spread over the
    residual streams [B, S, HC, D] by that site's mixes m."""

    y: mx.array
    residual: mx.array
    m: mx.array


def formed(streams: mx.array | Expansion) -> mx.array:
    """The streams as an array (an Expansion expanded)."""
    return expand(*streams) if isinstance(streams, Expansion) else streams


def hc_mixes(
    streams: mx.array, fn: mx.array, base: mx.array, scale: mx.array, *, iters: int, hc_eps: float, norm_eps: float
) -> tuple[mx.array, mx.array, mx.array]:
    """streams [B, S, HC, D] -> pre [B, S, HC], post [B, S, HC], comb [B, S, HC, HC] (all fp32).

    fn [(2+HC)·HC, HC·D], base [(2+HC)·HC], scale [3] are one site's fp32 parameters.
    comb[..., i, j] is the weight of old stream i in new stream j.
    """
    return mixes(streams, fn, base, scale, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)


def initial_pre(batch: int, length: int, hc: int) -> mx.array:
    """Layer 0 collapses with stream 0 alone (one-hot pre): all streams still equal the embedding."""
    return _one_hot_first(batch, length, hc)


def initial_mixes(batch: int, length: int, hc: int) -> mx.array:
    """What layer 0's first site reads as the previous site's mixes: the one-hot pre, then zeros."""
    return _one_hot_first(batch, length, (2 + hc) * hc)


@graph_constants.constant
def _one_hot_first(batch: int, length: int, width: int) -> np.ndarray:
    pre = np.zeros((batch, length, width), np.float32)
    pre[..., 0] = 1.0
    return pre
