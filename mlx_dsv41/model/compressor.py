"""The KV compressor of the KV-source layers (docs/model.md#compressor).

ratio r > 1: fp32 projections a = wkv(x), g = wgate(x); every complete group of r consecutive
tokens pools to latent_j = Σ_k softmax_k(g)[k] · a[k], the softmax taken per channel over the
group's r tokens; then bf16 and `norm`. A group still open at the end of a call waits in the cache
as raw fp32 projections (docs/cache.md#open-groups), so chunk boundaries and decode steps may fall
anywhere. ratio 1: latent = norm(wkv(x)) in the model dtype, no gate.

The latent returned is pre-RoPE: the index keys are derived from it before it is rotated.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_dsv41.cache import LayerCache
from mlx_dsv41.config import ModelArgs
from mlx_dsv41.kernels import compressor_raw
from mlx_dsv41.model.norm import RMSNorm
from mlx_dsv41.quant import DenseLinear, fp32_pair


def pool_groups(kv: mx.array, gate: mx.array, ratio: int) -> mx.array:
    """fp32 [B, n·r, D] projections of n complete groups -> pooled [B, n, D] (fp32)."""
    B, L, D = kv.shape
    kv = kv.reshape(B, L // ratio, ratio, D)
    weights = mx.softmax(gate.reshape(B, L // ratio, ratio, D), axis=2, precise=True)
    return mx.sum(kv * weights, axis=2)


class Compressor(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.ratio = args.compress_ratios[layer_id]
        self.wkv = nn.Linear(args.hidden_size, args.head_dim, bias=False)
        if self.ratio > 1:
            self.wgate = nn.Linear(args.hidden_size, args.head_dim, bias=False)
        self.norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.head_dim = args.head_dim

    def __call__(self, x: mx.array, cache: LayerCache) -> tuple[mx.array | None, mx.array]:
        """x [B, S, D_model] at positions cache.offset.. -> (latents [B, n, head_dim] of the groups
        completed by these tokens, or None; index of the first of them, an int32 array)."""
        first = cache.position // self.ratio
        if self.ratio == 1:
            return self.norm(self.wkv(x)), first
        kv, gate = self.group_inputs(x, cache)
        n = kv.shape[1] // self.ratio
        if n == 0:
            return None, first
        full = n * self.ratio
        latent = pool_groups(kv[:, :full], gate[:, :full], self.ratio)
        return self.norm(latent.astype(x.dtype)), first

    def group_inputs(self, x: mx.array, cache: LayerCache) -> tuple[mx.array, mx.array]:
        """cache.group_inputs of the fp32 projections wkv(x), wgate(x): the open group's rows, the new
        rows recorded. On a GPU the rings' write and the rows are one compressor_raw launch, which
        also projects where both weights are dense (docs/design.md#compressor-raw); the CPU runs the
        reference (compressor_raw.open_group gives None there)."""
        pending = cache.open_group(x.shape[0], self.head_dim)
        raw = (cache.position, pending, cache.raw_kv, cache.raw_gate)
        wkv, wgate = _dense_weight(self.wkv), _dense_weight(self.wgate)
        got = None if wkv is None or wgate is None else compressor_raw.open_group(*raw, x=x, wkv=wkv, wgate=wgate)
        if got is None:
            kv, gate = fp32_pair(self.wkv, self.wgate, x)  # pooling stays in fp32
            got = compressor_raw.open_group(*raw, kv=kv, gate=gate)
            if got is None:
                return cache.group_inputs(kv, gate)
        cache.written_raw(*got[2:])
        return got[0], got[1]


def _dense_weight(linear: nn.Module) -> mx.array | None:
    """The weight of a plain linear (no bias; the one fp32_linear computes from x in fp32), else None."""
    if type(linear) in (nn.Linear, DenseLinear) and "bias" not in linear:
        return linear.weight
    return None
