"""The routed-experts contract every experts module follows (docs/design.md, "Experts").

    experts(x [T, D], indices [T, k] int32, weights [T, k] float32) -> y [T, k, D] float32

Slot (t, s) is w2_e(bf16(weights[t, s] · silu(min(g, limit)) · clamp(u, -limit, limit))) with
g = w1_e(x_t), u = w3_e(x_t), e = indices[t, s]: the routing weight goes in before w2
(docs/model.md#moe). "bf16" is the activation dtype x.dtype (bf16 in the model): the w2 input is
rounded to it. Slots are not summed here; the MoE sums them in slot order. A module holding only the
experts lo..hi-1 (`expert_range`) returns exactly 0 for slots routed elsewhere.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn


def swiglu(
    g: mx.array, u: mx.array, limit: float, weights: mx.array | None = None, dtype: mx.Dtype = mx.bfloat16
) -> mx.array:
    """The clamped SwiGLU of docs/model.md#moe in fp32, optionally times the routing weight, cast to
    `dtype`.

    The weight multiplies silu(g)·u (the reference forms the product first, then weights it).
    """
    g = g.astype(mx.float32)
    u = u.astype(mx.float32)
    if limit > 0:
        g = mx.minimum(g, limit)
        u = mx.clip(u, -limit, limit)
    h = nn.silu(g) * u
    if weights is not None:
        h = weights.astype(mx.float32) * h
    return h.astype(dtype)


def expert_projections(dim: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each expert projection: w1, w3 (gate, up), w2 (down)."""
    return {"w1": (dim, intermediate), "w3": (dim, intermediate), "w2": (intermediate, dim)}


def check_expert_range(expert_range: tuple[int, int] | None, n_experts: int) -> tuple[int, int]:
    """(lo, hi) with 0 <= lo < hi <= n_experts; None means all experts."""
    if expert_range is None:
        return 0, n_experts
    lo, hi = (int(v) for v in expert_range)
    if not 0 <= lo < hi <= n_experts:
        raise ValueError(f"expert_range {expert_range} must satisfy 0 <= lo < hi <= {n_experts}")
    return lo, hi


def held_slots(indices: mx.array, expert_range: tuple[int, int], n_experts: int):
    """(indices local to the held experts, mask of the slots they hold or None when all are held);
    slots routed elsewhere get local index 0, computed and then zeroed by `zero_unheld`."""
    lo, hi = expert_range
    if (lo, hi) == (0, n_experts):
        return indices, None
    inside = (indices >= lo) & (indices < hi)
    return mx.where(inside, indices - lo, 0), inside


def zero_unheld(y: mx.array, inside: mx.array | None) -> mx.array:
    """Per-slot outputs y [T, k, D] with the slots routed outside the held range exactly 0."""
    return y if inside is None else mx.where(inside[..., None], y, 0.0)


def check_routing(x: mx.array, indices: mx.array, weights: mx.array, dim: int, any_lead: bool = False) -> None:
    """Shape/dtype checks of one experts call (no evaluation); with `any_lead` x may hold its T rows
    under any leading dims ([B, S, dim]: the fused MoE reads them as they are)."""
    if (x.ndim != 2 and not (any_lead and x.ndim > 2)) or x.shape[-1] != dim:
        raise ValueError(f"experts: x must be [T, {dim}], got {x.shape}")
    T = math.prod(x.shape[:-1])
    if indices.ndim != 2 or indices.shape[0] != T:
        raise ValueError(f"experts: indices must be [T={T}, k], got {indices.shape}")
    if indices.dtype != mx.int32:
        raise ValueError(f"experts: indices must be int32, got {indices.dtype}")
    if weights.shape != indices.shape or weights.dtype != mx.float32:
        raise ValueError(f"experts: weights must be float32 {indices.shape}, got {weights.dtype} {weights.shape}")


def sum_slots(slots: mx.array) -> mx.array:
    """Per-slot outputs [T, k, D] fp32 -> [T, D], summed in slot order (the reference's order)."""
    out = slots[:, 0]
    for s in range(1, slots.shape[1]):
        out = out + slots[:, s]
    return out


def combine_moe(routed: mx.array | None, shared: mx.array) -> mx.array:
    """The MoE's output (docs/model.md#moe) from the routed slots [T, k, D] fp32 and the shared
    expert's output [T, D]: the fp32 sum in slot order, then the shared expert (the reference's
    accumulation order), in the shared output's dtype. Without routed slots: the shared output."""
    if routed is None:
        return shared
    return (sum_slots(routed) + shared.astype(mx.float32)).astype(shared.dtype)
