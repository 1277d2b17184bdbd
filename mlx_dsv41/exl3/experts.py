"""EXL3Experts: routed MoE experts stored as one EXL3 linear per expert and projection.

Checkpoints store ``{prefix}.{e}.w1|w3|w2.{trellis,suh,svh,mul1|mcg}`` per expert
(docs/exl3.md#experts-storage; w1 = gate, w3 = up, w2 = down, HF orientation [out, in], so EXL3 k =
in, n = out). K and even the codebook are per tensor, so each projection stacks its experts'
trellises in groups of equal (K, codebook): a kernel launch serves one group. suh/svh are stacked
over all local experts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlx_dsv41.exl3 import ops
from mlx_dsv41.exl3.stored import check_linear, linear_tensors
from mlx_dsv41.kernels.exl3 import SlotStack
from mlx_dsv41.quant.experts import check_expert_range


class EXL3ExpertGroup(nn.Module):
    """The trellises [G, k/16, n/16, 16K] of a projection's experts that share (K, codebook)."""

    def __init__(self, trellis: mx.array, experts: Sequence[int], k2: int, codebook: str, n_local: int):
        super().__init__()
        self.trellis = trellis
        self.k2 = k2
        self.codebook = codebook
        self._experts = tuple(experts)
        pos = [int(SlotStack.OTHER_GROUP)] * n_local
        for i, e in enumerate(experts):
            pos[e] = i
        self._position = mx.array(pos, mx.int32)  # local expert -> index in the stack (SlotStack)

    @property
    def experts(self) -> tuple[int, ...]:
        return self._experts

    @property
    def position(self) -> mx.array:
        return self._position


class EXL3ExpertProjection(nn.Module):
    """One projection (w1, w3 or w2) of a contiguous range of experts: suh [E, k], svh [E, n] and
    the trellises in groups of equal (K, codebook)."""

    def __init__(
        self, suh: mx.array, svh: mx.array, groups: Sequence[EXL3ExpertGroup], in_features: int, out_features: int
    ):
        super().__init__()
        self.suh = suh.astype(mx.float16)
        self.svh = svh.astype(mx.float16)
        self.groups = list(groups)
        self.k, self.n = suh.shape[1], svh.shape[1]
        self.in_features, self.out_features = in_features, out_features
        self._where = [None] * suh.shape[0]  # local expert -> (group, index in its stack)
        for g, group in enumerate(self.groups):
            if group.trellis.shape[1:3] != (self.k // 16, self.n // 16):
                raise ValueError(f"EXL3 expert group trellis {group.trellis.shape} does not match {self.k}x{self.n}")
            for j, e in enumerate(group.experts):
                self._where[e] = (g, j)
        if None in self._where:
            raise ValueError(f"EXL3 experts {[e for e, w in enumerate(self._where) if w is None]} are in no group")

    @classmethod
    def from_experts(cls, per_expert: Sequence[dict], in_features=None, out_features=None):
        """From per-expert {trellis, suh, svh, codebook} (as stored), grouped by (K, codebook)."""
        if not per_expert:
            raise ValueError("EXL3ExpertProjection needs at least one expert")
        shapes, keys = set(), []
        for t in per_expert:
            k, n, k2, in_f, out_f = check_linear(
                t["trellis"], t["suh"], t["svh"], t["codebook"], None, in_features, out_features
            )
            shapes.add((k, n, in_f, out_f))
            keys.append((k2, t["codebook"]))
        if len(shapes) != 1:
            raise ValueError(f"EXL3 experts of one projection have different shapes: {sorted(shapes)}")
        _, _, in_f, out_f = shapes.pop()
        groups = []
        for key in sorted(set(keys)):
            members = [i for i, kk in enumerate(keys) if kk == key]
            trellis = mx.stack([per_expert[e]["trellis"] for e in members])
            groups.append(EXL3ExpertGroup(trellis, members, *key, len(per_expert)))
        suh = mx.stack([t["suh"] for t in per_expert])
        svh = mx.stack([t["svh"] for t in per_expert])
        return cls(suh, svh, groups, in_f, out_f)

    @classmethod
    def from_stacked(
        cls, trellis: mx.array, suh: mx.array, svh: mx.array, codebook: str, in_features=None, out_features=None
    ):
        """All experts at one K and codebook, already stacked: trellis [E, k/16, n/16, 16K]."""
        _, _, k2, in_f, out_f = check_linear(trellis[0], suh[0], svh[0], codebook, None, in_features, out_features)
        n_local = trellis.shape[0]
        group = EXL3ExpertGroup(trellis, range(n_local), k2, codebook, n_local)
        return cls(suh, svh, [group], in_f, out_f)

    @property
    def n_local(self) -> int:
        return self.suh.shape[0]

    def expert(self, local: int):
        """(trellis, suh, svh, codebook) of one local expert, as for EXL3Linear."""
        g, j = self._where[local]
        group = self.groups[g]
        return group.trellis[j], self.suh[local], self.svh[local], group.codebook


class EXL3Experts(nn.Module):
    """experts(x [T, D], indices [T, k] int32, weights [T, k] float32) -> [T, k, D] float32.

    Slot (t, s) = w2_e(bf16(weights[t, s] * silu(min(g, L)) * clamp(u, -L, L))), g = w1_e(x_t),
    u = w3_e(x_t), e = indices[t, s], L = swiglu_limit; not summed over slots. Only experts in
    ``expert_range`` = [lo, hi) are held; slots routed to other experts are exactly 0.
    """

    def __init__(
        self,
        w1: EXL3ExpertProjection,
        w3: EXL3ExpertProjection,
        w2: EXL3ExpertProjection,
        n_experts: int,
        expert_range=None,
        swiglu_limit: float = 10.0,
    ):
        super().__init__()
        lo, hi = check_expert_range(expert_range, n_experts)
        if any(p.n_local != hi - lo for p in (w1, w3, w2)):
            raise ValueError(
                f"expert_range {(lo, hi)} of {n_experts} experts does not match the "
                f"{[p.n_local for p in (w1, w3, w2)]} experts held"
            )
        if (w1.in_features, w1.out_features) != (w3.in_features, w3.out_features) or (
            w2.in_features,
            w2.out_features,
        ) != (w1.out_features, w1.in_features):
            raise ValueError(
                "EXL3 expert shapes disagree: w1 "
                f"{w1.in_features}->{w1.out_features}, w3 {w3.in_features}->{w3.out_features}, "
                f"w2 {w2.in_features}->{w2.out_features}"
            )
        self.w1, self.w3, self.w2 = w1, w3, w2
        self.n_experts = n_experts
        self.expert_range = (lo, hi)
        self.swiglu_limit = float(swiglu_limit)

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping,
        prefix: str,
        n_experts: int,
        expert_range=None,
        hidden_size=None,
        intermediate_size=None,
        swiglu_limit: float = 10.0,
    ):
        """From per-expert stored tensors ``{prefix}.{e}.{w1,w3,w2}.*`` for e in expert_range."""
        lo, hi = check_expert_range(expert_range, n_experts)

        def projection(name, in_f, out_f):
            per_expert = []
            for e in range(lo, hi):
                t = linear_tensors(tensors, f"{prefix}.{e}.{name}")
                if t["bias"] is not None:
                    raise ValueError(f"EXL3 expert {prefix}.{e}.{name} has a bias; routed experts have none")
                per_expert.append(t)
            return EXL3ExpertProjection.from_experts(per_expert, in_f, out_f)

        return cls(
            projection("w1", hidden_size, intermediate_size),
            projection("w3", hidden_size, intermediate_size),
            projection("w2", intermediate_size, hidden_size),
            n_experts,
            (lo, hi),
            swiglu_limit,
        )

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        return ops.experts(x, indices, weights, self.w1, self.w3, self.w2, self.expert_range, self.swiglu_limit)


class EXL3GroupedLinear(nn.Module):
    """A grouped linear (docs/model.md#attention `wo_a`: group g maps x[..., g, :] to y[..., g, :])
    stored as one EXL3 linear per group (`P.slice.{g}`, as exllamav3 stores it): the groups as the
    "experts" of one EXL3ExpertProjection, so a GPU serves them all in one set of launches
    (ops.grouped) instead of one GEMV per group. Each group's output is rounded as its own
    linear's is."""

    def __init__(self, proj: EXL3ExpertProjection):
        super().__init__()
        self.proj = proj
        self.groups, self.in_features, self.out_features = proj.n_local, proj.in_features, proj.out_features

    @classmethod
    def from_slices(cls, slices: Sequence[dict], in_features: int, out_features: int) -> EXL3GroupedLinear:
        """From each group's stored {trellis, suh, svh, codebook} (no bias)."""
        return cls(EXL3ExpertProjection.from_experts(slices, in_features, out_features))

    def __call__(self, x: mx.array) -> mx.array:
        """x [..., G, in] -> [..., G, out] (ops.grouped)."""
        return ops.grouped(x, self.proj)

    def flat(self, x: mx.array, lead: int) -> mx.array:
        """x [*L, ...] holding each token's G inputs in order -> [*L, G · out] (quant.grouped_flat;
        ops.grouped_flat: no reshape on a GPU)."""
        return ops.grouped_flat(x, self.proj, lead)
