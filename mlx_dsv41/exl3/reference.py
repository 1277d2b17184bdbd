"""The EXL3 forward in plain MLX: the CPU path and the oracle the kernels are tested against.

    W = diag(suh) · H · W̃ · H · diag(svh)                       (docs/exl3.md#weight-meaning)
    y = H(xh @ W̃) ⊙ svh (+ bias),  xh = fp16(H(fp16(x ⊙ suh)))  (docs/exl3.md#forward)

The sums are float32.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from mlx_dsv41 import graph_constants
from mlx_dsv41.exl3.hadamard import hadamard_128, input_transform, output_transform
from mlx_dsv41.exl3.trellis import reconstruct
from mlx_dsv41.quant.experts import swiglu


def dequantize(trellis, suh, svh, codebook: str) -> mx.array:
    """W (k, n) float32 in the original basis (y = x @ W)."""
    w = hadamard_128(reconstruct(trellis, codebook), axis=0)
    w = hadamard_128(w, axis=1)
    return suh.astype(mx.float32)[:, None] * w * svh.astype(mx.float32)[None, :]


def pad_features(x: mx.array, k: int) -> mx.array:
    """Zero-extend the last dim of x to k (inputs narrower than the padded weight,
    docs/exl3.md#padding)."""
    extra = k - x.shape[-1]
    return x if extra == 0 else mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def linear(x, trellis, suh, svh, codebook, bias=None, out_features=None, out_dtype=None, w_tilde=None):
    """y [m, out_features] = x [m, in] @ W (+ bias), docs/exl3.md#forward order, float32
    accumulation. ``w_tilde``: W̃ already decoded to float32 (the same values: reconstruct is
    exact)."""
    w = reconstruct(trellis, codebook).astype(mx.float32) if w_tilde is None else w_tilde
    return with_transforms(lambda xh: xh.astype(mx.float32) @ w, x, suh, svh, bias, out_features, out_dtype)


def experts_gathered(x, indices, weights, w1, w3, w2, expert_range, limit, tildes):
    """Per-slot expert outputs [T, k, D] float32 as ``experts_by_expert`` computes them, every slot
    at once: ``slot_experts`` with one ``gather_mm`` per projection over the experts' decoded W̃
    (``tildes``: float32 [E, k, n] for w1, w3, w2). No host read of the routing. The same bytes as
    one expert at a time wherever the CPU's GEMMs give each row the same sums whatever the number
    of rows (tests/test_exl3_layers.py checks it)."""
    T, top_k = indices.shape
    lo, hi = expert_range
    inside = (indices >= lo) & (indices < hi)
    local = mx.where(inside, indices - lo, 0).reshape(-1)
    rows = mx.repeat(x, top_k, axis=0)  # slot (t, s) -> x[t]
    # lhs_indices as MLX's default makes them (row i reads row i; uint32, the type gather_mm casts
    # indices to), but a constant: MLX's own arange would be a node every compiled replay
    # evaluates again.
    lhs = graph_constants.array(tuple(range(rows.shape[0])), mx.uint32)

    def product(xh, w):
        return mx.gather_mm(xh.astype(mx.float32)[:, None, :], w, lhs_indices=lhs, rhs_indices=local).squeeze(1)

    y = slot_experts(rows, weights.reshape(-1), local, (w1, w3, w2), tildes, limit, product)
    return mx.where(inside.reshape(-1, 1), y, 0.0).reshape(T, top_k, -1)


def project_slots(v, proj, experts, product, out_dtype=mx.bfloat16):
    """Row i of v through expert experts[i] of an EXL3ExpertProjection: its input transform,
    ``product(xh)`` (fp16 xh times the row's own expert's W̃, float32), its output transform, rounded once to
    out_dtype (docs/exl3.md#forward) -> [S, out_features]."""
    return with_transforms(product, v, proj.suh[experts], proj.svh[experts], None, proj.out_features, out_dtype)


def slot_experts(rows, slot_weights, experts, projections, tildes, limit, product):
    """float32 [S, D]: slot i = w2_e(bf16(w_i · SwiGLU(w1_e(rows[i]), w3_e(rows[i])))) for the local
    expert e = experts[i]: ``project_slots`` through each projection of ``projections`` = (w1, w3,
    w2) with ``product(xh, tildes[p])`` (fp16 xh [S, k] times each slot's own expert's W̃ from the
    decoded stack of projection p), each linear's output rounded to bf16 as the reference's expert
    linears round it (docs/model.md#moe)."""

    def through(v, p):
        return project_slots(v, projections[p], experts, lambda xh: product(xh, tildes[p]))

    h = swiglu(through(rows, 0), through(rows, 1), limit, slot_weights.reshape(-1, 1).astype(mx.float32))
    return through(h, 2).astype(mx.float32)


def with_transforms(product, x, suh, svh, bias=None, out_features=None, out_dtype=None):
    """y = H(product(xh)) ⊙ svh (+ bias) [m, out_features] in out_dtype (default x.dtype), with
    xh = fp16(H(fp16(x ⊙ suh))) and product(xh) = xh @ W̃ in float32 (docs/exl3.md#forward). suh
    [k] and svh [n] serve every row, or [m, k] and [m, n] give each row its own (routed slots)."""
    out_features = svh.shape[-1] if out_features is None else out_features
    xh = input_transform(pad_features(x, suh.shape[-1]), suh)
    y = output_transform(product(xh), svh)[:, :out_features]
    if bias is not None:
        y = y + bias[:out_features].astype(mx.float32)
    return y.astype(out_dtype or x.dtype)


def experts_by_expert(x, indices, weights, w1, w3, w2, expert_range, limit, linear_fn):
    """Per-slot expert outputs [T, k, D] float32, one expert at a time.

    Reads the routing to the host and runs each expert in ``expert_range`` that has slots on its
    tokens with ``linear_fn`` (this module's ``linear`` on CPU, the dispatching op on GPU). Slots
    routed elsewhere stay exactly 0.
    """
    T, top_k = indices.shape
    lo, hi = expert_range
    flat = np.array(indices).reshape(-1)
    out = mx.zeros((T * top_k, w2.out_features), mx.float32)
    w_flat = weights.reshape(-1).astype(mx.float32)
    for e in np.unique(flat[(flat >= lo) & (flat < hi)]):
        slots = np.nonzero(flat == e)[0]
        s = mx.array(slots.astype(np.int32))
        xe = x[mx.array((slots // top_k).astype(np.int32))]
        local = int(e) - lo
        # The reference's expert linears return bf16: g, u and y are bf16-valued
        # (docs/model.md#moe).
        g = linear_fn(xe, *w1.expert(local), out_features=w1.out_features, out_dtype=mx.bfloat16)
        u = linear_fn(xe, *w3.expert(local), out_features=w3.out_features, out_dtype=mx.bfloat16)
        h = swiglu(g, u, limit, w_flat[s][:, None])  # bf16(w * (silu(min(g, L)) * clamp(u)))
        y = linear_fn(h, *w2.expert(local), out_features=w2.out_features, out_dtype=mx.bfloat16)
        out[s] = y.astype(mx.float32)
    return out.reshape(T, top_k, w2.out_features)
