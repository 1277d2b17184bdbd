"""The MoE router's choice from its fp32 logits (docs/model.md#moe), on a Metal/CUDA kernel or plain
MLX:

    route(logits [T, E], bias [E], top_k, temperature, scale) -> indices [T, k] int32 (ascending),
                                                                weights [T, k] float32
    s = sqrt(softplus(logits / temperature)); the k largest s + bias (the bias only chooses);
    weights = s[indices] / (Σ s[indices] + 1e-20) · scale (1e-20 a literal,
    docs/numerics.md#router-eps).
    gate(x [T, D], w [E, D], bias, ...) -> route(fp32 x · wᵀ, bias, ...), the logits by fp32_linear

On the CPU the plain-MLX reference runs; on a GPU one moe_route launch per call replaces its ~10
(softplus, sqrt, the biased arg-partition, a sort, a gather, the normalisation). Selection ties
(equal s + bias, which real fp32 scores practically never produce) go to the lower expert id in the
kernel; the reference's arg-partition leaves them to the backend. `gate` on CUDA is one moe_gate
launch: fp32_gemv's threadgroups, the last of which does moe_route's work
(docs/design.md#grid-finish).
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlx_dsv41.kernels import Kernel, backend, float_bits, fp32_linear, grid_finish, register

RENORM_EPS = 1e-20  # a literal of the reference, not rms_norm_eps
# moe_gate runs moe_route's work in one of fp32_gemv's threadgroups: the same thread count
_THREADS, _MAX_EXPERTS, _MAX_K = fp32_linear.THREADS, 1024, 16

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

GATE = register(
    Kernel(
        "moe_gate",
        ("x", "w", "bias", "counters"),
        ("logits", "indices", "weights"),
        includes=("grid_finish.h", "fp32_gemv.h", "moe.h"),
        max_threads=_THREADS,
        examples=lambda: _gate_examples(),
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
        template=_route_template(top_k, temperature, scale),
        init_value=init_value,
    )


def gate_args(
    x, w, bias, counters, top_k: int, temperature: float, scale: float, init_value=None, guard: int = 0
) -> dict:
    """moe_gate call kwargs: fp32_gemv's launch of x [..., D] (T rows in order: the kernel reads them
    as they are) against w [E, D], finished by moe_route's work for each token; outputs the fp32
    logits [T, E] (fp32_gemv's), then moe_route's two. counters: uint32 [>= 1] zeros (held_counters)."""
    T, E = math.prod(x.shape[:-1]), w.shape[0]
    grid_finish.check_counters(counters, 1, "moe gate")
    launch = fp32_linear.gemv_launch(T, w)
    return dict(
        inputs=[x, w, bias.astype(mx.float32), counters],
        output_shapes=[(T + guard, E), (T + guard, top_k), (T + guard, top_k)],
        output_dtypes=[mx.float32, mx.int32, mx.float32],
        grid=launch["grid"],
        threadgroup=launch["threadgroup"],
        template=launch["template"] + _route_template(top_k, temperature, scale),
        init_value=init_value,
    )


def _route_template(top_k: int, temperature: float, scale: float) -> list:
    return [("K", int(top_k)), ("TEMP_BITS", float_bits(temperature)), ("SCALE_BITS", float_bits(scale))]


def route(logits, bias, top_k: int, temperature: float, scale: float):
    """See the module docstring. logits [T, E] float32."""
    if logits.ndim != 2 or logits.dtype != mx.float32:
        raise ValueError(f"moe route: logits must be float32 [T, E], got {logits.dtype} {logits.shape}")
    _check(logits.shape[1], bias, top_k)
    if backend() == "cpu" or not _takes_kernel(logits.shape[0], logits.shape[1], top_k):
        return route_reference(logits, bias, top_k, temperature, scale)
    indices, weights = ROUTE(**route_args(logits, bias, top_k, temperature, scale))
    return indices, weights


def gate(x, w, bias, top_k: int, temperature: float, scale: float, counters=None):
    """The router from its input: logits = x [T, D] · w [E, D]ᵀ in fp32 (fp32_linear), then `route`;
    x may hold the T rows under any leading dims ([B, S, D]), indices and weights are [T, k]. One
    moe_gate launch where a launch may finish itself (kernels/grid_finish.py), given the router's
    ``counters`` (held_counters), reading x as it is; the same bytes."""
    if x.ndim < 2 or w.ndim != 2 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"moe gate: x [T, D] and w [E, D] expected, got {x.shape} and {w.shape}")
    T, E = math.prod(x.shape[:-1]), w.shape[0]
    _check(E, bias, top_k)
    one_launch = counters is not None and grid_finish.merges(backend())
    if one_launch and fp32_linear.takes_kernel(T, w) and _takes_kernel(T, E, top_k):
        _, indices, weights = GATE(**gate_args(x, w, bias, counters, top_k, temperature, scale))
        return indices, weights
    return route(fp32_linear.linear(x.reshape(T, -1), w), bias, top_k, temperature, scale)


def _check(E: int, bias, top_k: int) -> None:
    if bias.shape != (E,):
        raise ValueError(f"moe route: bias must be [E] = [{E}], got {bias.shape}")
    if not 0 < top_k <= E:
        raise ValueError(f"moe route: top_k {top_k} must be in 1..{E}")


def _takes_kernel(T: int, E: int, top_k: int) -> bool:
    return T > 0 and E <= _MAX_EXPERTS and top_k <= _MAX_K


def _examples():
    logits = mx.random.normal((3, 384), key=mx.random.key(2))
    return [route_args(logits, mx.zeros((384,)), 6, 1.0, 1.5), route_args(logits[:, :8], mx.zeros((8,)), 2, 0.5, 1.0)]


def _gate_examples():
    x = mx.random.normal((3, 256), key=mx.random.key(3)).astype(mx.bfloat16)
    w = mx.random.normal((384, 256), key=mx.random.key(4)).astype(mx.bfloat16)
    counters = grid_finish.split_counters(1)
    return [
        gate_args(x, w, mx.zeros((384,)), counters, 6, 1.0, 1.5),
        gate_args(x[:1].astype(mx.float32), w[:8], mx.zeros((8,)), counters, 2, 0.5, 1.0),
    ]
