"""Dense (unquantized) routed experts: stacked float weights, `mx.gather_mm` per slot.

The weights are held in fp32: `gather_mm` runs only in fp32 on the CPU, and this format exists for
tests and references (bf16 checkpoint values convert to fp32 exactly). Real checkpoints use EXL3
or the official FP4 experts.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

from mlx_dsv41.quant.errors import FormatError
from mlx_dsv41.quant.experts import (
    check_expert_range,
    check_routing,
    expert_projections,
    held_slots,
    swiglu,
    zero_unheld,
)


class DenseExperts(nn.Module):
    """Experts lo..hi-1 of a layer: w1, w3 [n, inter, D] (gate, up), w2 [n, D, inter] (down)."""

    def __init__(
        self,
        n_experts: int,
        dim: int,
        intermediate: int,
        swiglu_limit: float,
        expert_range: tuple[int, int] | None = None,
    ):
        super().__init__()
        self.n_experts, self.dim, self.intermediate = n_experts, dim, intermediate
        self.swiglu_limit = swiglu_limit
        self.expert_range = check_expert_range(expert_range, n_experts)
        n = self.expert_range[1] - self.expert_range[0]
        s_in, s_mid = dim**-0.5, intermediate**-0.5
        self.w1 = mx.random.uniform(-s_in, s_in, (n, intermediate, dim))
        self.w3 = mx.random.uniform(-s_in, s_in, (n, intermediate, dim))
        self.w2 = mx.random.uniform(-s_mid, s_mid, (n, dim, intermediate))

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, mx.array],
        prefix: str,
        n_experts: int,
        dim: int,
        intermediate: int,
        swiglu_limit: float,
        expert_range: tuple[int, int] | None = None,
    ) -> DenseExperts:
        """Stack `{prefix}.{e}.{w1,w2,w3}.weight` for the experts in range (others are not read)."""
        module = cls(n_experts, dim, intermediate, swiglu_limit, expert_range)
        lo, hi = module.expert_range
        for proj, (d_in, d_out) in expert_projections(dim, intermediate).items():
            shape, stack = (d_out, d_in), []
            for e in range(lo, hi):
                key = f"{prefix}.{e}.{proj}.weight"
                if key not in tensors:
                    raise FormatError(f"missing tensor {key} (dense expert {e} of {n_experts})")
                w = tensors[key]
                if tuple(w.shape) != shape or not mx.issubdtype(w.dtype, mx.floating):
                    raise FormatError(
                        f"{key}: expected a float tensor of shape {list(shape)}, got {w.dtype} {list(w.shape)}"
                    )
                stack.append(w)
            setattr(module, proj, mx.stack(stack).astype(mx.float32))
        return module

    @classmethod
    def from_stacked(
        cls,
        tensors: Mapping[str, mx.array],
        prefix: str,
        n_experts: int,
        dim: int,
        intermediate: int,
        swiglu_limit: float,
        expert_range: tuple[int, int] | None = None,
    ) -> DenseExperts:
        """`{prefix}.{w1,w2,w3}` stacked over all experts or over exactly the experts in range."""
        module = cls(n_experts, dim, intermediate, swiglu_limit, expert_range)
        lo, hi = module.expert_range
        for proj in ("w1", "w3", "w2"):
            key = f"{prefix}.{proj}"
            if key not in tensors:
                raise FormatError(f"missing tensor {key} (stacked dense experts)")
            w, want = tensors[key], getattr(module, proj).shape
            if w.ndim == 3 and w.shape[0] == n_experts and w.shape[1:] == want[1:] and hi - lo != n_experts:
                w = w[lo:hi]
            if w.shape != want or not mx.issubdtype(w.dtype, mx.floating):
                raise FormatError(
                    f"{key}: expected a float tensor of shape {list(want)} (experts "
                    f"{lo}..{hi - 1}) or [{n_experts}, ...], got {w.dtype} {list(w.shape)}"
                )
            setattr(module, proj, w.astype(mx.float32))
        return module

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        check_routing(x, indices, weights, self.dim)
        local, inside = held_slots(indices, self.expert_range, self.n_experts)
        xs = x.astype(mx.float32)[:, None, None, :]  # [T, 1, 1, D]
        # Each projection's output is rounded to the activation dtype (bf16 in the model), as the
        # reference's linears return it; the math in between is fp32.
        g = mx.gather_mm(xs, self.w1.swapaxes(-1, -2), rhs_indices=local).astype(x.dtype)
        u = mx.gather_mm(xs, self.w3.swapaxes(-1, -2), rhs_indices=local).astype(x.dtype)
        h = swiglu(g, u, self.swiglu_limit, weights[..., None, None], dtype=x.dtype)  # [T, k, 1, inter]
        y = mx.gather_mm(h.astype(mx.float32), self.w2.swapaxes(-1, -2), rhs_indices=local)
        y = y.squeeze(-2).astype(x.dtype).astype(mx.float32)  # [T, k, D]
        return zero_unheld(y, inside)
