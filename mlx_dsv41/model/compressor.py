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
from mlx_dsv41.model.norm import RMSNorm


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

    def __call__(self, x: mx.array, cache: LayerCache) -> tuple[mx.array | None, mx.array]:
        """x [B, S, D_model] at positions cache.offset.. -> (latents [B, n, head_dim] of the groups
        completed by these tokens, or None; index of the first of them, an int32 array)."""
        first = cache.position // self.ratio
        if self.ratio == 1:
            return self.norm(self.wkv(x)), first
        # The loader stores these weights in fp32 (docs/numerics.md#dtypes); pooling stays in fp32.
        xf = x.astype(mx.float32)
        kv, gate = cache.group_inputs(self.wkv(xf).astype(mx.float32), self.wgate(xf).astype(mx.float32))
        n = kv.shape[1] // self.ratio
        if n == 0:
            return None, first
        full = n * self.ratio
        latent = pool_groups(kv[:, :full], gate[:, :full], self.ratio)
        return self.norm(latent.astype(x.dtype)), first
