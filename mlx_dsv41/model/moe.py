"""Mixture of experts (docs/model.md#moe): sqrtsoftplus router with bias-only selection, routed
experts through the experts contract (docs/design.md), and one shared expert."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_dsv41.config import ModelArgs
from mlx_dsv41.kernels.grid_finish import held_counters
from mlx_dsv41.kernels.moe_route import gate
from mlx_dsv41.quant import DenseExperts, fused_moe, fused_moe_fits, swiglu_mlp


class Gate(nn.Module):
    """Router: `weight [E, D]` (held as stored, bf16; its logits are fp32), `bias [E]` fp32 (used only
    to choose experts)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.route_scale = args.routed_scaling_factor
        self.temperature = args.gate_temp
        self.weight = mx.random.normal((args.n_routed_experts, args.hidden_size)) * args.hidden_size**-0.5
        self.bias = mx.zeros((args.n_routed_experts,), dtype=mx.float32)

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """x [T, D] (or the T rows under other leading dims) -> indices [T, k] int32 (ascending
        expert id), weights [T, k] fp32."""
        # fp32 logits from the stored bf16 (docs/numerics.md#fp32-linears); on CUDA one launch with the route
        counters = held_counters(self, 1)
        return gate(x, self.weight, self.bias, self.top_k, self.temperature, self.route_scale, counters)


class SharedExpert(nn.Module):
    """`shared_experts.{w1, w2, w3}`: the same clamped SwiGLU as a routed expert, weight 1."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, inter = args.hidden_size, args.moe_intermediate_size
        self.limit = args.swiglu_limit
        self.w1 = nn.Linear(d, inter, bias=False)
        self.w3 = nn.Linear(d, inter, bias=False)
        self.w2 = nn.Linear(inter, d, bias=False)

    def __call__(self, x: mx.array, routed: mx.array | None = None) -> mx.array:
        """x [T, D] -> [T, D] in x.dtype; with the routed slots [T, k, D] fp32, the MoE's output
        (quant.combine_moe: on a GPU the shared expert's last launch adds them)."""
        return swiglu_mlp(x, self.w1, self.w3, self.w2, self.limit, routed)


class MoE(nn.Module):
    """`gate`, `experts` (any module with the experts contract), `shared_experts`."""

    def __init__(self, args: ModelArgs, expert_range: tuple[int, int] | None = None):
        super().__init__()
        self.dim = args.hidden_size
        self.gate = Gate(args)
        self.experts = DenseExperts(
            args.n_routed_experts, args.hidden_size, args.moe_intermediate_size, args.swiglu_limit, expert_range
        )
        self.shared_experts = SharedExpert(args)
        # Expert parallelism (mlx_dsv41.distributed.apply): computes this rank's routed slots and
        # returns every rank's, [T, k, D] fp32. None in one process: no collective runs.
        self.exchange = None

    def __call__(self, x: mx.array) -> mx.array:
        """x [B, S, D] bf16 (ffn_norm-ed) -> [B, S, D] in x.dtype."""
        sh = self.shared_experts
        if self.exchange is None and fused_moe_fits(self.experts, sh.w1, sh.w3, sh.w2, sh.limit, x):
            # the shared expert in the routed experts' launches (the same bytes), which read and
            # write x's rows as they are: no reshape node either way
            indices, weights = self.gate(x)
            return fused_moe(self.experts, sh.w1, sh.w3, sh.w2, sh.limit, x, indices, weights)
        flat = x.reshape(-1, self.dim)
        indices, weights = self.gate(flat)
        if self.exchange is None:
            slots = self.experts(flat, indices, weights)  # [T, k, D] fp32
        else:
            slots = self.exchange(self.experts, flat, indices, weights)
        # fp32 sum in slot order, then the shared expert (the reference's accumulation order).
        return self.shared_experts(flat, routed=slots).reshape(x.shape)
