"""Every linear sums in fp32 and rounds once to its output dtype, as the reference does
(docs/numerics.md#dtypes: its linears multiply in fp32 and round to bf16 once).

MLX's own matmul kernels pick their accumulator by backend, op, weight width and row count (read in
MLX 0.32's sources and measured; the table and the measurements are in docs/design.md, "Linear
arithmetic"):

  dense matmul / einsum / gather_mm       fp32 sums, one rounding, on every backend
  quantized_matmul, gather_qmm  CPU       the running sum in the activation dtype: bf16 x -> every
                                          multiply-add rounded to bf16 (1.5-8 % error at K = 5120)
                                CUDA      the qmv path (< 8 rows) keeps per-lane partial sums in
                                          bf16 for weights under 8 bits (mxfp4, nvfp4, affine <= 6)
                                Metal     quantized_matmul with >= 6 rows (the smallest qmv row
                                          limit) may take qmm_splitk, which stores each k slice's
                                          partial in bf16 and adds them in bf16

Where a kernel would sum in the activation dtype, it is given fp32 activations instead (with fp32
x every one of these kernels sums in fp32); the caller rounds its fp32 output once. Kernels that
already sum in fp32 keep bf16 inputs, so the GPU decode path pays nothing. CUDA's mxfp4 case runs
our mxfp4_gemv kernel instead of widening x (docs/numerics.md#mxfp4-gemv); this module's
decision stays the fallback for every other case.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_dsv41.kernels import backend

_QUANTIZED_OPS = ("quantized_matmul", "gather_qmm")
_CUDA_QMV_ROWS = 8  # CUDA: quantized products with fewer rows take the qmv kernels
_METAL_SPLITK_ROWS = 6  # Metal: the smallest row count at which quantized_matmul may split k


def needs_fp32_activations(op: str, bits: int, rows: int, backend_name: str | None = None) -> bool:
    """Whether MLX's `op` ("quantized_matmul" | "gather_qmm") on `backend_name` (default: the
    active one) would keep partial sums in a 16-bit activation dtype for `bits`-bit weights and
    `rows` rows of x (for gather_qmm: token-slot pairs)."""
    if op not in _QUANTIZED_OPS:
        raise ValueError(f"needs_fp32_activations: op must be one of {_QUANTIZED_OPS}, got {op!r}")
    name = backend_name or backend()
    if name == "cpu":
        return True
    if name == "cuda":
        return bits < 8 and rows < _CUDA_QMV_ROWS
    if name == "metal":
        return op == "quantized_matmul" and rows >= _METAL_SPLITK_ROWS
    raise ValueError(f"needs_fp32_activations: unknown backend {name!r}")


def quantized_input(x: mx.array, op: str, bits: int, rows: int) -> mx.array:
    """x as `op` must receive it to sum in fp32 (x itself when it already does)."""
    if x.dtype == mx.float32 or not mx.issubdtype(x.dtype, mx.floating):
        return x
    return x.astype(mx.float32) if needs_fp32_activations(op, bits, rows) else x
