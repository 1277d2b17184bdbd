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
    for n in (0, 57, 99):
        assert y[0, n].view(np.uint32) == ordered_sum(xs[0], ws[n], 8).view(np.uint32), n
    assert dict(fl.gemv_args(x, w)["template"])["SPLIT"] == 8
    assert dict(fl.gemv_args(x, mx.zeros((fl.SPLIT_BELOW_N, K), mx.bfloat16))["template"])["SPLIT"] == 1


def ordered_sum(x, w, split: int) -> np.float32:
    """One output as fp32_gemv sums it: lane l of each of `split` ranges of k's 8-element chunks
    FMAs its chunks l, l + 32, ... in order (fp32 roundings; products of bf16 / fp32 values are
    exact in float64), a xor butterfly over the 32 lanes, the range sums added in range order."""
    C = x.size // 8
    total = None
    for s in range(split):
        lanes = np.zeros(32, np.float32)
        for c in range(s * C // split, (s + 1) * C // split):
            lane = (c - s * C // split) % 32
            for e in range(8):
                lanes[lane] = np.float32(np.float64(x[8 * c + e]) * np.float64(w[8 * c + e]) + np.float64(lanes[lane]))
        for o in (16, 8, 4, 2, 1):
            lanes = (lanes + lanes[np.arange(32) ^ o]).astype(np.float32)
        total = lanes[0] if total is None else np.float32(total + lanes[0])
    return total


@pytest.mark.parametrize("rows, w_dtype, split", [(1, mx.float32, 8), (2, mx.bfloat16, 8), (1, mx.bfloat16, 1)])
def test_many_chunks_per_lane_keep_the_chunk_order(rows, w_dtype, split):
    """A long k (the mHC mixes' fn: 20,480 wide, 10 chunks a lane): a lane's loads are issued U
    chunks at a time, its FMAs stay in chunk order: every output is `ordered_sum`'s bytes (k of
    2,405 chunks: ranges of 300 / 301, passes that end inside a group of U)."""
    k, n = 8 * 2405, 24 if split == 8 else 40
    rng = np.random.default_rng(11)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
    w = mx.array((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)).astype(w_dtype)
    call = fl.gemv_args(x, w, guard=GUARD, split=split)
    (y,) = exl3_sim.build([(fl.GEMV, call)], mma=True).run(0)
    assert np.all(np.isnan(y[-GUARD:]))
    xs, ws = np.array(x), np.array(w.astype(mx.float32))
    for m in range(rows):
        for j in (0, 13, n - 1):
            assert y[m, j].view(np.uint32) == ordered_sum(xs[m], ws[j], split).view(np.uint32), (m, j)


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
