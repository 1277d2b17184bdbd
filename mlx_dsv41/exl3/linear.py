"""EXL3Linear: y = x·W (+ bias) with W kept as the packed trellis (docs/exl3.md#forward)."""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

from mlx_dsv41.exl3 import ops
from mlx_dsv41.exl3.experts import EXL3ExpertProjection
from mlx_dsv41.exl3.stored import check_linear, linear_tensors
from mlx_dsv41.exl3.trellis import bits_per_weight


class EXL3Linear(nn.Module):
    """A linear layer stored as EXL3 (trellis, suh, svh, codebook[, bias]).

    Calling it on x [..., in_features] returns [..., out_features] in x.dtype. The trellis stays
    int16 as stored; inputs narrower than the 128-padded k are zero-extended and outputs are
    trimmed to out_features inside the op.
    """

    def __init__(self, trellis, suh, svh, codebook: str, bias=None, in_features=None, out_features=None):
        super().__init__()
        _, n, k2, self.in_features, self.out_features = check_linear(
            trellis, suh, svh, codebook, bias, in_features, out_features
        )
        self.trellis = trellis
        self.suh = suh.astype(mx.float16)
        self.svh = svh.astype(mx.float16)
        if bias is not None:
            # exllamav3 keeps the bias in fp16 (an fp32 bias is cast at load,
            # docs/exl3.md#stored-tensors).
            self.bias = bias[: self.out_features].astype(mx.float16)
        self.codebook = codebook
        self.bits = bits_per_weight(k2)

    @classmethod
    def from_stored(cls, tensors: Mapping, prefix: str, in_features=None, out_features=None):
        """From a checkpoint's tensors under ``prefix`` (codebook from the marker tensor)."""
        t = linear_tensors(tensors, prefix)
        return cls(t["trellis"], t["suh"], t["svh"], t["codebook"], t["bias"], in_features, out_features)

    def __call__(self, x: mx.array) -> mx.array:
        return self.into(x, None)

    def into(self, x: mx.array, shape: tuple | None, rope=None) -> mx.array | None:
        """self(x) in `shape` (as many values; None: [..., out]): on a GPU the kernel writes it so
        (quant.linear_into: no reshape node). With rope (a kernels.rope.Turn): turned by it in the
        same launch where the kernel can here (ops.roped_linear), else None."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"EXL3Linear expects [..., {self.in_features}], got {x.shape}")
        if rope is not None:
            return ops.roped_linear(
                x, self.trellis, self.suh, self.svh, self.codebook, rope, self.get("bias"), self.out_features, shape
            )
        return ops.linear(
            x,
            self.trellis,
            self.suh,
            self.svh,
            self.codebook,
            bias=self.get("bias"),
            out_features=self.out_features,
            owner=self,
            out_shape=shape,
        )

    def normed(self, x: mx.array, weight: mx.array, eps: float) -> mx.array | None:
        """rms_norm(self(x), weight, eps) from one launch where the kernel gives it here, else None
        (quant.normed_linear: ops.normed_linear)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"EXL3Linear expects [..., {self.in_features}], got {x.shape}")
        return ops.normed_linear(
            x, self.trellis, self.suh, self.svh, self.codebook, weight, eps, self.get("bias"), self.out_features, self
        )

    def paired(
        self, other: nn.Module, x: mx.array, norm: tuple | None = None, window=None, out_dtype=None
    ) -> tuple | None:
        """(self(x), other(x)) from one launch where the kernel gives them here (two EXL3 linears of
        x alike enough: ops.paired_linear), self's output normed with norm = (weight, eps) where
        given; with window (a kernels.rope.WindowWrite) other's rows written into the window ring
        instead (the ring returned); else None (quant.paired_linears, quant.windowed_linears). Outputs
        in out_dtype (default x.dtype: quant.fp32_pair asks fp32 of bf16 x)."""
        if (
            not isinstance(other, EXL3Linear)
            or x.shape[-1] != self.in_features
            or other.in_features != self.in_features
        ):
            return None
        first, second = ((m.trellis, m.suh, m.svh, m.codebook, m.get("bias"), m.out_features) for m in (self, other))
        return ops.paired_linear(x, first, second, norm, self, window, out_dtype)

    def as_single_expert(self) -> EXL3ExpertProjection:
        """This linear as a one-expert EXL3ExpertProjection over the same arrays (made once), so
        that the fused expert kernels can serve it (ops.swiglu_mlp: the shared expert)."""
        if getattr(self, "_single_expert", None) is None:
            views = self.trellis[None], self.suh[None], self.svh[None]
            # Evaluated now (views: no copy), so each is a constant: a view left lazy would be an
            # ExpandDims node that every compiled step replays (nine a layer), also when made
            # inside a step's trace (docs/design.md#constant-views).
            mx.eval(*views)
            self._single_expert = EXL3ExpertProjection.from_stacked(
                *views, self.codebook, self.in_features, self.out_features
            )
        return self._single_expert
