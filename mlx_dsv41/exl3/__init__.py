"""The EXL3 quantization format (exllamav3): exact trellis decoding, EXL3Linear, EXL3Experts.

Everything about the format is here: how it is stored (``stored``), the plain-MLX reference math
(``codebook``, ``trellis``, ``hadamard``, ``reference``), the layers (``linear``, ``experts``) and
which kernel or reference path serves a call of a given shape (``ops``); ``mlx_dsv41.kernels.exl3``
only builds and launches the GPU kernels. No model knowledge.
"""

from mlx_dsv41.exl3.codebook import CODEBOOKS, codebook_table, decode_states
from mlx_dsv41.exl3.experts import EXL3ExpertProjection, EXL3Experts, EXL3GroupedLinear  # noqa: E402 (uses the ops)
from mlx_dsv41.exl3.hadamard import hadamard_128, input_transform, output_transform
from mlx_dsv41.exl3.linear import EXL3Linear  # noqa: E402
from mlx_dsv41.exl3.reference import dequantize
from mlx_dsv41.exl3.stored import check_linear, codebook_from_markers, has_exl3, linear_tensors
from mlx_dsv41.exl3.trellis import k2_from_trellis_shape, reconstruct


def linear_from_stored(tensors, prefix: str, in_features=None, out_features=None) -> EXL3Linear:
    """The EXL3Linear stored under ``prefix`` (the entry point of mlx_dsv41.quant.make_linear)."""
    return EXL3Linear.from_stored(tensors, prefix, in_features, out_features)


def grouped_from_stored(tensors, prefix: str, groups: int, in_features: int, out_features: int):
    """EXL3GroupedLinear from ``{prefix}.slice.{g}.*`` (the entry point of
    mlx_dsv41.quant.make_grouped_linear when every slice is EXL3 without a bias)."""
    slices = []
    for g in range(groups):
        t = linear_tensors(tensors, f"{prefix}.slice.{g}")
        if t["bias"] is not None:
            raise ValueError(f"{prefix}.slice.{g} has a bias; a grouped linear has none")
        slices.append(t)
    return EXL3GroupedLinear.from_slices(slices, in_features, out_features)


def experts_from_stored(
    tensors, prefix: str, n_experts: int, dim: int, intermediate: int, swiglu_limit: float, expert_range=None
) -> EXL3Experts:
    """EXL3Experts from ``{prefix}.{e}.{w1,w3,w2}.*`` (the entry point of mlx_dsv41.quant.make_experts)."""
    return EXL3Experts.from_tensors(tensors, prefix, n_experts, expert_range, dim, intermediate, swiglu_limit)


__all__ = [
    "CODEBOOKS",
    "EXL3ExpertProjection",
    "EXL3Experts",
    "EXL3GroupedLinear",
    "EXL3Linear",
    "check_linear",
    "codebook_from_markers",
    "codebook_table",
    "decode_states",
    "dequantize",
    "experts_from_stored",
    "grouped_from_stored",
    "hadamard_128",
    "has_exl3",
    "input_transform",
    "k2_from_trellis_shape",
    "linear_from_stored",
    "linear_tensors",
    "output_transform",
    "reconstruct",
]
