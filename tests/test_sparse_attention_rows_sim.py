"""The rows sparse-attention kernel (mlx_dsv41/metal_ext/sparse_attention_rows.metal) on the CPU
simulator, in its CUDA configuration (bf16 MMA fragments via ldmatrix) and its Metal one (per-lane
FMAs), with the launch kwargs mlx_dsv41.kernels.sparse_attention hands to MLX: against the formula
in float64 (docs/model.md#attention-rows) on random bf16 data, key counts that are not a multiple
of the 16-key tile, skipped (-1) and invalid indices, window-only and pool-only calls, no keys at
all, and nonfinite q, keys and sinks where float64 gives NaN or inf.
tests/gpu/test_sparse_attention_rows_gpu.py repeats this on the device."""

import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest
from attention_rows_cases import BOUND, CASES, float64_attention, make_case

from mlx_dsv41.kernels import sparse_attention as sa

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")


@pytest.fixture(scope="module", params=[True, False], ids=["cuda-mma", "metal-fma"])
def program(request):
    specs = [(sa.ROWS, sa._launch_args(*make_case(*c), 0.0625, "rows")) for c in CASES.values()]
    return exl3_sim.build(specs, mma=request.param)


@pytest.mark.parametrize("i", range(len(CASES)), ids=list(CASES))
def test_matches_float64(program, i):
    inputs = make_case(*list(CASES.values())[i])
    (got,) = program.run(i)
    want = float64_attention(*inputs, 0.0625)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)])
    finite = np.isfinite(want)
    assert finite.any() and not finite.all() if "nonfinite" in list(CASES)[i] else True
    if finite.any():
        err = np.abs(got[finite] - want[finite]).max() / max(np.abs(want[finite]).max(), 1e-30)
        assert err <= BOUND, err


def test_rows_refuses_what_it_does_not_take(monkeypatch):
    q, window, pool, *_ = make_case(*CASES["dim256-heads32-batch2"])
    assert "no tensor-core MMA" in sa.rows_refusal(q, window, pool)  # this CPU
    monkeypatch.setattr(sa, "backend", lambda: "cuda")
    assert sa.rows_refusal(q, window, pool) is None
    assert "must be bf16" in sa.rows_refusal(q.astype(mx.float32), window, pool)
    assert "whole blocks of 16 heads" in sa.rows_refusal(q[:, :, :8], window, pool)
