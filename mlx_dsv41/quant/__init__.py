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

Official FP8 linears become mxfp8 `MXLinear`s and FP4 experts mxfp4 `MXExperts` (both exact
re-layouts, `official.py`); a grouped linear (`wo_a`) stored as FP8 is dequantized to bf16
(docs/numerics.md#dtypes). A converted checkpoint stores the MX re-layouts themselves (`P.weight`
uint32 + `P.scales`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_dsv41.kernels import fp32_linear
from mlx_dsv41.quant import official
from mlx_dsv41.quant.dense import DenseExperts
from mlx_dsv41.quant.errors import FormatError
from mlx_dsv41.quant.experts import check_expert_range, combine_moe, expert_projections, swiglu
from mlx_dsv41.quant.mx_experts import MXExperts, MXProjection
from mlx_dsv41.quant.official import MODES as MX_MODES

__all__ = [
    "DenseExperts",
    "DenseLinear",
    "FormatError",
    "hold_cpu_weights",
    "GroupSlices",
    "GroupedLinear",
    "MXExperts",
    "check_expert_range",
    "make_experts",
    "make_grouped_linear",
    "make_linear",
    "module_tensors",
    "mx_parts",
    "stored_format",
    "swiglu",
    "swiglu_mlp",
]


class GroupedLinear(nn.Module):
    """Block-diagonal linear (docs/model.md#attention-output `wo_a`): group g maps x[..., g, :] to
    y[..., g, :].

    Dense storage is the checkpoint's own `weight [groups * out, in]`; other formats replace the
    module with one linear per group (`slice.{g}`, as exllamav3 stores `wo_a`; see GroupSlices).
    """

    def __init__(self, groups: int, in_features: int, out_features: int):
        super().__init__()
        self.groups, self.in_features, self.out_features = groups, in_features, out_features
        scale = in_features**-0.5
        self.weight = mx.random.uniform(-scale, scale, (groups * out_features, in_features))

    def __call__(self, x: mx.array) -> mx.array:
        # x [..., G, in] -> [..., G, out]; einsum lowers to matmul (fp32 sums on every backend:
        # quant/accumulation.py); a wider stored weight promotes x rather than being rounded to it.
        w = self.weight.reshape(self.groups, self.out_features, self.in_features)
        return mx.einsum("...gi,goi->...go", x, w).astype(x.dtype)


def linear_into(linear: nn.Module, x: mx.array, shape: tuple, rope=None) -> mx.array:
    """linear(x) in `shape` (as many values: e.g. the queries' heads [B, S, H, D]); a format whose
    kernel writes its output in any shape (EXL3 on a GPU: its `into`) takes no reshape (a graph node
    of a decode step). With rope (a kernels.rope.Turn): the output turned by it, in the linear's own
    launch where its format's kernel can (EXL3 on a GPU, docs/design.md#roped-linears), else by
    rope.apply: the same bytes."""
    into = getattr(linear, "into", None)
    if rope is not None:
        y = into(x, shape, rope) if into is not None else None
        return y if y is not None else rope.apply(linear_into(linear, x, shape))
    return into(x, shape) if into is not None else linear(x).reshape(shape)


def normed_linear(linear: nn.Module, norm: nn.Module, x: mx.array) -> mx.array:
    """norm(linear(x)) for an RMSNorm `norm` (weight, eps); a format whose kernel norms its own output
    (EXL3 on a GPU: its `normed`, docs/design.md#normed-linear) takes one launch, not two."""
    normed = getattr(linear, "normed", None)
    y = normed(x, norm.weight, norm.eps) if normed is not None else None
    return y if y is not None else norm(linear(x))


def paired_linears(first: nn.Module, second: nn.Module, x: mx.array, norm: nn.Module | None = None) -> tuple:
    """(first(x), second(x)), first's output through the RMSNorm `norm` where given: two linears
    of one input, in one launch where both formats allow (EXL3 on a GPU: `paired`,
    docs/design.md#paired-linears), otherwise apart (normed_linear, then second)."""
    paired = getattr(first, "paired", None)
    ys = paired(second, x, None if norm is None else (norm.weight, norm.eps)) if paired is not None else None
    if ys is not None:
        return ys
    return (first(x) if norm is None else normed_linear(first, norm, x)), second(x)


def fp32_pair(first: nn.Module, second: nn.Module, x: mx.array) -> tuple[mx.array, mx.array]:
    """(first(fp32(x)), second(fp32(x))) in fp32: two of the reference's fp32 linears of one input
    (the ratio > 1 compressor's, docs/numerics.md#fp32-linears). Where the format pairs them from x
    as it is with fp32 outputs (EXL3 on a GPU: its kernel widens x itself, so the bytes of fp32(x)'s)
    one launch and no cast (docs/design.md#compressor-raw); else the cast, then paired_linears."""
    paired = getattr(first, "paired", None)
    ys = paired(second, x, out_dtype=mx.float32) if paired is not None and x.dtype != mx.float32 else None
    if ys is None:
        ys = paired_linears(first, second, x.astype(mx.float32))
    return ys[0].astype(mx.float32), ys[1].astype(mx.float32)


def windowed_linears(first: nn.Module, second: nn.Module, x: mx.array, norm: nn.Module, window) -> tuple | None:
    """(norm(first(x)), the window ring with second(x)'s rows written as `window` (a
    kernels.rope.WindowWrite) writes them) from one launch where the formats allow (EXL3 on a GPU
    with grid finish: `paired` with the window, docs/design.md#roped-linears); else None (the
    caller runs paired_linears and the rope)."""
    paired = getattr(first, "paired", None)
    return paired(second, x, (norm.weight, norm.eps), window) if paired is not None else None


def grouped_flat(linear: nn.Module, x: mx.array, lead: int) -> mx.array:
    """A grouped linear (GroupedLinear, GroupSlices, EXL3GroupedLinear) of x [*L, ...] whose dims
    after the first `lead` hold each token's G inputs in order (the attention output [B, S, H, D]):
    [*L, G · out], what linear(x.reshape(*L, G, in)).reshape(*L, -1) gives. A format that reads the
    rows as they are (EXL3 on a GPU: its `flat`) takes no reshape (each a graph node of a decode step)."""
    flat = getattr(linear, "flat", None)
    if flat is not None:
        return flat(x, lead)
    dims = x.shape[:lead]
    groups = linear.groups if isinstance(linear, GroupedLinear) else len(linear.slice)
    return linear(x.reshape(*dims, groups, -1)).reshape(*dims, -1)


class DenseLinear(nn.Linear):
    """`nn.Linear` (no bias) that returns x.dtype, like every other format: a stored fp16 weight
    (exllamav3 keeps unquantized linears in fp16) would otherwise promote bf16 inputs to fp32.
    fp32 x makes it one of the reference's fp32 linears, computed from the weight as stored
    (docs/numerics.md#fp32-linears)."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype == mx.float32:
            return fp32_linear.linear(x, self.weight)
        y = super().__call__(x)
        return y if y.dtype == x.dtype else y.astype(x.dtype)


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
        raise FormatError(
            f"{prefix}.weight has a .scale but dtype {weight.dtype} "
            "(expected F8_E4M3 for official FP8 or I8 for official FP4)"
        )
    if f"{prefix}.scales" in tensors:
        return "mlx_quantized"
    if mx.issubdtype(weight.dtype, mx.floating):
        return "dense"
    raise FormatError(f"{prefix}.weight has dtype {weight.dtype} and no scales: not a known format")


def _shape_checked(tensors: Mapping[str, mx.array], key: str, shape: tuple[int, ...]) -> mx.array:
    w = tensors[key]
    if tuple(w.shape) != shape:
        raise FormatError(f"{key}: expected shape {list(shape)}, got {list(w.shape)}")
    return w


def mx_mode(prefix: str, weight: mx.array, in_features: int) -> str:
    """'mxfp4' or 'mxfp8' of a stored MLX MX weight (uint32 [..., in·bits/32]), from its width."""
    bits = 32 * weight.shape[-1] // in_features if weight.ndim >= 2 else 0
    if weight.dtype != mx.uint32 or 32 * weight.shape[-1] != bits * in_features or bits not in (4, 8):
        raise FormatError(
            f"{prefix}.weight: expected uint32 [..., {in_features // 8}] (mxfp4) or "
            f"[..., {in_features // 4}] (mxfp8) for {in_features} inputs, got "
            f"{weight.dtype} {list(weight.shape)}"
        )
    return {4: "mxfp4", 8: "mxfp8"}[bits]


def mx_parts(
    tensors: Mapping[str, mx.array], prefix: str, in_features: int, out_features: int
) -> tuple[mx.array, mx.array, str]:
    """(weight uint32, scales uint8, mode) of the linear under `prefix` stored as official FP8
    (32x32 tile scales, re-laid per row: exact), official FP4 (already mxfp4) or MLX mxfp4/mxfp8."""
    fmt = stored_format(tensors, prefix)
    weight = tensors[f"{prefix}.weight"]
    if fmt == "fp8":
        _shape_checked(tensors, f"{prefix}.weight", official.fp8_shapes(out_features, in_features)[0])
        return (*official.fp8_block_to_mxfp8(weight, tensors[f"{prefix}.scale"], f"{prefix}.weight"), "mxfp8")
    if fmt == "fp4":
        _shape_checked(tensors, f"{prefix}.weight", official.fp4_shapes(out_features, in_features)[0])
        return (*official.fp4_to_mxfp4(weight, tensors[f"{prefix}.scale"], f"{prefix}.weight"), "mxfp4")
    if fmt != "mlx_quantized":
        raise FormatError(f"{prefix}: stored as {fmt}, expected an MX format (official FP8/FP4 or mxfp4/mxfp8)")
    if f"{prefix}.biases" in tensors:
        raise FormatError(f"{prefix}: affine-quantized weights (.biases) are not supported; only mxfp4 / mxfp8")
    mode = mx_mode(prefix, weight, in_features)
    w_shape, s_shape = official.mx_shapes(out_features, in_features, MX_MODES[mode])
    scales = tensors[f"{prefix}.scales"]
    _shape_checked(tensors, f"{prefix}.weight", w_shape)
    if scales.dtype != mx.uint8 or tuple(scales.shape) != s_shape:
        raise FormatError(f"{prefix}.scales: expected uint8 {list(s_shape)}, got {scales.dtype} {list(scales.shape)}")
    return weight, scales, mode


# ------------------------------------------------------------------------------- constructors


def make_linear(tensors: Mapping[str, mx.array], prefix: str, in_features: int, out_features: int) -> nn.Module:
    """The linear stored under `prefix` (no bias); W has [out, in] semantics."""
    fmt = stored_format(tensors, prefix)
    if fmt == "dense":
        lin = DenseLinear(in_features, out_features, bias=False)
        lin.weight = _shape_checked(tensors, f"{prefix}.weight", (out_features, in_features))
        return lin
    if fmt == "exl3":
        from mlx_dsv41 import exl3  # only checkpoints that hold EXL3 tensors need it

        return exl3.linear_from_stored(tensors, prefix, in_features, out_features)
    return official.mx_quantized_linear(*mx_parts(tensors, prefix, in_features, out_features))


def make_grouped_linear(
    tensors: Mapping[str, mx.array], prefix: str, groups: int, in_features: int, out_features: int
) -> nn.Module:
    """`P.weight [groups·out, in]` (dense, or official FP8 dequantized to bf16 with its scales:
    docs/checkpoint.md#official-conversion says `wo_a` runs unquantized) or `P.slice.{g}` linears of
    any format."""
    if any(k.startswith(f"{prefix}.slice.") for k in tensors) and f"{prefix}.weight" not in tensors:
        slices = [f"{prefix}.slice.{g}" for g in range(groups)]
        if all(stored_format(tensors, p) == "exl3" and f"{p}.bias" not in tensors for p in slices):
            from mlx_dsv41 import exl3  # every group in one set of launches on a GPU

            return exl3.grouped_from_stored(tensors, prefix, groups, in_features, out_features)
        return GroupSlices([make_linear(tensors, p, in_features, out_features) for p in slices])
    fmt = stored_format(tensors, prefix)
    shape = (groups * out_features, in_features)
    lin = GroupedLinear(groups, in_features, out_features)
    if fmt == "dense":
        lin.weight = _shape_checked(tensors, f"{prefix}.weight", shape)
    elif fmt == "fp8":
        _shape_checked(tensors, f"{prefix}.weight", shape)
        lin.weight = official.dequantize_fp8_block(
            tensors[f"{prefix}.weight"], tensors[f"{prefix}.scale"], mx.bfloat16, f"{prefix}.weight"
        )
    else:
        raise FormatError(
            f"{prefix}: a grouped linear is stored dense, as official FP8 or as "
            f"{prefix}.slice.{{g}} linears, not as {fmt}"
        )
    return lin


def swiglu_mlp(
    x: mx.array, w1: nn.Module, w3: nn.Module, w2: nn.Module, limit: float, routed: mx.array | None = None
) -> mx.array:
    """w2(swiglu(w1(x), w3(x))) in x.dtype (the shared expert, docs/model.md#moe), each linear of
    its own format; with ``routed`` (the routed slots [T, k, D] fp32) the MoE's output
    (`combine_moe`). Three EXL3 linears take the EXL3 path (fused expert kernels on a GPU, the
    combine in the last of them)."""
    if "mlx_dsv41.exl3" in sys.modules:  # only a model holding EXL3 tensors has imported it
        from mlx_dsv41 import exl3
        from mlx_dsv41.exl3 import ops as exl3_ops

        if all(isinstance(w, exl3.EXL3Linear) for w in (w1, w3, w2)):
            return exl3_ops.swiglu_mlp(x, w1, w3, w2, limit, routed)
    return combine_moe(routed, w2(swiglu(w1(x), w3(x), limit, dtype=x.dtype)))


def fused_moe_fits(experts, w1, w3, w2, limit: float, x: mx.array) -> bool:
    """Whether `fused_moe` computes the MoE of x [..., D] (its leading dims the tokens) here."""
    if "mlx_dsv41.exl3" not in sys.modules:  # only a model holding EXL3 tensors has imported it
        return False
    from mlx_dsv41.exl3 import ops as exl3_ops

    return exl3_ops.shared_fits(experts, w1, w3, w2, limit, math.prod(x.shape[:-1]), x.dtype)


def fused_moe(experts, w1, w3, w2, limit: float, x: mx.array, indices: mx.array, weights: mx.array):
    """The MoE's output in x's shape and dtype (x [..., D], indices and weights [T, k]) with the
    shared expert (w1, w3, w2) computed in the routed experts' launches (EXL3 on a GPU:
    exl3.ops.moe, the same bytes as the two computed apart; x read as it is), or None where the
    formats or the backend do not allow it (`fused_moe_fits`; the caller computes them apart)."""
    if not fused_moe_fits(experts, w1, w3, w2, limit, x):
        return None
    from mlx_dsv41.exl3 import ops as exl3_ops

    return exl3_ops.moe(x, indices, weights, experts, w1, w3, w2)


def make_experts(
    tensors: Mapping[str, mx.array],
    prefix: str,
    n_experts: int,
    dim: int,
    intermediate: int,
    swiglu_limit: float,
    expert_range: tuple[int, int] | None = None,
) -> nn.Module:
    """Routed experts stored per expert as `P.{e}.{w1,w2,w3}` (official layout; the format decided
    from expert `lo`'s w1, shared by every expert of the layer), or stacked dense `P.{w1,w2,w3}`
    (DenseExperts' own parameters, as a converted or re-saved model holds them)."""
    lo, hi = check_expert_range(expert_range, n_experts)
    if f"{prefix}.w1" in tensors:  # already stacked: this module's own parameters, saved
        return DenseExperts.from_stacked(tensors, prefix, n_experts, dim, intermediate, swiglu_limit, (lo, hi))
    if f"{prefix}.w1.scales" in tensors:  # MXExperts' own parameters, saved
        return _stacked_mx_experts(tensors, prefix, n_experts, dim, intermediate, swiglu_limit, (lo, hi))
    fmt = stored_format(tensors, f"{prefix}.{lo}.w1")
    if fmt == "dense":
        return DenseExperts.from_tensors(tensors, prefix, n_experts, dim, intermediate, swiglu_limit, (lo, hi))
    if fmt == "exl3":
        from mlx_dsv41 import exl3

        return exl3.experts_from_stored(tensors, prefix, n_experts, dim, intermediate, swiglu_limit, (lo, hi))
    parts = {
        proj: [mx_parts(tensors, f"{prefix}.{e}.{proj}", d_in, d_out) for e in range(lo, hi)]
        for proj, (d_in, d_out) in expert_projections(dim, intermediate).items()
    }
    return MXExperts.from_parts(parts, n_experts, dim, intermediate, swiglu_limit, (lo, hi))


def _stacked_mx_experts(
    tensors: Mapping[str, mx.array],
    prefix: str,
    n_experts: int,
    dim: int,
    intermediate: int,
    swiglu_limit: float,
    expert_range: tuple[int, int],
) -> MXExperts:
    """`P.{w1,w3,w2}.{weight,scales}` stacked over all experts or exactly the experts in range."""
    lo, hi = expert_range
    projections = {}
    for proj, (d_in, d_out) in expert_projections(dim, intermediate).items():
        p = f"{prefix}.{proj}"
        if f"{p}.weight" not in tensors or f"{p}.scales" not in tensors:
            raise FormatError(f"missing tensor {p}.weight or {p}.scales (stacked MX experts)")
        weight, scales = tensors[f"{p}.weight"], tensors[f"{p}.scales"]
        if weight.ndim == 3 and weight.shape[0] == n_experts and hi - lo != n_experts:
            weight, scales = weight[lo:hi], scales[lo:hi]
        projections[proj] = MXProjection(weight, scales, mx_mode(p, weight, d_in), d_in, d_out)
    return MXExperts(projections["w1"], projections["w3"], projections["w2"], n_experts, swiglu_limit, expert_range)


def hold_cpu_weights(module: nn.Module) -> None:
    """Before a compiled step's first trace: layers whose CPU path keeps decoded weights (EXL3's
    W̃) decode them now, so the trace captures them as they are instead of their decoding."""
    from mlx_dsv41.exl3 import ops

    ops.hold_cpu_weights(module)


def module_tensors(module: nn.Module, prefix: str) -> dict[str, mx.array]:
    """The module's parameters keyed under `prefix`, as `load_weights` expects them."""
    return {f"{prefix}.{k}": v for k, v in tree_flatten(module.parameters())}
