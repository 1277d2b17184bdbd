"""Official FP8 (32x32 block E8M0) and FP4 (E2M1, per-32 E8M0) weights → MLX mxfp8 / mxfp4,
checked against float64 decoding of the raw codes."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_dsv41.quant.official import (
    E2M1_VALUES,
    FormatError,
    dequantize_fp4,
    dequantize_fp8_block,
    e4m3_values,
    fp4_to_mxfp4,
    fp8_block_to_mxfp8,
    mx_quantized_linear,
)

rng = np.random.default_rng(7)


def _fp8_case(out, inp):
    codes = rng.integers(0, 256, (out, inp)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3A  # no NaN codes in a real checkpoint
    scale = rng.integers(112, 136, (-(-out // 32), -(-inp // 32))).astype(np.uint8)
    tile = np.repeat(np.repeat(scale.astype(np.float64) - 127, 32, 0), 32, 1)[:out, :inp]
    return codes, scale, e4m3_values()[codes] * np.exp2(tile)


def _fp4_case(out, inp):
    nib = rng.integers(0, 16, (out, inp)).astype(np.uint8)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8).view(np.int8)
    scale = rng.integers(118, 134, (out, inp // 32)).astype(np.uint8)
    return packed, scale, E2M1_VALUES[nib] * np.exp2(np.repeat(scale.astype(np.float64) - 127, 32, 1))


def test_e4m3_table_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    ref = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    ours = e4m3_values()
    assert np.array_equal(np.isnan(ref), np.isnan(ours))
    assert np.array_equal(ref[~np.isnan(ref)], ours[~np.isnan(ours)])


@pytest.mark.parametrize("out,inp", [(64, 96), (40, 64), (96, 32)])  # 40: partial last row tile
def test_fp8_block_exact(out, inp):
    codes, scale, ref = _fp8_case(out, inp)
    dense = dequantize_fp8_block(mx.array(codes), mx.array(scale), dtype=mx.float32)
    assert np.array_equal(np.array(dense), ref)
    wq, rows = fp8_block_to_mxfp8(mx.array(codes), mx.array(scale))
    x = rng.standard_normal((3, inp)).astype(np.float32)
    layer = mx_quantized_linear(wq, rows, "mxfp8")
    y = np.array(layer(mx.array(x)))
    np.testing.assert_allclose(y, x.astype(np.float64) @ ref.T, rtol=1e-4, atol=1e-4 * np.abs(ref).max() * inp)


def test_fp4_exact():
    packed, scale, ref = _fp4_case(48, 128)
    dense = dequantize_fp4(mx.array(packed), mx.array(scale), dtype=mx.float32)
    assert np.array_equal(np.array(dense), ref)
    wq, sc = fp4_to_mxfp4(mx.array(packed), mx.array(scale))
    x = rng.standard_normal((2, 128)).astype(np.float32)
    y = np.array(mx_quantized_linear(wq, sc, "mxfp4")(mx.array(x)))
    np.testing.assert_allclose(y, x.astype(np.float64) @ ref.T, rtol=1e-4, atol=1e-3)


def test_bad_inputs_are_named():
    codes, scale, _ = _fp8_case(64, 64)
    with pytest.raises(FormatError, match="wq_a.*tile"):
        fp8_block_to_mxfp8(mx.array(codes), mx.array(scale[:1]), name="wq_a")
    bad = scale.copy()
    bad[0, 0] = 255
    with pytest.raises(FormatError, match="255"):
        fp8_block_to_mxfp8(mx.array(codes), mx.array(bad))
    with pytest.raises(FormatError, match="F8_E4M3"):
        fp8_block_to_mxfp8(mx.array(codes.astype(np.float32)), mx.array(scale))
    packed, s4, _ = _fp4_case(8, 64)
    with pytest.raises(FormatError, match="one per 32"):
        fp4_to_mxfp4(mx.array(packed), mx.array(s4[:, :1]))
