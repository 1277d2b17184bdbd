"""The MoE router's choice from its fp32 logits (docs/model.md#moe), on a Metal/CUDA kernel or plain
MLX:

    route(logits [T, E], bias [E], top_k, temperature, scale) -> indices [T, k] int32 (ascending),
                                                                weights [T, k] float32
    s = sqrt(softplus(logits / temperature)); the k largest s + bias (the bias only chooses);
    weights = s[indices] / (Σ s[indices] + 1e-20) · scale (1e-20 a literal,
    docs/numerics.md#router-eps).

On the CPU the plain-MLX reference runs; on a GPU one moe_route launch per call replaces its ~10
(softplus, sqrt, the biased arg-partition, a sort, a gather, the normalisation). Selection ties
(equal s + bias, which real fp32 scores practically never produce) go to the lower expert id in the
kernel; the reference's arg-partition leaves them to the backend.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_dsv41.kernels import Kernel, backend, float_bits, register

RENORM_EPS = 1e-20  # a literal of the reference, not rms_norm_eps
_THREADS, _MAX_EXPERTS, _MAX_K = 256, 1024, 16

ROUTE = register(
    Kernel(
        "moe_route",
        ("logits", "bias"),
        ("indices", "weights"),
        includes=("moe.h",),
        max_threads=_THREADS,
        examples=lambda: _examples(),
    )
)


def route_reference(logits, bias, top_k: int, temperature: float, scale: float):
    if temperature != 1.0:
        logits = logits / temperature
    scores = mx.sqrt(nn.softplus(logits))
    chosen = mx.argpartition(-(scores + bias), top_k - 1, axis=-1)[..., :top_k]
    # Ascending expert id is the order the reference accumulates expert outputs in.
    indices = mx.sort(chosen, axis=-1).astype(mx.int32)
    weights = mx.take_along_axis(scores, indices, axis=-1)
    weights = weights / (mx.sum(weights, axis=-1, keepdims=True) + RENORM_EPS)
    return indices, weights * scale


def route_args(logits, bias, top_k: int, temperature: float, scale: float, init_value=None, guard: int = 0) -> dict:
    T, E = logits.shape
    return dict(
        inputs=[logits, bias.astype(mx.float32)],
        output_shapes=[(T + guard, top_k), (T + guard, top_k)],
        output_dtypes=[mx.int32, mx.float32],
        grid=(_THREADS * T, 1, 1),
        threadgroup=(_THREADS, 1, 1),
        template=[("K", int(top_k)), ("TEMP_BITS", float_bits(temperature)), ("SCALE_BITS", float_bits(scale))],
        init_value=init_value,
    )


def route(logits, bias, top_k: int, temperature: float, scale: float):
    """See the module docstring. logits [T, E] float32."""
    if logits.ndim != 2 or logits.dtype != mx.float32 or bias.shape != (logits.shape[1],):
        raise ValueError(
            f"moe route: logits must be float32 [T, E] and bias [E], got {logits.dtype} {logits.shape} and {bias.shape}"
        )
    if not 0 < top_k <= logits.shape[1]:
        raise ValueError(f"moe route: top_k {top_k} must be in 1..{logits.shape[1]}")
    if backend() == "cpu" or logits.shape[1] > _MAX_EXPERTS or top_k > _MAX_K or logits.shape[0] == 0:
        return route_reference(logits, bias, top_k, temperature, scale)
    indices, weights = ROUTE(**route_args(logits, bias, top_k, temperature, scale))
    return indices, weights


def _examples():
    logits = mx.random.normal((3, 384), key=mx.random.key(2))
    return [route_args(logits, mx.zeros((384,)), 6, 1.0, 1.5), route_args(logits[:, :8], mx.zeros((8,)), 2, 0.5, 1.0)]
