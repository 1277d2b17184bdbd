"""exl3_rows_in and exl3_rows_out on the GPU (the two sides of a many-row EXL3 linear around
f16_gemm, docs/exl3.md#many-row-transforms), with the kernel contract: against float64 (the
input side's roundings to fp16, H128, the output side's H128 ⊙ svh + bias rounded once), NaN and
inf inputs where float64 has them, outputs poisoned before launch with guard rows untouched, rows
that no dst names keeping the launch's fill, five repeats byte-identical, the launch limit
declared."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.kernels import exl3 as launch

pytestmark = pytest.mark.gpu

H = np.array([[(-1) ** bin(i & j).count("1") for j in range(128)] for i in range(128)], np.float64) / np.sqrt(128)


def _h128(v):
    return (v.reshape(*v.shape[:-1], -1, 128) @ H).reshape(v.shape)


def _bytes_equal(runs):
    return all(np.array_equal(r.view(np.uint8), runs[0].view(np.uint8)) for r in runs)


def test_rows_in_against_float64_nonfinite_guards_repeats():
    rng = np.random.default_rng(1)
    T, width, k, E, R = 40, 300, 384, 3, 57
    x = rng.standard_normal((T, width)).astype(np.float32)
    x[3, 7], x[5, 200] = np.nan, np.inf
    xb = mx.array(x).astype(mx.bfloat16)
    suh = mx.array((rng.choice([-1.0, 1.0], (E, k)) * rng.uniform(0.5, 2, (E, k))).astype(np.float16))
    src, e = rng.integers(0, T, R).astype(np.int32), rng.integers(0, E, R).astype(np.int32)
    call = launch.rows_in_args(xb, mx.array(src), mx.array(e), suh, guard=2, init_value=float("nan"))
    runs = [np.array(launch.ROWS_IN(**call)[0]) for _ in range(5)]
    assert _bytes_equal(runs) and np.all(np.isnan(runs[0][R:]))
    x64 = np.zeros((T, k))
    x64[:, :width] = np.array(xb.astype(mx.float32))
    scaled = (x64[src] * np.array(suh, np.float64)[e]).astype(np.float16).astype(np.float64)
    with np.errstate(invalid="ignore"):
        want = _h128(scaled).astype(np.float16)
    got = runs[0][:R]
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)])
    finite = np.isfinite(want)
    ulp = np.spacing(np.abs(want[finite]).astype(np.float16)).astype(np.float64)
    assert np.all(np.abs(got[finite].astype(np.float64) - want[finite]) <= ulp)  # at most one fp16 step
    with pytest.raises(ValueError, match="declared limit"):
        launch.ROWS_IN(**dict(call, threadgroup=(512, 1, 1)))


@pytest.mark.parametrize("out_dtype,round_bf16", [(mx.bfloat16, False), (mx.float32, True), (mx.float16, False)])
def test_rows_out_against_float64_dst_fill_repeats(out_dtype, round_bf16):
    rng = np.random.default_rng(2)
    R, n, E, out_rows = 45, 256, 4, 60
    acc = rng.standard_normal((R, n)).astype(np.float32)
    acc[4, 9] = np.nan
    svh = rng.uniform(-2, 2, (E, n)).astype(np.float16)
    bias = rng.standard_normal(n).astype(np.float16)
    e = rng.integers(0, E, R).astype(np.int32)
    dst = rng.permutation(out_rows)[:R].astype(np.int32)
    call = launch.rows_out_args(
        mx.array(acc), mx.array(e), mx.array(dst), mx.array(svh), mx.array(bias), out_rows, out_dtype, round_bf16, 0
    )
    runs = [np.array(launch.ROWS_OUT(**call)[0].astype(mx.float32)) for _ in range(5)]
    assert _bytes_equal(runs)
    untouched = np.setdiff1d(np.arange(out_rows), dst)
    assert np.all(runs[0][untouched] == 0)  # the launch's fill
    with np.errstate(invalid="ignore"):
        want = _h128(acc.astype(np.float64)) * svh.astype(np.float64)[e] + bias.astype(np.float64)
    got = runs[0][dst]
    assert np.array_equal(np.isnan(got), np.isnan(want))
    finite = np.isfinite(want)
    step = 2.0**-7 if (round_bf16 or out_dtype == mx.bfloat16) else (2.0**-10 if out_dtype == mx.float16 else 2.0**-20)
    assert np.all(np.abs(got[finite] - want[finite]) <= step * np.abs(want[finite]) + 1e-6)
    with pytest.raises(ValueError, match="declared limit"):
        launch.ROWS_OUT(**dict(call, threadgroup=(512, 1, 1)))
