"""RMSNorm as DeepSeek-V4.1 computes it (docs/numerics.md#dtypes): in fp32, x · rsqrt(mean(x²) +
eps), times the weight, cast back to the input dtype. Every norm of the model uses eps =
rms_norm_eps = 1e-20."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_dsv41.kernels.hyper_connections import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self.weight, self.eps)  # fp32 math, one rounding (the kernel dispatch)
