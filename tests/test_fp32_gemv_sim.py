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

K, N, GUARD = 1064, 100, 2  # K: 133 chunks, ranges of 16 or 17 (split 8); N: split 1 leaves the
# last threadgroup of 32 outputs partly past the end
CASES = [  # rows, x dtype, w dtype, SIMD groups per output (None: the default for N, 8)
    (1, mx.float32, mx.bfloat16, None),
    (8, mx.float32, mx.bfloat16, None),
    (3, mx.bfloat16, mx.float16, None),
    (2, mx.bfloat16, mx.float32, None),  # the mHC mixes' fp32 `fn`
    (1, mx.float32, mx.bfloat16, 1),  # as the head runs (N >= SPLIT_BELOW_N)
    (8, mx.float32, mx.bfloat16, 1),
    (3, mx.bfloat16, mx.float32, 1),
]


def _data(seed, rows, x_dtype, w_dtype, split=None):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((rows, K)).astype(np.float32)).astype(x_dtype)
    w = mx.array((rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)).astype(w_dtype)
    return x, w


def f64(a):
    return np.array(a.astype(mx.float32), np.float64)


@pytest.fixture(scope="module")
def program():
    specs = [(fl.GEMV, fl.gemv_args(*_data(i, *c), guard=GUARD, split=c[3])) for i, c in enumerate(CASES)]
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


@pytest.mark.parametrize("solo_case,batched_case", [(0, 1), (4, 5)])
def test_a_row_has_the_same_bytes_solo_and_batched(program, solo_case, batched_case):
    prog, specs = program
    x, w = _data(batched_case, *CASES[batched_case])
    (batched,) = prog.run(batched_case)
    solo_call = fl.gemv_args(x[5:6], w, guard=GUARD, split=CASES[batched_case][3])
    (solo,) = prog.run(solo_case, solo_call)
    assert np.array_equal(solo[0].view(np.uint32), batched[5].view(np.uint32))


def test_split_sums_the_ranges_in_order(program):
    """Split 8: each output is the 8 range sums (lanes over a range's chunks, butterfly) added in
    range order; and the default split follows N."""
    prog, _ = program
    x, w = _data(0, *CASES[0])
    (y,) = prog.run(0)
    xs, ws = np.array(x, np.float32), np.array(w.astype(mx.float32), np.float32)
    C = K // 8
    for n in (0, 57, 99):
        ranges = []
        for s in range(8):
            lanes = np.zeros(32, np.float32)
            for c in range(s * C // 8, (s + 1) * C // 8):
                for e in range(8):  # each lane's FMAs, rounded to fp32 (products of bf16 and fp32 are exact in float64)
                    lanes[(c - s * C // 8) % 32] = np.float32(
                        np.float64(xs[0, 8 * c + e]) * np.float64(ws[n, 8 * c + e])
                        + np.float64(lanes[(c - s * C // 8) % 32])
                    )
            for o in (16, 8, 4, 2, 1):
                lanes = (lanes + lanes[np.arange(32) ^ o]).astype(np.float32)
            ranges.append(lanes[0])
        total = ranges[0]
        for r in ranges[1:]:
            total = np.float32(total + r)
        assert y[0, n].view(np.uint32) == total.view(np.uint32), n
    assert dict(fl.gemv_args(x, w)["template"])["SPLIT"] == 8
    assert dict(fl.gemv_args(x, mx.zeros((fl.SPLIT_BELOW_N, K), mx.bfloat16))["template"])["SPLIT"] == 1


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
