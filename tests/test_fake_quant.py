"""QAT fake quantization (docs/model.md#fake-quant), element by element.

Oracles: ml_dtypes' float8_e4m3fn / float4_e2m1fn casts (round-to-nearest-even, independent of our
code) inside their finite range; hand-derived known answers for the tie table, saturation and the
e4m3 (not power-of-two) scale; np.frexp for exact power-of-two scales.
"""

from __future__ import annotations

import ml_dtypes
import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.model.fake_quant import (
    E2M1,
    E4M3,
    fake_quant_fp4,
    fake_quant_fp8,
    round_to_grid,
    ue8m0_scale,
)


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.int32)


def _grid_values(dtype) -> np.ndarray:
    """Every finite non-negative value of an ml_dtypes float type (one code per byte), ascending."""
    vals = np.arange(2 ** ml_dtypes.finfo(dtype).bits, dtype=np.uint8).view(dtype).astype(np.float64)
    return np.unique(vals[np.isfinite(vals) & (vals >= 0)])


def _probe_points(grid: np.ndarray) -> np.ndarray:
    """Grid values, every midpoint between neighbours (the ties), and the fp32 neighbours of each."""
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    pts = np.concatenate(
        [grid.astype(np.float32), mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(0))]
    )
    return np.concatenate([pts, -pts])


@pytest.mark.parametrize("grid, dtype", [(E4M3, ml_dtypes.float8_e4m3fn), (E2M1, ml_dtypes.float4_e2m1fn)])
def test_round_to_grid_matches_ml_dtypes_at_every_value_tie_and_neighbour(grid, dtype):
    values = _grid_values(dtype)
    assert values.max() == grid.max_value
    pts = _probe_points(values)
    got = np.array(round_to_grid(mx.array(pts), grid))
    want = pts.astype(dtype).astype(np.float32)
    bad = np.flatnonzero(_bits(got) != _bits(want))
    assert bad.size == 0, f"{bad.size} mismatches, e.g. {pts[bad[:5]]} -> {got[bad[:5]]}, want {want[bad[:5]]}"


@pytest.mark.parametrize(
    "grid, dtype, scale", [(E4M3, ml_dtypes.float8_e4m3fn, 448.0), (E2M1, ml_dtypes.float4_e2m1fn, 6.0)]
)
def test_round_to_grid_matches_ml_dtypes_on_random_values(grid, dtype, scale):
    rng = np.random.default_rng(0)
    # Magnitudes from far below the smallest subnormal up to the largest finite value.
    x = (rng.uniform(-1, 1, 200_000) * 2.0 ** rng.uniform(-14, 0, 200_000) * scale).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, 2.0**-10, -(2.0**-10)])])
    got = np.array(round_to_grid(mx.array(x), grid))
    want = x.astype(dtype).astype(np.float32)
    assert np.array_equal(_bits(got), _bits(want))


def test_fp4_tie_table():
    # docs/model.md#fake-quant: ties at 0.25, 1.25, 2.5, 5 round down; at 0.75, 1.75, 3.5 round up
    # (to even).
    ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = np.float32([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    got = np.array(round_to_grid(mx.array(np.concatenate([ties, -ties])), E2M1))
    assert np.array_equal(got, np.concatenate([want, -want]))


def test_e4m3_ties_go_to_even_mantissa():
    # Hand-derived: in [1, 2) the step is 1/8; 1 + 1/16 lies between 1.000 (even) and 1.125 (odd).
    cases = {
        1.0625: 1.0,
        1.1875: 1.25,
        2**-9 * 0.5: 0.0,
        2**-9 * 1.5: 2**-8,
        2**-9 * 2.5: 2**-8,
        240.0: 240.0,
        248.0: 256.0,
        440.0: 448.0,
    }
    x = np.float32(list(cases))
    assert np.array_equal(np.array(round_to_grid(mx.array(x), E4M3)), np.float32(list(cases.values())))


def test_saturation_clamps_to_the_largest_finite_value():
    # The reference clamps to ±448 before casting (ml_dtypes would give NaN above 464 instead).
    x = np.float32([448.0, 449.0, 464.0, 470.0, 1e30, np.inf, -500.0, -np.inf])
    assert np.array_equal(
        np.array(round_to_grid(mx.array(x), E4M3)), np.float32([448, 448, 448, 448, 448, 448, -448, -448])
    )
    x4 = np.float32([6.0, 6.5, 7.0, 100.0, -9.0])
    assert np.array_equal(np.array(round_to_grid(mx.array(x4), E2M1)), np.float32([6, 6, 6, 6, -6]))


def test_nan_propagates():
    assert np.isnan(np.array(round_to_grid(mx.array([np.nan]), E4M3))).all()


def _ceil_log2_pow2(y: np.ndarray) -> np.ndarray:
    """2^ceil(log2 y) from frexp: y = m·2^e, m in [0.5, 1)."""
    m, e = np.frexp(y.astype(np.float64))
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e))


def test_ue8m0_scale_is_the_next_power_of_two():
    one_ulp_up, one_ulp_down = (
        np.nextafter(np.float32(448), np.float32(1e9)),
        np.nextafter(np.float32(448), np.float32(0)),
    )
    amax = np.float32([448.0, one_ulp_up, one_ulp_down, 896.0, 1e-4, 3.0e5])
    got = np.array(ue8m0_scale(mx.array(amax), 448.0))
    assert np.array_equal(got[:4], np.float32([1.0, 2.0, 1.0, 2.0]))
    rng = np.random.default_rng(1)
    amax = (2.0 ** rng.uniform(-20, 20, 10_000)).astype(np.float32)
    for qmax in (448.0, 6.0):
        y = (amax / np.float32(qmax)).astype(np.float32)
        assert np.array_equal(np.array(ue8m0_scale(mx.array(amax), qmax)), _ceil_log2_pow2(y).astype(np.float32))


def _blocks_with_spread(shape, block, seed):
    """Random non-zero data whose blocks span many magnitudes, plus an all-zero block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 2.0 ** rng.integers(-30, 12, (*shape[:-1], shape[-1] // block, 1)).repeat(
        block, -1
    ).reshape(shape)
    x = x.astype(np.float32)
    x[0, :block] = 0.0
    return x


def _oracle_fp8(x, block):
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.maximum(np.abs(b).max(-1, keepdims=True), np.float32(1e-4))
    scale = _ceil_log2_pow2((amax / np.float32(448)).astype(np.float32))
    q = np.clip(b / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return (q * scale).reshape(x.shape)


def _oracle_fp4(x, block, kind):
    b = x.astype(np.float32).reshape(*x.shape[:-1], -1, block)
    amax = np.abs(b).max(-1, keepdims=True)
    if kind == "ue8m0":
        scale = _ceil_log2_pow2((np.maximum(amax, np.float32(6 * 2.0**-126)) / np.float32(6)).astype(np.float32))
    else:
        s = (np.maximum(amax, np.float32(6 * 2.0**-9)) / np.float32(6)).astype(np.float32)
        scale = np.minimum(s, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    q = np.clip((b / scale).astype(np.float32), -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(np.float64)
    return (q * scale).reshape(x.shape)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fake_quant_fp8_block32_ue8m0(dtype):
    x = _blocks_with_spread((6, 512), 32, 2)
    xin = mx.array(x).astype(dtype)
    got = fake_quant_fp8(xin, 32)
    assert got.dtype == dtype
    want = _oracle_fp8(np.array(xin.astype(mx.float32)), 32)
    assert np.array_equal(np.array(got.astype(mx.float32)), want.astype(np.float32))
    assert np.all(np.array(got.astype(mx.float32))[0, :32] == 0)


@pytest.mark.parametrize("block, kind", [(32, "ue8m0"), (16, "e4m3")])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fake_quant_fp4(block, kind, dtype):
    x = _blocks_with_spread((5, 256), block, 3)
    xin = mx.array(x).astype(dtype)
    got = fake_quant_fp4(xin, block, scale=kind)
    assert got.dtype == dtype
    want = _oracle_fp4(np.array(xin.astype(mx.float32)), block, kind)
    assert np.array_equal(np.array(got.astype(mx.float32)), want.astype(np.float32))


def test_fp4_e4m3_scale_is_not_a_power_of_two_and_saturates():
    # Hand-derived (docs/model.md#attention, docs/model.md#fake-quant): amax 5 -> amax/6 = 0.8333 ->
    # e4m3 0.8125 (step 1/16 in [0.5, 1)); 5 / 0.8125 = 6.15 saturates to 6 -> 4.875; 1 / 0.8125 =
    # 1.23 -> 1 -> 0.8125; 2 / 0.8125 = 2.46 -> 2 -> 1.625. A power-of-two scale (1.0) would give 5
    # -> 4, 1 -> 1, 2 -> 2.
    x = np.zeros((1, 16), np.float32)
    x[0, :3] = [5.0, 1.0, 2.0]
    got = np.array(fake_quant_fp4(mx.array(x), 16, scale="e4m3"))[0, :3]
    assert np.array_equal(got, np.float32([4.875, 0.8125, 1.625]))
    # Scale rounding ties to even: amax/6 = 1.0625 -> 1.0, amax/6 = 1.1875 -> 1.25.
    y = np.zeros((2, 16), np.float32)
    y[0, 0], y[1, 0] = 6 * 1.0625, 6 * 1.1875
    got = np.array(fake_quant_fp4(mx.array(y), 16, scale="e4m3"))[:, 0]
    assert np.array_equal(got, np.float32([6.0 * 1.0, 6.0 * 1.25]))  # 6.375/1 -> 6; 7.125/1.25 = 5.7 -> 6


def test_amax_floors_keep_tiny_blocks_finite():
    tiny = np.full((1, 32), 1e-30, np.float32)
    for out in (
        fake_quant_fp8(mx.array(tiny), 32),
        fake_quant_fp4(mx.array(tiny), 32),
        fake_quant_fp4(mx.array(tiny), 16, scale="e4m3"),
    ):
        assert np.all(np.isfinite(np.array(out)))
    # e4m3 floor: scale 2^-9, so 2^-9 * 1.0 survives as 2^-9 * 1 and smaller values flush to 0.
    x = np.zeros((1, 16), np.float32)
    x[0, :2] = [2.0**-9, 2.0**-12]
    assert np.array_equal(np.array(fake_quant_fp4(mx.array(x), 16, scale="e4m3"))[0, :2], np.float32([2.0**-9, 0]))


def test_bad_input_raises():
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        fake_quant_fp8(mx.zeros((2, 48)), 32)
    with pytest.raises(ValueError, match="scale must be"):
        fake_quant_fp4(mx.zeros((2, 32)), 32, scale="e8m0")
