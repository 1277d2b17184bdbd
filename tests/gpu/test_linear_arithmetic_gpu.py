"""tests/test_linear_arithmetic.py on the GPU (issue 15), at row counts that take MLX's other
kernels: 1 and 7 rows (CUDA qmv / gemv; EXL3 GEMV), 8 (CUDA qmm), 512 (GEMMs; the EXL3 fp32
product); experts at 1, 3 (the fused EXL3 kernels) and 12 tokens (one expert at a time).

The policy check runs MLX's own quantized ops on bf16 activations: wherever
quant/accumulation.py lets a kernel keep bf16 inputs, that kernel must already sum in fp32 (within
the bound, and mostly the float64 value rounded once). Where it casts, the measured error is
printed (the finding the cast rests on).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from attention_stack import rb
from test_linear_arithmetic import (  # noqa: F401 (fixtures)
    BOUND,
    SAME,
    _official,
    activations,
    check_experts,
    check_linear,
    experts,
    f64,
    linear,
    rel_err,
    test_grouped_linear_sums_in_fp32,
)

from mlx_dsv41.quant import accumulation, make_linear


@pytest.mark.parametrize("rows", [1, 7, 8, 512])
def test_linear_on_the_gpu(linear, rows):  # noqa: F811 (the imported fixture)
    check_linear(*linear, rows)


@pytest.mark.parametrize("tokens", [1, 3, 12])
def test_experts_on_the_gpu(experts, tokens):  # noqa: F811 (the imported fixture)
    check_experts(*experts, tokens)


@pytest.mark.parametrize("rows", [1, 512])
@pytest.mark.parametrize("kind", ["bf16", "fp8", "exl3 slices"])
def test_grouped_on_the_gpu(kind, rows):
    test_grouped_linear_sums_in_fp32(kind, rows)


@pytest.mark.parametrize("mode,bits", [("mxfp8", 8), ("mxfp4", 4)])
@pytest.mark.parametrize("rows", [1, 6, 7, 8, 64])
def test_kernels_left_on_bf16_inputs_sum_in_fp32(mode, bits, rows):
    tensors, w = _official("fp8" if bits == 8 else "fp4")
    layer = make_linear(tensors, "p", w.shape[1], w.shape[0])
    x = activations(rows, seed=rows)
    want = f64(x) @ w.T
    raw = mx.quantized_matmul(x, layer.weight, layer.scales, transpose=True, group_size=32, bits=bits, mode=mode)
    err, same = rel_err(f64(raw), want), float(np.mean(f64(raw) == rb(want)))
    cast = accumulation.needs_fp32_activations("quantized_matmul", bits, rows)
    print(f"quantized_matmul {mode} rows {rows}: bf16 x error {err:.2e}, {same:.1%} rounded once; policy casts: {cast}")
    if not cast:
        assert err <= BOUND and same >= SAME, (err, same)


@pytest.mark.parametrize("tokens", [1, 2, 16])
def test_gather_kernels_left_on_bf16_inputs_sum_in_fp32(tokens):
    tensors, w = _official("fp4")
    layer = make_linear(tensors, "p", w.shape[1], w.shape[0])
    stacked_w, stacked_s = layer.weight[None], layer.scales[None]
    x = activations(tokens, seed=tokens)[:, None, None, :]
    local = mx.zeros((tokens, 6), mx.int32)
    raw = mx.gather_qmm(
        x, stacked_w, stacked_s, None, rhs_indices=local, transpose=True, group_size=32, bits=4, mode="mxfp4"
    )
    want = f64(x[:, 0, 0]) @ w.T
    err = rel_err(f64(raw[:, 0, 0]), want)
    cast = accumulation.needs_fp32_activations("gather_qmm", 4, local.size)
    print(f"gather_qmm mxfp4 slots {local.size}: bf16 x error {err:.2e}; policy casts: {cast}")
    if not cast:
        assert err <= BOUND, err
