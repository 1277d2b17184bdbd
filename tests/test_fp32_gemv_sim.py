"""The fp32_gemv kernel body (mlx_dsv41/metal_ext/fp32_gemv.metal) on the CPU simulator, with the
launch kwargs mlx_dsv41.kernels.fp32_linear hands to MLX: against float64 `x · wᵀ` (fp32 sums: the
error stays at fp32 rounding, far under one bf16 rounding) for bf16 and fp16 weights and fp32 / bf16
x, and fp32 weights; a row's bytes the same solo and in a batch of 8; outputs past N and guard rows untouched
(poisoned); NaN / inf in x where float64 puts them. tests/gpu/test_fp32_linear_gpu.py repeats this
on the device with the kernel contract."""

import shutil

import exl3_sim
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.kernels import fp32_linear as fl

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the kernel simulator needs g++")

K, N, GUARD = 1024, 100, 2  # N: 4 threadgroups of 32 outputs, the last one partly past the end
CASES = [  # rows, x dtype, w dtype
    (1, mx.float32, mx.bfloat16),
    (8, mx.float32, mx.bfloat16),
    (3, mx.bfloat16, mx.float16),
    (2, mx.bfloat16, mx.float32),  # the mHC mixes' fp32 `fn`
]


def _data(seed, rows, x_dtype, w_dtype):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((rows, K)).astype(np.float32)).astype(x_dtype)
    w = mx.array((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)).astype(w_dtype)
    return x, w


def f64(a):
    return np.array(a.astype(mx.float32), np.float64)


@pytest.fixture(scope="module")
def program():
    specs = [(fl.GEMV, fl.gemv_args(*_data(i, *c), guard=GUARD)) for i, c in enumerate(CASES)]
    return exl3_sim.build(specs, mma=True), specs


@pytest.mark.parametrize("i", range(len(CASES)))
def test_matches_float64(program, i):
    prog, _ = program
    x, w = _data(i, *CASES[i])
    (y,) = prog.run(i)
    assert np.all(np.isnan(y[-GUARD:]))  # guard rows keep the 0xFF poison
    want = f64(x) @ f64(w).T
    err = np.abs(y[:-GUARD] - want).max() / np.abs(want).max()
    assert err < 2e-6, err  # fp32 sums over K = 1024 (a bf16 rounding is 4e-3)


def test_a_row_has_the_same_bytes_solo_and_batched(program):
    prog, specs = program
    x, w = _data(1, *CASES[1])
    (batched,) = prog.run(1)
    solo_call = fl.gemv_args(x[5:6], w, guard=GUARD)
    (solo,) = prog.run(0, solo_call)
    assert np.array_equal(solo[0].view(np.uint32), batched[5].view(np.uint32))


def test_nonfinite_inputs_follow_float64(program):
    prog, _ = program
    x, w = _data(2, *CASES[1])
    raw = np.array(x)
    raw[1, 5], raw[4, 7], raw[6, 900] = np.nan, np.inf, -np.inf
    x = mx.array(raw)
    (y,) = prog.run(1, fl.gemv_args(x, w, guard=GUARD))
    with np.errstate(all="ignore"):
        want = f64(x) @ f64(w).T
    assert np.array_equal(np.isnan(y[:-GUARD]), np.isnan(want))
    assert np.array_equal(np.isposinf(y[:-GUARD]), np.isposinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(y[:-GUARD][finite], want[finite], rtol=0, atol=2e-5 * np.abs(want[finite]).max())
