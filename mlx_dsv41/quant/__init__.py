"""Storage formats → modules. The model builds dense placeholders; `Model.sanitize` swaps in the
module that matches what is stored for each tensor (docs/design.md, "Linear formats").

The format of each linear is decided from the tensors stored under its prefix P, never per
checkpoint (`stored_format`). The constructors here are the only entry points the model and the
loader use:

    make_linear(tensors, P, in_features, out_features)                     -> y = x @ W.T
    make_grouped_linear(tensors, P, groups, in_features, out_features)     -> block-diagonal
    make_experts(tensors, P, n_experts, dim, intermediate, swiglu_limit,
                 expert_range)                                             -> experts contract

Each returns a module whose `parameters()` are what it reads at run time; the caller re-keys
them under P (`module_tensors`). New formats are new branches of these three functions.
"""

from __future__ import annotations

from typing import Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .dense import DenseExperts
from .errors import FormatError
from .experts import check_expert_range, swiglu

__all__ = [
    "DenseExperts", "FormatError", "GroupSlices", "GroupedLinear", "check_expert_range",
    "make_experts", "make_grouped_linear", "make_linear", "module_tensors", "stored_format",
    "swiglu",
]


class GroupedLinear(nn.Module):
    """Block-diagonal linear (spec §4.3 `wo_a`): group g maps x[..., g, :] to y[..., g, :].

    Dense storage is the checkpoint's own `weight [groups * out, in]`; other formats replace the
    module with one linear per group (`slice.{g}`, as exllamav3 stores `wo_a`; see GroupSlices).
    """

    def __init__(self, groups: int, in_features: int, out_features: int):
        super().__init__()
        self.groups, self.in_features, self.out_features = groups, in_features, out_features
        scale = in_features**-0.5
        self.weight = mx.random.uniform(-scale, scale, (groups * out_features, in_features))

    def __call__(self, x: mx.array) -> mx.array:
        # x [..., G, in] -> [..., G, out]
        w = self.weight.reshape(self.groups, self.out_features, self.in_features)
        y = mx.einsum("...gi,goi->...go", x, w.astype(x.dtype))
        return y


class GroupSlices(nn.Module):
    """A grouped linear stored as one linear per group (`P.slice.{g}`), each of any format."""

    def __init__(self, slices: list[nn.Module]):
        super().__init__()
        self.slice = slices

    def __call__(self, x: mx.array) -> mx.array:
        return mx.stack([lin(x[..., g, :]) for g, lin in enumerate(self.slice)], axis=-2)


# ------------------------------------------------------------------------------- detection

_FP8, _FP4 = mx.uint8, mx.int8  # how mx.load presents F8_E4M3 and I8 (packed e2m1) tensors


def stored_format(tensors: Mapping[str, mx.array], prefix: str) -> str:
    """'exl3' | 'fp8' | 'fp4' | 'mlx_quantized' | 'dense' for the linear stored under `prefix`."""
    if f"{prefix}.trellis" in tensors:
        return "exl3"
    weight = tensors.get(f"{prefix}.weight")
    if weight is None:
        stored = sorted(k for k in tensors if k.startswith(prefix + "."))
        if stored:
            raise FormatError(f"{prefix}: stored tensors {stored} match no known linear format")
        raise FormatError(f"missing tensor {prefix}.weight")
    if f"{prefix}.scale" in tensors:
        if weight.dtype == _FP8:
            return "fp8"
        if weight.dtype == _FP4:
            return "fp4"
        raise FormatError(f"{prefix}.weight has a .scale but dtype {weight.dtype} "
                          "(expected F8_E4M3 for official FP8 or I8 for official FP4)")
    if f"{prefix}.scales" in tensors:
        return "mlx_quantized"
    if mx.issubdtype(weight.dtype, mx.floating):
        return "dense"
    raise FormatError(f"{prefix}.weight has dtype {weight.dtype} and no scales: not a known format")


def _unsupported(prefix: str, fmt: str) -> FormatError:
    # The official FP8/FP4 and converted mx-quantized branches arrive with the converter (issue 3).
    return FormatError(f"{prefix}: stored format {fmt!r} is not supported yet")


def _check_dense(tensors: Mapping[str, mx.array], key: str, shape: tuple[int, ...]) -> mx.array:
    w = tensors[key]
    if tuple(w.shape) != shape:
        raise FormatError(f"{key}: expected shape {list(shape)}, got {list(w.shape)}")
    return w


# ------------------------------------------------------------------------------- constructors


def make_linear(tensors: Mapping[str, mx.array], prefix: str, in_features: int,
                out_features: int) -> nn.Module:
    """The linear stored under `prefix` (no bias); W has [out, in] semantics."""
    fmt = stored_format(tensors, prefix)
    if fmt == "dense":
        lin = nn.Linear(in_features, out_features, bias=False)
        lin.weight = _check_dense(tensors, f"{prefix}.weight", (out_features, in_features))
        return lin
    if fmt == "exl3":
        from mlx_dsv41 import exl3  # only checkpoints that hold EXL3 tensors need it

        return exl3.linear_from_stored(tensors, prefix, in_features, out_features)
    raise _unsupported(prefix, fmt)


def make_grouped_linear(tensors: Mapping[str, mx.array], prefix: str, groups: int,
                        in_features: int, out_features: int) -> nn.Module:
    """`P.weight [groups·out, in]` (dense) or `P.slice.{g}` linears of any format."""
    if f"{prefix}.weight" in tensors and stored_format(tensors, prefix) == "dense":
        lin = GroupedLinear(groups, in_features, out_features)
        lin.weight = _check_dense(tensors, f"{prefix}.weight", (groups * out_features, in_features))
        return lin
    if any(k.startswith(f"{prefix}.slice.") for k in tensors):
        return GroupSlices([make_linear(tensors, f"{prefix}.slice.{g}", in_features, out_features)
                            for g in range(groups)])
    raise _unsupported(prefix, stored_format(tensors, prefix))


def make_experts(tensors: Mapping[str, mx.array], prefix: str, n_experts: int, dim: int,
                 intermediate: int, swiglu_limit: float,
                 expert_range: tuple[int, int] | None = None) -> nn.Module:
    """Routed experts stored per expert as `P.{e}.{w1,w2,w3}` (official layout; the format decided
    from expert `lo`'s w1, shared by every expert of the layer), or stacked dense `P.{w1,w2,w3}`
    (DenseExperts' own parameters, as a converted or re-saved model holds them)."""
    lo, hi = check_expert_range(expert_range, n_experts)
    if f"{prefix}.w1" in tensors:  # already stacked: this module's own parameters, saved
        return DenseExperts.from_stacked(tensors, prefix, n_experts, dim, intermediate,
                                         swiglu_limit, (lo, hi))
    fmt = stored_format(tensors, f"{prefix}.{lo}.w1")
    if fmt == "dense":
        return DenseExperts.from_tensors(tensors, prefix, n_experts, dim, intermediate,
                                         swiglu_limit, (lo, hi))
    if fmt == "exl3":
        from mlx_dsv41 import exl3

        return exl3.experts_from_stored(tensors, prefix, n_experts, dim, intermediate,
                                        swiglu_limit, (lo, hi))
    raise _unsupported(f"{prefix}.{lo}.w1", fmt)


def module_tensors(module: nn.Module, prefix: str) -> dict[str, mx.array]:
    """The module's parameters keyed under `prefix`, as `load_weights` expects them."""
    return {f"{prefix}.{k}": v for k, v in tree_flatten(module.parameters())}
