"""Routed experts in MLX's MX formats (mxfp4 / mxfp8): stacked packed weights, `mx.gather_qmm`.

The official release stores routed experts as FP4 (E2M1 + per-32 E8M0 scales), which is mxfp4 byte
for byte (docs/checkpoint.md#official-formats); the converter stores them per expert as MLX `weight`
uint32 + `scales` uint8. Here each projection stacks its experts into `weight [n, out, in·bits/32]`,
`scales [n, out, in/32]`.

Numerics follow DenseExperts (docs/design.md, "Experts"): w1 and w3 outputs in the activation
dtype, the clamped SwiGLU times the routing weight rounded to it, w2's output rounded to it, then
float32 per slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_dsv41 import graph_constants
from mlx_dsv41.kernels import mxfp4_gemv
from mlx_dsv41.quant.accumulation import quantized_input
from mlx_dsv41.quant.errors import FormatError
from mlx_dsv41.quant.experts import (
    check_expert_range,
    check_routing,
    expert_projections,
    held_slots,
    swiglu,
    zero_unheld,
)
from mlx_dsv41.quant.official import GROUP, MODES, mx_shapes


class MXProjection(nn.Module):
    """One projection (w1, w3 or w2) of a range of experts: packed `weight` and `scales`."""

    def __init__(self, weight: mx.array, scales: mx.array, mode: str, in_features: int, out_features: int):
        super().__init__()
        if mode not in MODES:
            raise FormatError(f"MX experts: mode {mode!r} is not one of {sorted(MODES)}")
        n = weight.shape[0]
        w_shape, s_shape = mx_shapes(out_features, in_features, MODES[mode])
        if weight.dtype != mx.uint32 or tuple(weight.shape) != (n, *w_shape):
            raise FormatError(
                f"MX experts: {mode} weight must be uint32 {[n, *w_shape]}, got {weight.dtype} {list(weight.shape)}"
            )
        if scales.dtype != mx.uint8 or tuple(scales.shape) != (n, *s_shape):
            raise FormatError(
                f"MX experts: {mode} scales must be uint8 {[n, *s_shape]}, got {scales.dtype} {list(scales.shape)}"
            )
        self.weight, self.scales = weight, scales
        self.mode, self.bits = mode, MODES[mode]
        self.in_features, self.out_features = in_features, out_features

    def __call__(self, x: mx.array, local: mx.array) -> mx.array:
        """x [T, k or 1, 1, in] -> [T, k, 1, out] in x.dtype, expert `local[t, s]` per slot: fp32
        sums, one rounding (quant/accumulation.py; on CUDA, few mxfp4 slots take mxfp4_gemv)."""
        if mxfp4_gemv.takes_kernel(self.bits, self.mode, local.size):
            T, k = local.shape
            rows = graph_constants.row_of(T * k, k if x.shape[1] == 1 else 1)
            y = mxfp4_gemv.gathered(x.reshape(-1, x.shape[-1]), self.weight, self.scales, rows, local.reshape(-1))
            return y.reshape(T, k, 1, -1).astype(x.dtype)
        xs = quantized_input(x, "gather_qmm", self.bits, local.size)
        y = mx.gather_qmm(
            xs,
            self.weight,
            self.scales,
            None,
            rhs_indices=local,
            transpose=True,
            group_size=GROUP,
            bits=self.bits,
            mode=self.mode,
        )
        return y.astype(x.dtype)


class MXExperts(nn.Module):
    """experts(x [T, D], indices [T, k] int32, weights [T, k] float32) -> [T, k, D] float32, for
    the experts in `expert_range` (slots routed elsewhere are exactly 0)."""

    def __init__(
        self,
        w1: MXProjection,
        w3: MXProjection,
        w2: MXProjection,
        n_experts: int,
        swiglu_limit: float,
        expert_range: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.n_experts, self.swiglu_limit = n_experts, swiglu_limit
        self.expert_range = check_expert_range(expert_range, n_experts)
        held = self.expert_range[1] - self.expert_range[0]
        if any(p.weight.shape[0] != held for p in (w1, w3, w2)):
            raise FormatError(
                f"MX experts: expert_range {self.expert_range} holds {held} experts, "
                f"the stacks hold {[p.weight.shape[0] for p in (w1, w3, w2)]}"
            )
        if (w1.in_features, w1.out_features) != (w3.in_features, w3.out_features) or (
            w2.in_features,
            w2.out_features,
        ) != (w1.out_features, w1.in_features):
            raise FormatError("MX experts: w1/w3 [inter, D] and w2 [D, inter] shapes disagree")
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.dim = w1.in_features

    @classmethod
    def from_parts(
        cls,
        parts: Mapping[str, Sequence[tuple[mx.array, mx.array, str]]],
        n_experts: int,
        dim: int,
        intermediate: int,
        swiglu_limit: float,
        expert_range: tuple[int, int] | None = None,
    ) -> MXExperts:
        """From per-expert `(weight, scales, mode)` of each projection ("w1", "w3", "w2"), in
        expert order over the range; every expert of a projection must share the mode."""
        projections = {}
        for proj, (d_in, d_out) in expert_projections(dim, intermediate).items():
            modes = sorted({mode for _, _, mode in parts[proj]})
            if len(modes) != 1:
                raise FormatError(f"MX experts: {proj} mixes modes {modes} across experts")
            projections[proj] = MXProjection(
                mx.stack([w for w, _, _ in parts[proj]]),
                mx.stack([s for _, s, _ in parts[proj]]),
                modes[0],
                d_in,
                d_out,
            )
        return cls(projections["w1"], projections["w3"], projections["w2"], n_experts, swiglu_limit, expert_range)

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        check_routing(x, indices, weights, self.dim)
        local, inside = held_slots(indices, self.expert_range, self.n_experts)
        xs = x[:, None, None, :]  # [T, 1, 1, D]
        g, u = self.w1(xs, local), self.w3(xs, local)  # [T, k, 1, inter] in x.dtype
        h = swiglu(g, u, self.swiglu_limit, weights[..., None, None], dtype=x.dtype)
        y = self.w2(h, local).squeeze(-2).astype(mx.float32)  # [T, k, D]
        return zero_unheld(y, inside)
