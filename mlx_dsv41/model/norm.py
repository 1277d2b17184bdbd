"""RMSNorm as DeepSeek-V4.1 computes it (docs/numerics.md#dtypes): in fp32, x · rsqrt(mean(x²) +
eps), times the weight, cast back to the input dtype. Every norm of the model uses eps =
rms_norm_eps = 1e-20."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        # fp32 input and weight: the fused kernel then normalises and multiplies in fp32 with no
        # intermediate rounding (docs/numerics.md#rms-eps: never feed bf16 to a fused norm at eps
        # 1e-20).
        y = mx.fast.rms_norm(x.astype(mx.float32), self.weight.astype(mx.float32), self.eps)
        return y.astype(x.dtype)
