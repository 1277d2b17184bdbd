"""The quant seam's MX branches on the GPU backend (run by `bash benchmarks/gpu_run.sh tests`;
skipped on CPU; no mlx-lm): official FP8 linears as mxfp8 `QuantizedLinear`, FP8 `wo_a`
dequantized, FP4 / FP8 routed experts as `MXExperts` (`mx.gather_qmm`), against float64 decodes
of the raw codes. The CPU tests of tests/test_load_formats.py run here on the default (GPU)
device; then bf16 activations, where the GPU accumulates in fp32 (the CPU does not: ~3% there).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from test_load_formats import (  # noqa: F401 (collected here: the same checks on the GPU device)
    INTER,
    D,
    N,
    _expert_tensors,
    _fp4,
    _fp8,
    _slots_reference,
    test_fp8_grouped_linear_is_dequantized_exactly,
    test_official_experts,
    test_official_linear_is_exact,
    test_stacked_experts_over_all_experts_sliced_to_the_range,
)

from mlx_dsv41.quant import make_experts, make_linear


def test_bf16_activations_on_the_gpu():
    """bf16 x: only the bf16 roundings of x, of g/u and of the w2 input remain (<= 1% of max)."""
    rng = np.random.default_rng(4)
    for make in (_fp4, _fp8):
        tensors, ref = _expert_tensors(make)
        experts = make_experts(tensors, "e", N, D, INTER, 10.0)
        x = mx.array(rng.standard_normal((7, D)) * 2, mx.bfloat16)
        idx = rng.integers(0, N, (7, 3)).astype(np.int32)
        wts = rng.uniform(0.1, 1.0, (7, 3)).astype(np.float32)
        y = np.array(experts(x, mx.array(idx), mx.array(wts)))
        want = _slots_reference(np.array(x.astype(mx.float32)).astype(np.float64), idx, wts, ref, 0, N)
        assert np.abs(y - want).max() <= 0.01 * np.abs(want).max()
    parts, w = _fp8(96, 64)
    layer = make_linear({f"p.{k}": v for k, v in parts.items()}, "p", 64, 96)
    x = mx.array(rng.standard_normal((5, 64)), mx.bfloat16)
    y = np.array(layer(x).astype(mx.float32))
    want = np.array(x.astype(mx.float32)).astype(np.float64) @ w.T
    assert np.abs(y - want).max() <= 0.006 * np.abs(want).max()
