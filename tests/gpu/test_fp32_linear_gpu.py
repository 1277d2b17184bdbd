"""fp32_gemv on the GPU (issue 16 item 5: the head held in bf16, summed in fp32), with the kernel
contract: against float64 `x · wᵀ` at Flash's head shape (129,280 x 5120, bf16) for 1..8 rows and on
fp16 weights; nonfinite x where float64 puts it; outputs poisoned (NaN) before launch with guard
rows untouched; five repeats byte-identical; a row's bytes the same solo and batched; the launch
limit declared. And the bound between the kernel (<= 8 rows) and the many-row path (widened pieces
through MLX's fp32 matmul)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.kernels import fp32_linear as fl

pytestmark = pytest.mark.gpu
V, D = 129280, 5120


def _xw(seed, rows, N=V, K=D, w_dtype=mx.bfloat16):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((rows, K)).astype(np.float32))
    w = (mx.random.normal((N, K), key=mx.random.key(seed)) * K**-0.5).astype(w_dtype)
    return x, w


def f64(a):
    return np.array(a.astype(mx.float32), np.float64)


def _kernel(x, w, guard=0):
    return np.array(fl.GEMV(**fl.gemv_args(x, w, init_value=float("nan"), guard=guard))[0])


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_head_shape_matches_float64(rows):
    x, w = _xw(rows, rows)
    assert fl.takes_kernel(rows, w)
    y = np.array(fl.linear(x.astype(mx.bfloat16), w))
    want = f64(x.astype(mx.bfloat16)) @ f64(w).T
    rel = np.linalg.norm(y - want) / np.linalg.norm(want)
    assert rel < 1e-5 and np.abs(y - want).max() < 1e-5 * np.abs(want).max(), rel


@pytest.mark.parametrize("w_dtype", [mx.float16, mx.float32])
def test_fp16_and_fp32_weights_and_odd_n(w_dtype):
    x, w = _xw(11, 3, N=1001, K=4096, w_dtype=w_dtype)
    y = np.array(fl.linear(x, w))
    want = f64(x) @ f64(w).T
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-5


def test_contract_poison_guards_repeats_and_solo_equals_batched():
    x, w = _xw(3, 8, N=20000)
    runs = [_kernel(x, w, guard=2) for _ in range(5)]
    assert all(np.array_equal(r.view(np.uint32), runs[0].view(np.uint32)) for r in runs)
    assert np.all(np.isnan(runs[0][8:])) and not np.any(np.isnan(runs[0][:8]))
    for r in (0, 5, 7):
        solo = _kernel(x[r : r + 1], w)
        assert np.array_equal(solo[0].view(np.uint32), runs[0][r].view(np.uint32))
    with pytest.raises(ValueError, match="declared limit"):
        fl.GEMV(**dict(fl.gemv_args(x, w), threadgroup=(512, 1, 1)))


def test_nonfinite_inputs_follow_float64():
    x, w = _xw(4, 4, N=3000)
    raw = np.array(x)
    raw[0, 3], raw[2, 100], raw[3, 4000] = np.nan, np.inf, -np.inf
    x = mx.array(raw)
    y = np.array(fl.linear(x, w))
    with np.errstate(all="ignore"):
        want = f64(x) @ f64(w).T
    assert np.array_equal(np.isnan(y), np.isnan(want)) and np.array_equal(np.isinf(y), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(y[finite], want[finite], rtol=0, atol=1e-4)


def test_many_rows_path_agrees_within_fp32_rounding():
    """9 rows take the widened pieces (MLX's fp32 GEMM): another summation order, the same fp32 sums."""
    x, w = _xw(5, 9, N=30000)
    many = np.array(fl.linear(x, w))
    few = np.concatenate([np.array(fl.linear(x[i : i + 1], w)) for i in range(9)])
    scale = np.abs(f64(x) @ f64(w).T).max()
    assert np.abs(many - few).max() <= 1e-5 * scale  # fp32 sums of 5120 terms in two orders; bf16 is 4e-3


@pytest.mark.parametrize("N,K,w_dtype", [(24, 20480, mx.float32), (256, 5120, mx.bfloat16)])
def test_split_k_shapes_contract(N, K, w_dtype):
    """Few-row weights (the mHC mixes' fn, a router) split K over 8 SIMD groups per output: float64,
    poisoned guards, repeats byte-identical, a row's bytes solo == batched."""
    x, w = _xw(6, 8, N=N, K=K, w_dtype=w_dtype)
    x = x.astype(mx.bfloat16)
    assert dict(fl.gemv_args(x, w)["template"])["SPLIT"] == 8
    runs = [_kernel(x, w, guard=2) for _ in range(5)]
    assert all(np.array_equal(r.view(np.uint32), runs[0].view(np.uint32)) for r in runs)
    assert np.all(np.isnan(runs[0][8:])) and not np.any(np.isnan(runs[0][:8]))
    want = f64(x) @ f64(w).T
    assert np.abs(runs[0][:8] - want).max() < 1e-5 * np.abs(want).max()
    for r in (0, 3, 7):
        assert np.array_equal(_kernel(x[r : r + 1], w)[0].view(np.uint32), runs[0][r].view(np.uint32))
